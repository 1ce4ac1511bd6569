"""models/layers.py, config.py and registry.py against transformers' Llama building blocks."""

from __future__ import annotations

import pytest
import torch

from tokenriver.errors import ModelLoadError
from tokenriver.models.config import ModelConfig
from tokenriver.models.layers import (
    RMSNorm,
    RotaryEmbedding,
    SwiGLUMLP,
    apply_rotary,
    apply_rotary_,
    rope_inv_freq,
    silu_and_mul_torch,
)
from tokenriver.models.llama import FUSED_PROJECTIONS, LlamaForCausalLM
from tokenriver.models.registry import canonical_architecture, model_class

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def hf_config(rope_parameters: dict) -> "transformers.LlamaConfig":
    return transformers.LlamaConfig(
        hidden_size=2048,
        num_attention_heads=32,
        head_dim=64,
        max_position_embeddings=131072,
        rope_parameters=rope_parameters,
    )


@pytest.mark.parametrize("scaling", [None, LLAMA3, {"rope_type": "linear", "factor": 4.0}])
def test_rope_frequencies_equal_transformers(scaling):
    parameters = {"rope_type": "default", "rope_theta": 500000.0, **(scaling or {})}
    config = hf_config(parameters)
    if scaling is None:
        expected, _ = modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    assert torch.equal(rope_inv_freq(64, 500000.0, scaling), expected)


def test_freq_factors_reproduce_llama3_scaling():
    """llama.cpp stores Llama 3 scaling as divisors of the plain frequencies (the rope_freqs tensor)."""
    plain, llama3 = rope_inv_freq(64, 500000.0, None), rope_inv_freq(64, 500000.0, LLAMA3)
    factors = (plain / llama3).tolist()
    got = rope_inv_freq(64, 500000.0, {"rope_type": "freq_factors", "factors": factors})
    assert torch.allclose(got, llama3, rtol=1e-6, atol=0)


def test_rotary_embedding_equals_transformers():
    config = hf_config({"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3})
    reference = modeling_llama.LlamaRotaryEmbedding(config)
    ours = RotaryEmbedding(64, 500000.0, LLAMA3, 131072)
    # Out of order, repeated, and beyond the first cos/sin table (which grows on demand).
    positions = torch.tensor([0, 5, 1, 4095, 4096, 9000, 5, 70000])
    query, key = torch.randn(len(positions), 32, 64), torch.randn(len(positions), 8, 64)
    cos, sin = reference(query, positions[None])
    want_q, want_k = modeling_llama.apply_rotary_pos_emb(
        query.transpose(0, 1)[None], key.transpose(0, 1)[None], cos, sin
    )
    rope = ours(positions, torch.float32)
    assert torch.equal(apply_rotary(query, *rope), want_q[0].transpose(0, 1))
    assert torch.equal(apply_rotary(key, *rope), want_k[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotating_split_qkv_heads_in_place_rotates_query_and_key_only(dtype):
    # q and k split from one qkv row are rotated as one view (bfloat16 takes the PyTorch ops, as on a GPU):
    # the same bits as each on its own, and v untouched.
    torch.manual_seed(0)
    qkv = torch.randn(6, 4 + 2 * 2, 64).to(dtype)
    query, key, value = qkv.split((4, 2, 2), dim=1)
    cos, sin = RotaryEmbedding(64, 10000.0, None, 512)(torch.tensor([0, 3, 1, 9, 40, 7]), dtype)
    want_q, want_k, want_v = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin), value.clone()
    apply_rotary_(query, key, cos, sin)
    assert torch.equal(query, want_q) and torch.equal(key, want_k) and torch.equal(value, want_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_mlp_equal_transformers(dtype):
    torch.manual_seed(0)
    x = torch.randn(7, 64).to(dtype)
    norm, ref_norm = RMSNorm(64, 1e-5).to(dtype), modeling_llama.LlamaRMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        ref_norm.weight.copy_(norm.weight)
    assert torch.equal(norm(x), ref_norm(x))
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96)
    mlp, ref_mlp = SwiGLUMLP(64, 96).to(dtype), modeling_llama.LlamaMLP(config).to(dtype)
    gate, up = mlp.gate_up_proj.weight.chunk(2)  # the fused weight stacks gate_proj over up_proj
    ref_mlp.load_state_dict({"gate_proj.weight": gate, "up_proj.weight": up, "down_proj.weight": mlp.down_proj.weight})
    with torch.no_grad():
        want = ref_mlp(x)
        # The PyTorch definition reproduces transformers bit for bit; the native silu kernel (float32 on the CPU,
        # no autograd) computes e^x with a polynomial, so it matches to rounding (tests/models/cpu/test_native_ops.py).
        gate_up = mlp.gate_up_proj(x)
        assert torch.equal(mlp.down_proj(silu_and_mul_torch(gate_up)), want)
        torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-6)


def test_parameter_names_are_hugging_faces_with_fused_projections():
    config = ModelConfig(
        architecture="llama",
        vocab_size=32,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        attention_bias=True,
    )
    reference = transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(
            vocab_size=32,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    ours = {name: tuple(p.shape) for name, p in LlamaForCausalLM(config).state_dict().items()}
    expected: dict[str, tuple[int, ...]] = {}
    for name, tensor in reference.state_dict().items():
        for fused, parts in FUSED_PROJECTIONS.items():
            for part in parts:
                name = name.replace(f".{part}.", f".{fused}.")
        # A fused projection's rows are its parts' rows stacked.
        rows = expected.get(name, (0,))[0] + tensor.shape[0]
        expected[name] = (rows, *tensor.shape[1:])
    assert ours == expected


def test_model_config_rejects_inconsistent_shapes():
    base = dict(
        architecture="llama",
        vocab_size=32,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )
    with pytest.raises(ModelLoadError, match="num_heads=4 is not a multiple of num_kv_heads=3"):
        ModelConfig(**{**base, "num_kv_heads": 3})
    with pytest.raises(ModelLoadError, match="num_layers=0 must be a positive integer"):
        ModelConfig(**{**base, "num_layers": 0})
    with pytest.raises(ModelLoadError, match="rope scaling type 'yarn' is not supported"):
        ModelConfig(**base, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ModelLoadError, match="llama3 rope scaling needs"):
        ModelConfig(**base, rope_scaling={"rope_type": "llama3", "factor": 8.0})


def test_registry():
    assert model_class(canonical_architecture("Qwen2ForCausalLM", "x")) is LlamaForCausalLM
    assert canonical_architecture("MistralForCausalLM", "x") == "mistral"
    with pytest.raises(ModelLoadError, match="some/file.gguf: architecture 'gpt2' is not supported"):
        canonical_architecture("gpt2", "some/file.gguf")
