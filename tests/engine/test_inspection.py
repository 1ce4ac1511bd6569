"""Inspection of one position (engine/inspection.py) against the model's own forward pass and transformers.

Tiny random Llama, Qwen3, Gemma 2 (soft-capped scores) and Gemma 3 (sliding-window layers) folders, loaded in
float32 without quantization: the last layer's logit lens is the model's next-token distribution at the position,
each layer's lens and attention weights are transformers' (`output_hidden_states`, `output_attentions`, eager
attention), attention rows sum to one and put no weight outside a window. Bad requests are refused, over HTTP with
a 400 in OpenAI's shape.

The same folders quantized, with Phi-3 (a window, partial rotary) and a Qwen3 mixture of experts beside them, run
their layers on the native decoder: the view must be the modules' bit for bit, with int8 and float32 activations,
for contexts on both sides of the GEMV/GEMM switch and longer than the windows.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch

from tokenriver.config import EngineConfig
from tokenriver.engine import inspection
from tokenriver.engine.async_engine import AsyncEngine
from tokenriver.engine.inspection import MAX_INSPECT_TOKENS, inspect_position
from tokenriver.errors import InvalidParameterError
from tokenriver.loader.load import LoadedModel
from tokenriver.models.cpu.kernels import load_kernels
from tokenriver.models.quant import QuantizedLinear

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))
from arch_reference import load_folder, random_ids, run_one, widen  # noqa: E402

transformers = pytest.importorskip("transformers")

SIZES = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)


def tiny_reference(kind: str):
    """A transformers model of `kind` with widened random weights and eager attention (it returns its weights)."""
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES))
    elif kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SIZES, tie_word_embeddings=True))
    elif kind == "phi3":
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
        # Phi-3's head size is hidden / heads: 32, as the others', a size the native attention is compiled for.
        sizes = {k: v for k, v in SIZES.items() if k != "head_dim"} | {"hidden_size": 128}
        config = transformers.Phi3Config(**sizes, rope_parameters=rope, sliding_window=12, pad_token_id=0)
        model = transformers.Phi3ForCausalLM(config)
    elif kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**SIZES, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        from test_gemma_reference import tiny_gemma

        return tiny_gemma(kind)
    model.config._attn_implementation = "eager"
    return widen(model, seed=5)


def as_loaded(model, tokenizer, path: str) -> LoadedModel:
    parameters = {p.data_ptr(): p for p in model.parameters()}.values()
    return LoadedModel(
        model=model,
        config=model.config,
        tokenizer=tokenizer,
        path=path,
        num_parameters=sum(p.numel() for p in parameters),
        num_bytes=sum(p.numel() * p.element_size() for p in parameters),
    )


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma2", "gemma3"])
def pair(request, tmp_path_factory, loaded_float32):
    """(transformers model, the same weights loaded by tokenriver with the embedded model's tokenizer)."""
    reference = tiny_reference(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(folder, safe_serialization=True)
    return reference, as_loaded(load_folder(str(folder)), loaded_float32.tokenizer, str(folder))


def lens_probs(layer: dict) -> dict[int, float]:
    return {entry["token_id"]: entry["prob"] for entry in layer["logit_lens"]}


def test_last_layer_lens_is_the_models_next_token_distribution(pair):
    _, loaded = pair
    ids = random_ids(30, 256, seed=7)
    position = 20
    view = inspect_position(loaded, ids, position, top_k=5)
    want = torch.softmax(run_one(loaded.model, ids)[position], dim=-1)
    got = lens_probs(view["layers"][-1])
    assert list(got) == want.topk(5).indices.tolist()
    for token_id, prob in got.items():
        assert abs(prob - want[token_id].item()) < 1e-4
    assert view["num_layers"] == loaded.config.num_layers and view["position"] == position


def test_lens_and_attention_equal_transformers(pair):
    reference, loaded = pair
    ids = random_ids(24, 256, seed=8)
    position = 17
    view = inspect_position(loaded, ids, position, top_k=3)
    with torch.no_grad():
        out = reference(torch.tensor([ids[: position + 1]]), output_hidden_states=True, output_attentions=True)
    cap = getattr(reference.config, "final_logit_softcapping", None)
    for i, layer in enumerate(view["layers"]):
        # hidden_states[i + 1] is the stream after layer i; the last one has had the final norm already.
        stream = out.hidden_states[i + 1][0, position]
        normed = stream if i == len(view["layers"]) - 1 else reference.model.norm(stream)
        logits = reference.lm_head(normed).float()
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        want = torch.softmax(logits, dim=-1)
        for token_id, prob in lens_probs(layer).items():
            assert abs(prob - want[token_id].item()) < 1e-4, (i, token_id)
        weights = torch.tensor(layer["attention"]["weights"])  # [heads, position + 1]
        torch.testing.assert_close(weights, out.attentions[i][0, :, position, : position + 1], atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(layer["attention"]["mean"]), weights.mean(0))
        assert layer["attention_update_norm"] > 0 and layer["mlp_update_norm"] > 0


def test_attention_rows_sum_to_one_and_stay_inside_the_window(pair):
    _, loaded = pair
    position = 40
    view = inspect_position(loaded, random_ids(41, 256, seed=9), position)
    for i, layer in enumerate(view["layers"]):
        weights = torch.tensor(layer["attention"]["weights"])
        torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[0]))
        window = loaded.config.layer_window(i)
        assert layer["attention"]["window"] == window
        if window > 0:
            assert torch.all(weights[:, : position + 1 - window] == 0)
            assert torch.all(weights[:, position + 1 - window :] > 0)


