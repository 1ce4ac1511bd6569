"""The engine on a CUDA GPU: the CPU suite's reference comparisons, run there.

A tiny random Llama, saved as a Hugging Face folder with a byte-level tokenizer, is run by tokenriver and by
transformers on the same GPU: logits, greedy continuations, CUDA graphs against eager steps, batch invariance, prefix
caching, speculative decoding, seeded sampling, packed 4-bit weights through the Triton kernel, and no native CPU
kernel anywhere on the path. Float32 where results are compared token for token (the widened random weights give
logits far apart, so equal arithmetic up to rounding gives equal tokens); the bfloat16 default is checked too.
Every test is marked `cuda` and skipped where PyTorch sees no GPU (tests/conftest.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenriver.engine.llm import LLM
from tokenriver.kv.cache import KVCache
from tokenriver.loader.load import load_model
from tokenriver.models.attention import AttentionMetadata
from tokenriver.models.quant import Int4Linear
from tokenriver.params import SamplingParams, StructuredOutput

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))
from arch_reference import random_ids, relative_error, widen, write_byte_tokenizer  # noqa: E402

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
VOCAB = 257  # 256 bytes and <|endoftext|>
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("tiny_llama_cuda")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=VOCAB - 1,
    )
    torch.manual_seed(0)
    widen(transformers.LlamaForCausalLM(config), seed=1).save_pretrained(path, safe_serialization=True)
    write_byte_tokenizer(path)
    return str(path)


@pytest.fixture(scope="module")
def reference(folder):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(DEVICE)
    return model.eval()


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def _engine(folder: str, **options) -> LLM:
    return LLM(folder, device=DEVICE, **{"dtype": "float32", "max_num_kv_tokens": 4096, **options})


PROMPTS = [random_ids(n, 256, seed=n) for n in (3, 17, 40, 70)]


def test_logits_match_transformers_on_the_gpu(folder, reference):
    ids = PROMPTS[2]
    loaded = load_model(folder, dtype="float32", device=DEVICE, quantization="none")
    model, config = loaded.model, loaded.config
    cache = KVCache(config.num_layers, 4, 16, config.num_kv_heads, config.head_dim, torch.float32, DEVICE)
    metadata = AttentionMetadata.build([len(ids)], [len(ids)], [[0, 1, 2]], 16, DEVICE)
    with torch.no_grad():
        hidden = model(torch.tensor(ids, device=DEVICE), torch.arange(len(ids), device=DEVICE), cache, metadata)
        ours = model.compute_logits(hidden)
        want = reference(torch.tensor([ids], device=DEVICE)).logits[0].float()
    assert ours.device.type == torch.device(DEVICE).type
    assert relative_error(ours, want) < 1e-3


def test_greedy_continuations_equal_transformers(folder, reference):
    llm = _engine(folder)
    got = _generate(llm, PROMPTS)
    for ids, tokens in zip(PROMPTS, got):
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([ids], device=DEVICE),
                max_new_tokens=GREEDY.max_tokens,
                min_new_tokens=GREEDY.max_tokens,
                do_sample=False,
            )
        assert tokens == out[0, len(ids) :].tolist()


def test_cuda_graphs_replay_what_eager_steps_compute(folder):
    graphs = _engine(folder)
    eager = _engine(folder, cuda_graphs=False)
    assert _generate(graphs, PROMPTS) == _generate(eager, PROMPTS)
    assert graphs.engine.runner.graphs.num_graphs > 0
    assert eager.engine.runner.graphs is None


def test_batch_invariance(folder):
    llm = _engine(folder, enable_prefix_caching=False)
    together = _generate(llm, PROMPTS)
    alone = [_generate(llm, [ids])[0] for ids in PROMPTS]
    assert together == alone


def test_prefix_caching_reuses_blocks_and_keeps_the_output(folder):
    shared = random_ids(48, 256, seed=11)
    second = shared + random_ids(9, 256, seed=13)
    cached = _engine(folder)
    _generate(cached, [shared + random_ids(5, 256, seed=12)])
    (hit,) = cached.generate([{"prompt_token_ids": second}], GREEDY, use_tqdm=False)
    assert hit.num_cached_tokens >= 48
    uncached = _engine(folder, enable_prefix_caching=False)
    assert list(hit.outputs[0].token_ids) == _generate(uncached, [second])[0]


@pytest.mark.parametrize("draft", ["self:1", "ngram"])
def test_speculative_decoding_keeps_the_greedy_output(folder, draft):
    plain = _generate(_engine(folder), PROMPTS)
    speculative = _engine(folder, speculative_draft=draft, num_speculative_tokens=3)
    assert _generate(speculative, PROMPTS) == plain


def test_seeded_sampling_with_every_stage_runs_on_the_gpu(folder):
    llm = _engine(folder)
    params = SamplingParams(
        max_tokens=16,
        temperature=0.9,
        top_k=40,
        top_p=0.9,
        min_p=0.01,
        repetition_penalty=1.1,
        presence_penalty=0.2,
        frequency_penalty=0.1,
        logit_bias={5: 2.0},
        seed=5,
        logprobs=3,
        ignore_eos=True,
        trace=True,
    )
    first = llm.generate([{"prompt_token_ids": PROMPTS[1]}], params, use_tqdm=False)[0].outputs[0]
    again = llm.generate([{"prompt_token_ids": PROMPTS[1]}], params, use_tqdm=False)[0].outputs[0]
    assert list(first.token_ids) == list(again.token_ids)
    assert len(first.token_ids) == 16 and all(len(entry) >= 3 for entry in first.logprobs)
    assert first.trace is not None and len(first.trace) == 16


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_structured_output_masks_meet_the_logits_on_the_gpu(folder, temperature):
    llm = _engine(folder)
    params = SamplingParams(
        max_tokens=12, temperature=temperature, seed=3, structured_output=StructuredOutput.regex("[a-c]{3}-[0-9]{2}")
    )
    (output,) = llm.generate([{"prompt_token_ids": PROMPTS[1]}], params, use_tqdm=False)
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", output.outputs[0].text)


def test_bfloat16_is_the_default_on_the_gpu(folder):
    llm = LLM(folder, device=DEVICE, max_num_kv_tokens=4096)
    parameter = next(llm.engine.loaded.model.parameters())
    assert parameter.dtype == torch.bfloat16 and parameter.is_cuda
    assert len(_generate(llm, PROMPTS)[0]) == GREEDY.max_tokens


def test_packed_4_bit_weights_stay_packed_and_match_the_cpu(folder):
    gpu = _engine(folder, quantization="int4")
    layers = [m for m in gpu.engine.loaded.model.modules() if isinstance(m, Int4Linear)]
    assert layers and all(
        m.backend == "triton" and m.qweight.is_cuda and m.qweight.dtype == torch.uint8 for m in layers
    )
    cpu = LLM(
        folder, device="cpu", dtype="float32", quantization="int4", reference_numerics=True, max_num_kv_tokens=4096
    )
    assert _generate(gpu, PROMPTS) == _generate(cpu, PROMPTS)


def test_the_kv_pool_takes_the_free_gpu_memory_up_to_what_the_contexts_need(folder):
    llm = _engine(folder, max_num_kv_tokens=None, max_num_seqs=8)
    cache = llm.engine.kv_cache
    assert cache[0][0].is_cuda
    assert cache.num_blocks == 8 * 512 // 16  # 8 full contexts of 512 tokens: the cap, well inside free memory


@pytest.mark.parametrize("kind", ["gemma3", "gemma2", "qwen3_moe"])
def test_windows_soft_capping_and_experts_match_transformers(kind, tmp_path):
    """Sliding windows shorter than the prompts and soft-capped scores inside the recorded graphs (Gemma); a mixture
    of experts, whose step cannot be recorded, falling back to eager steps."""
    from test_gemma_reference import tiny_gemma
    from test_moe_reference import tiny

    reference = tiny_gemma(kind) if kind.startswith("gemma") else tiny(kind)
    reference.save_pretrained(tmp_path, safe_serialization=True)
    write_byte_tokenizer(tmp_path, with_eos=False)
    reference = reference.to(DEVICE)
    llm = _engine(str(tmp_path), quantization="none")  # float experts, as transformers has them
    prompts = [ids[:40] for ids in PROMPTS[2:]]
    for ids, tokens in zip(prompts, _generate(llm, prompts)):
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([ids], device=DEVICE),
                max_new_tokens=GREEDY.max_tokens,
                min_new_tokens=GREEDY.max_tokens,
                do_sample=False,
            )
        assert tokens == out[0, len(ids) :].tolist()
    graphs = llm.engine.runner.graphs
    assert graphs.num_graphs > 0 if kind.startswith("gemma") else not graphs.enabled


def test_no_native_cpu_kernel_is_built_or_called_on_the_gpu_path(folder):
    script = (
        "import sys; from tokenriver.engine.llm import LLM; from tokenriver.params import SamplingParams\n"
        f"llm = LLM({folder!r}, device='cuda', max_num_kv_tokens=4096)\n"
        "llm.generate([{'prompt_token_ids': [1, 2, 3]}], SamplingParams(max_tokens=4, temperature=0.7, seed=1))\n"
        "from tokenriver.models.cpu.kernels import load_kernels\n"
        "sys.exit(load_kernels.cache_info().currsize)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=os.environ.copy(), timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
