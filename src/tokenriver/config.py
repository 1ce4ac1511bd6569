"""EngineConfig: every engine knob, frozen and validated once.

Components receive the fields they need as arguments; nothing reads
environment variables deep in the code. The CLI builds its flags from these
fields. Stdlib only.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from tokenriver.errors import InvalidParameterError

# What the KV pool may store: "auto" is the compute dtype; float16 under a float32 model halves the pool's bytes
# per token (twice the tokens in the same memory, half the bytes read per attention step) for one rounding of
# each key and value, as llama.cpp's default f16 cache does; int8 (kv/cache.py's format, about llama.cpp's q8_0
# cache type) takes 53% of float16's bytes for the embedded model.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")
_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
               "kib": 1024, "mib": 1024**2, "gib": 1024**3}


def parse_size(text: str | int) -> int:
    """'2GiB', '512MiB', '1.5GB' or a plain byte count → bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise InvalidParameterError(
            f"kv_cache_memory={text!r} is not a size: write bytes or a number with a unit, e.g. 2GiB, 512MiB, 1GB",
            param="kv_cache_memory")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def default_num_threads() -> int:
    """One thread per core this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@dataclass(frozen=True)
class EngineConfig:
    """How the engine loads its model and shares the machine between requests."""

    # GGUF file or Hugging Face model folder; None = the embedded default model.
    model: str | None = None
    # Compute dtype: "float32" or "bfloat16".
    dtype: str = "float32"
    # Weight format: "auto" keeps GGUF Q4_0/Q4_1/Q8_0 weights packed (4/8-bit kernels) and float weights float;
    # "none" dequantizes everything to dtype; "int8" / "int4" also quantize float weights at load.
    quantization: str = "auto"
    # Quantized weights (4- or 8-bit) multiply activations rounded to int8 per 32 columns in decode-sized products,
    # as llama.cpp does (models/quant.py): faster single-stream decode with 4-bit weights. Larger products (prefill,
    # big batches) round their activations the same way where the CPU has AVX512-VNNI. Logits no longer exactly the
    # reference's.
    int8_activations: bool = False
    # torch device string ("cpu", "cuda", ...).
    device: str = "cpu"
    # Dtype the KV pool stores keys and values in (KV_CACHE_DTYPES); "auto" = dtype; "int8": kv/cache.py's format.
    kv_cache_dtype: str = "auto"
    # Bytes for the paged KV pool; None = sized from max_num_kv_tokens.
    kv_cache_memory: int | None = None
    # KV pool size in tokens when kv_cache_memory is not given; None = max_num_seqs full contexts, capped at 256Ki tokens.
    max_num_kv_tokens: int | None = None
    # Tokens per KV block.
    block_size: int = 16
    # Cap on requests running at once.
    max_num_seqs: int = 64
    # Cap on tokens computed in one step (prompt chunks plus decode tokens).
    max_num_batched_tokens: int = 2048
    # Multi-step scheduling: forward passes per step when every scheduled request is a plain greedy decode, each
    # pass after the first decoding the token the one before sampled. Scheduling, bookkeeping and output
    # processing then run once for all of them; tokens arrive in bursts of this many, and a request that stops
    # mid-step (EOS) has the rest computed and dropped. 1 = one pass per step.
    num_scheduler_steps: int = 1
    # Longest sequence (prompt + output); None = the model's context length.
    max_model_len: int | None = None
    # Reuse KV blocks of identical prompt prefixes.
    enable_prefix_caching: bool = True
    # Keep K/V between steps (False recomputes the whole sequence every step, to show what the cache saves).
    use_kv_cache: bool = True
    # CPU threads for torch; None = the cores available.
    num_threads: int | None = None
    # Seed of the engine's generator for requests without their own seed.
    seed: int = 0
    # Speculative decoding's proposer; None = off. "ngram": drafts copied from earlier text of the same request
    # (prompt lookup, no second model); "self:N": the model's own first N layers plus its output head;
    # anything else: the path of a draft model that shares the model's tokenizer.
    speculative_draft: str | None = None
    # Draft tokens proposed per request and step, all verified in one forward pass of the model.
    num_speculative_tokens: int = 4
    # The n-gram proposer looks up the longest suffix of the request's tokens, from ngram_max tokens down to
    # ngram_min, among its earlier tokens and proposes what followed it there.
    ngram_max: int = 4
    ngram_min: int = 2
    # Tensor parallelism: ranks (processes) the model's attention heads and MLP features are split across, one
    # all-reduce per attention block and per MLP block (distributed/); rank 0 schedules. 1 = one process.
    tensor_parallel_size: int = 1
    # host:port where the ranks meet (rank 0's machine); None = a free local port (one machine), or env:// under
    # torchrun.
    distributed_init_addr: str | None = None
    # Machines the ranks span, and which one this is (0 runs the engine, the others only their ranks).
    nnodes: int = 1
    node_rank: int = 0

    def __post_init__(self) -> None:
        if self.quantization not in ("auto", "none", "int8", "int4"):
            raise InvalidParameterError(f"quantization={self.quantization!r} is not supported: use auto, none, "
                                        f"int8 or int4", param="quantization")
        if self.int8_activations and self.quantization == "none":
            raise InvalidParameterError("int8_activations applies to quantized weights, and quantization='none' "
                                        "leaves none: use quantization 'auto' (a GGUF's packed weights), 'int4' or "
                                        "'int8'", param="int8_activations")
        if self.dtype not in ("float32", "bfloat16"):
            raise InvalidParameterError(f"dtype={self.dtype!r} is not supported: use 'float32' or 'bfloat16'",
                                        param="dtype")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidParameterError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported: use "
                                        f"{', '.join(KV_CACHE_DTYPES)}", param="kv_cache_dtype")
        if self.kv_cache_memory is not None:
            object.__setattr__(self, "kv_cache_memory", parse_size(self.kv_cache_memory))
            if self.kv_cache_memory <= 0:
                raise InvalidParameterError("kv_cache_memory must be positive, e.g. 2GiB", param="kv_cache_memory")
        for name, low in (("block_size", 1), ("max_num_seqs", 1), ("max_num_batched_tokens", 1),
                          ("num_scheduler_steps", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise InvalidParameterError(f"{name}={value!r} must be an integer >= {low}", param=name)
        for name in ("max_num_kv_tokens", "max_model_len", "num_threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise InvalidParameterError(f"{name}={value!r} must be an integer >= 1 or unset", param=name)
        self._validate_speculative()
        self._validate_parallel()
        if self.num_scheduler_steps > 1 and self.speculative_draft is not None:
            raise InvalidParameterError("num_scheduler_steps > 1 does not combine with speculative decoding (a step "
                                        "verifies drafts in one pass): set one of them", param="num_scheduler_steps")
        if self.num_scheduler_steps > 1 and not self.use_kv_cache:
            raise InvalidParameterError("num_scheduler_steps > 1 needs use_kv_cache: without the cache every step "
                                        "recomputes the whole sequence", param="num_scheduler_steps")
        if self.max_num_batched_tokens < self.block_size:
            raise InvalidParameterError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be at least block_size={self.block_size}",
                param="max_num_batched_tokens")

    @property
    def resolved_kv_cache_dtype(self) -> str:
        """The dtype name the KV pool is allocated in ("auto" resolved)."""
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    def _validate_parallel(self) -> None:
        for name in ("tensor_parallel_size", "nnodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidParameterError(f"{name}={value!r} must be an integer >= 1", param=name)
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise InvalidParameterError(f"node_rank={self.node_rank!r} must be in 0..nnodes-1 ({self.nnodes - 1})",
                                        param="node_rank")
        if self.tensor_parallel_size % self.nnodes:
            raise InvalidParameterError(
                f"tensor_parallel_size={self.tensor_parallel_size} must be a multiple of nnodes={self.nnodes} "
                f"(the same number of ranks on every machine)", param="tensor_parallel_size")
        if self.nnodes > 1 and self.distributed_init_addr is None:
            raise InvalidParameterError("nnodes > 1 needs distributed_init_addr, the head machine's host:port",
                                        param="distributed_init_addr")
        if self.tensor_parallel_size > 1 and self.speculative_draft is not None:
            raise InvalidParameterError("speculative decoding does not run under tensor parallelism yet: drop "
                                        "speculative_draft or use tensor_parallel_size=1", param="speculative_draft")

    def _validate_speculative(self) -> None:
        for name in ("num_speculative_tokens", "ngram_max", "ngram_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidParameterError(f"{name}={value!r} must be an integer >= 1", param=name)
        if self.ngram_min > self.ngram_max:
            raise InvalidParameterError(f"ngram_min={self.ngram_min} must be <= ngram_max={self.ngram_max}",
                                        param="ngram_min")
        draft = self.speculative_draft
        if draft is None:
            return
        if not isinstance(draft, str) or not draft:
            raise InvalidParameterError(f"speculative_draft={draft!r} must be 'ngram', 'self:N' or a model path",
                                        param="speculative_draft")
        if draft.startswith("self:") and not re.fullmatch(r"self:[1-9][0-9]*", draft):
            raise InvalidParameterError(
                f"speculative_draft={draft!r}: write self:N with N the number of the model's first layers "
                f"the draft runs, e.g. self:4", param="speculative_draft")
        if not self.use_kv_cache:
            raise InvalidParameterError(
                "speculative decoding verifies drafts against the KV cache: drop speculative_draft, or keep "
                "use_kv_cache on", param="speculative_draft")