def test_the_embedded_model(loaded_float32):
    ids = loaded_float32.tokenizer.encode("The capital of France is", add_special_tokens=False)
    view = inspect_position(loaded_float32, ids, len(ids) - 1, top_k=2)
    want = torch.softmax(run_one(loaded_float32.model, ids)[-1], dim=-1)
    top = view["layers"][-1]["logit_lens"][0]
    assert top["token_id"] == int(want.argmax()) and abs(top["prob"] - want.max().item()) < 1e-4
    assert view["tokens"] == [loaded_float32.tokenizer.token_text(t) for t in ids]


@pytest.mark.parametrize(
    ("ids", "position", "top_k", "param"),
    [
        ([], 0, 5, "token_ids"),
        ([1, 2, 3], 3, 5, "position"),
        ([1, 2, 3], -1, 5, "position"),
        ([1, 2, 3], 1, 0, "top_k"),
        ([1, 999, 3], 2, 5, "token_ids"),
        ([1] * (MAX_INSPECT_TOKENS + 1), MAX_INSPECT_TOKENS, 5, "position"),
    ],
)
def test_bad_requests_are_refused(pair, ids, position, top_k, param):
    _, loaded = pair
    with pytest.raises(InvalidParameterError) as refused:
        inspect_position(loaded, ids, position, top_k)
    assert refused.value.param == param


def test_the_route_inspects_and_refuses_with_a_400(loaded_float32):
    from fastapi.testclient import TestClient

    from tokenriver.server.app import build_app
    from tokenriver.server.config import ServerConfig

    engine = AsyncEngine(EngineConfig.from_flat(model=loaded_float32.path, max_num_kv_tokens=1024), loaded_float32)
    try:
        client = TestClient(build_app(engine, ServerConfig()))
        ids = loaded_float32.tokenizer.encode("Hello there", add_special_tokens=False)
        ok = client.post("/v1/visualizer/inspect", json={"token_ids": ids, "position": len(ids) - 1, "top_k": 3})
        assert ok.status_code == 200, ok.text
        assert ok.json() == asyncio.run(engine.inspect(ids, len(ids) - 1, 3))
        too_long = {"token_ids": [1] * (MAX_INSPECT_TOKENS + 1), "position": MAX_INSPECT_TOKENS}
        refused = client.post("/v1/visualizer/inspect", json=too_long)
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "position"
        assert str(MAX_INSPECT_TOKENS) in error["message"]
        assert client.post("/v1/visualizer/inspect", json={"token_ids": ids}).status_code == 400
    finally:
        engine.shutdown()


def as_view_tensors(view: dict) -> dict[str, torch.Tensor]:
    """Every number of a view, as tensors to compare with torch.equal (float64 holds a float's bits exactly)."""
    layers = view["layers"]
    lens = [[(entry["token_id"], entry["prob"]) for entry in layer["logit_lens"]] for layer in layers]
    return {
        "token_ids": torch.tensor(view["token_ids"]),
        "lens": torch.tensor(lens, dtype=torch.float64),
        "weights": torch.tensor([layer["attention"]["weights"] for layer in layers], dtype=torch.float64),
        "mean": torch.tensor([layer["attention"]["mean"] for layer in layers], dtype=torch.float64),
        "windows": torch.tensor([layer["attention"]["window"] for layer in layers]),
        "norms": torch.tensor(
            [(layer["attention_update_norm"], layer["mlp_update_norm"]) for layer in layers], dtype=torch.float64
        ),
    }


