"""The engine's calls into the Triton kernels (models/cuda): the views, strides and metadata it hands them.

Where no GPU is at hand the kernels run in Triton's interpreter on CPU tensors: the layers' and attention's
dispatch is pointed at them for CPU tensors, and a tiny model's greedy outputs (float32, widened random weights:
logits far apart) must be the ones the PyTorch path gives. Llama covers RMSNorm, rotary on the fused qkv view,
SiLU, the cache writes, decode attention and batched fresh prompts beside a prefix-cache hit; Gemma 3 sliding
windows, q/k norms and GeLU; Gemma 2 soft-capped scores. On a GPU the `cuda` tests run the same kernels for real
(tests/engine).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

from tokenriver.engine.llm import LLM
from tokenriver.models.cpu.kernels import load_kernels
from tokenriver.params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from arch_reference import random_ids, widen, write_byte_tokenizer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _kernels_on_cpu(monkeypatch) -> dict[str, int]:
    """Make the GPU's fast path the one CPU tensors take, its Triton kernels included; the calls each kernel gets,
    counted."""
    import tokenriver.models.cpu.fast_path as cpu_fast_path

    fused_ops = importlib.import_module("tokenriver.models.cuda.fused_ops")
    paged_decode = importlib.import_module("tokenriver.models.cuda.paged_decode")
    kv_write = importlib.import_module("tokenriver.models.cuda.kv_write")
    cuda_attention = importlib.import_module("tokenriver.models.cuda.attention")
    cuda_fast_path = importlib.import_module("tokenriver.models.cuda.fast_path")
    calls: dict[str, int] = {}

    def counted(name, function):
        def call(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return function(*args, **kwargs)

        return call

    for name in ("rms_norm", "rotary_", "silu_and_mul", "gelu_tanh_and_mul"):
        monkeypatch.setattr(fused_ops, name, counted(name, getattr(fused_ops, name)))
    monkeypatch.setattr(paged_decode, "paged_decode_attention", counted("decode", paged_decode.paged_decode_attention))
    monkeypatch.setattr(kv_write, "write_kv", counted("kv_write", kv_write.write_kv))
    monkeypatch.setattr(cpu_fast_path, "load", lambda: cuda_fast_path.CudaFastPath())
    monkeypatch.setattr(cuda_attention, "_takes_triton", lambda x: True)
    return calls


def _model(kind: str, folder: Path) -> str:
    from test_gemma_reference import tiny_gemma

    if kind == "llama":
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=257,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            tie_word_embeddings=False,
            bos_token_id=None,
            eos_token_id=256,
        )
        torch.manual_seed(0)
        model = widen(transformers.LlamaForCausalLM(config), seed=1)
    else:
        model = tiny_gemma(kind)
    model.save_pretrained(folder, safe_serialization=True)
    write_byte_tokenizer(folder, with_eos=kind == "llama")
    return str(folder)


@pytest.mark.parametrize(
    "kind, used",
    [
        ("llama", {"rms_norm", "rotary_", "silu_and_mul", "decode", "kv_write"}),
        ("gemma3", {"rms_norm", "rotary_", "gelu_tanh_and_mul", "decode", "kv_write"}),
        ("gemma2", {"rms_norm", "rotary_", "gelu_tanh_and_mul", "decode", "kv_write"}),
    ],
)
def test_greedy_outputs_equal_the_pytorch_path(kind, used, tmp_path, monkeypatch, request):
    pytest.importorskip("triton", reason="triton is not installed: the CUDA kernels are untested")
    if torch.cuda.is_available():
        pytest.skip("on a GPU the cuda tests run the kernels for real")
    folder = _model(kind, tmp_path)
    # The native CPU kernels would take these float32 CPU tensors first: off for this test, on again after it.
    monkeypatch.setenv("TOKENRIVER_NATIVE_KERNELS", "0")
    load_kernels.cache_clear()
    request.addfinalizer(load_kernels.cache_clear)
    llm = LLM(folder, dtype="float32", kv_cache_dtype="float32", quantization="none", max_num_seqs=8, max_model_len=256)
    prompts = [random_ids(n, 256, seed=n) for n in (30, 25, 40, 33)]
    prompts.append(prompts[2][:36] + [7, 8, 9])  # after the batch above: a prefix-cache hit

    def generate() -> list[list[int]]:
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], GREEDY, use_tqdm=False)
        return [list(output.outputs[0].token_ids) for output in outputs]

    want = generate()
    calls = _kernels_on_cpu(monkeypatch)
    assert generate() == want
    assert used <= set(calls), calls