@pytest.fixture(
    scope="module",
    params=[
        ("llama", "int4", True),
        ("qwen3", "int8", False),
        ("gemma2", "int8", True),
        ("gemma3", "int4", True),
        ("gemma3", "int8", False),
        ("phi3", "int8", True),
        ("qwen3_moe", "int8", True),
    ],
    ids=lambda param: "-".join(str(part) for part in param),
)
def quantized(request, tmp_path_factory, loaded_float32):
    """A tiny model of each kind with its projections quantized as named, activations rounded to int8 or not."""
    kind, quantization, int8_activations = request.param
    reference = tiny_reference(kind)
    folder = tmp_path_factory.mktemp(f"{kind}-{quantization}")
    reference.save_pretrained(folder, safe_serialization=True)
    model = load_folder(str(folder), quantization)
    for layer in model.modules():
        if isinstance(layer, QuantizedLinear):
            layer.set_int8_activations(int8_activations)
    return as_loaded(model, loaded_float32.tokenizer, str(folder))


@pytest.mark.skipif(load_kernels() is None, reason="the native decoder needs its kernels (x86-64 AVX2, a compiler)")
@pytest.mark.parametrize(("length", "position"), [(70, 69), (70, 40), (6, 5), (30, 0)])
def test_native_layers_give_the_modules_view_bit_for_bit(quantized, monkeypatch, length, position):
    chosen, choose = [], inspection.native_layers

    def spy(*args):
        chosen.append(choose(*args))
        return chosen[-1]

    monkeypatch.setattr(inspection, "native_layers", spy)
    ids = random_ids(length, 256, seed=length + position)
    native = inspect_position(quantized, ids, position, top_k=4)
    assert len(chosen) == 1 and all(decoder is not None for decoder in chosen[0]), "every layer runs natively"
    on_modules = inspect_position(quantized, ids, position, top_k=4, modules_only=True)
    assert len(chosen) == 1, "modules_only runs no layer natively"
    assert native["tokens"] == on_modules["tokens"]
    got, want = as_view_tensors(native), as_view_tensors(on_modules)
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.skipif(load_kernels() is None, reason="the native decoder needs its kernels (x86-64 AVX2, a compiler)")
def test_layers_are_bound_once_and_again_when_their_weights_move(quantized):
    layers = quantized.model.model.layers
    first = inspection.bind_layers(layers)
    assert inspection.bind_layers(layers) is first
    norm = layers[0].input_layernorm.weight
    norm.data = norm.data.clone()  # the same values elsewhere: a decoder bound before reads the old tensor
    again = inspection.bind_layers(layers)
    assert again is not first and all(decoder is not None for decoder in again)


@pytest.mark.skipif(load_kernels() is None, reason="the native decoder needs its kernels (x86-64 AVX2, a compiler)")
def test_a_prefix_the_engine_holds_is_reused_and_the_view_is_the_same_bit_for_bit(quantized, monkeypatch):
    if not any(getattr(layer, "int8_activations", False) for layer in quantized.model.modules()):
        pytest.skip("the engine's exact default numerics round activations to int8")
    from tokenriver.params import SamplingParams

    ids = random_ids(60, 256, seed=11)
    engine = AsyncEngine(EngineConfig.from_flat(model=quantized.path, max_num_kv_tokens=1024), quantized)
    reused, find = [], inspection.cached_prefix

    def spy(*args):
        reused.append(find(*args))
        return reused[-1]

    monkeypatch.setattr("tokenriver.engine.async_engine.cached_prefix", spy)

    async def run_then_inspect(position: int) -> dict:
        async for _ in engine.generate(ids, SamplingParams(max_tokens=1, temperature=0.0)):
            pass
        return await engine.inspect(ids, position, 4)

    try:
        for position in (59, 37):
            view = asyncio.run(run_then_inspect(position))
            assert reused[-1] is not None and reused[-1].num_tokens == position // 16 * 16
            whole = inspect_position(quantized, ids, position, top_k=4, kv_dtype=torch.int8)
            got, want = as_view_tensors(view), as_view_tensors(whole)
            for name in want:
                assert torch.equal(got[name], want[name]), (position, name)
    finally:
        engine.shutdown()


def test_a_prefix_past_the_position_is_refused(loaded_float32):
    prefix = inspection.CachedPrefix(16, [])
    with pytest.raises(ValueError, match="nothing to compute"):
        inspect_position(loaded_float32, list(range(1, 20)), 10, prefix=prefix)
