"""EngineConfig: every engine knob, frozen and validated once, in parts.

EngineConfig holds what the model is and where it runs (model, device, context length, pooling, seed, CUDA graphs)
and five parts, one frozen dataclass each: NumericsConfig (dtype, weight format, int8 activations),
CacheConfig (the KV pool), SchedulerConfig (the step's budgets), SpeculativeConfig (drafts) and ParallelConfig
(threads, ranks, machines). Each part checks its own fields in its __post_init__; a rule that spans parts is
checked once, in EngineConfig's. Flat keyword arguments (`LLM(max_num_seqs=8)`, the command line, Ray Serve's
args) become parts in one place, EngineConfig.from_flat: every field name is unique across the parts.

Components receive the fields they need as arguments; no engine setting is read from the environment deep in
the code (the variables that are read are listed in docs/development.md). The CLI builds its flags from these
fields: each field's help text lives in its metadata (flags.option), so a knob and its flag are defined once.
Stdlib only.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any

from tokenriver.errors import InvalidParameterError
from tokenriver.flags import option

# What the KV pool may store: "auto" is the compute dtype; float16 under a float32 model halves the pool's bytes
# per token (twice the tokens in the same memory, half the bytes read per attention step) for one rounding of
# each key and value, as llama.cpp's default f16 cache does; int8 (kv/cache.py's format, about llama.cpp's q8_0
# cache type) takes 53% of float16's bytes for the embedded model.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
}


def parse_size(text: str | int) -> int:
    """'2GiB', '512MiB', '1.5GB' or a plain byte count → bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise InvalidParameterError(
            f"kv_cache_memory={text!r} is not a size: write bytes or a number with a unit, e.g. 2GiB, 512MiB, 1GB",
            param="kv_cache_memory",
        )
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def default_num_threads() -> int:
    """One thread per core this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _check_counts(config: object, names: tuple[str, ...], *, optional: bool = False) -> None:
    """Each named field is an integer >= 1 (or None, where optional); the error names the field."""
    for name in names:
        value = getattr(config, name)
        if optional and value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            rule = "an integer >= 1 or unset" if optional else "an integer >= 1"
            raise InvalidParameterError(f"{name}={value!r} must be {rule}", param=name)


@dataclass(frozen=True)
class NumericsConfig:
    """How the model's arithmetic is done: compute dtype, weight format, activation rounding."""

    # Compute dtype: "float32" or "bfloat16"; "auto" is float32 on the CPU and bfloat16 on a GPU, where the tensor
    # cores and the memory bus are built for it (transformers and vLLM default to it there too).
    dtype: str = option(
        "auto", "compute dtype (default: float32 on cpu, bfloat16 on a GPU)", choices=("auto", "float32", "bfloat16")
    )
    # Weight format: "auto" keeps every GGUF quantized type packed (4/5/8-bit kernels; loader/gguf_blocks.py) and
    # float weights float; "none" dequantizes everything to dtype; "int8" / "int4" also quantize float weights at
    # load.
    quantization: str = option(
        "auto",
        "weights: auto keeps a GGUF's quantized matrices packed (every type), none dequantizes to --dtype, "
        "int8/int4 quantize float weights at load",
        choices=("auto", "none", "int8", "int4"),
    )
    # Quantized weights multiply activations rounded to int8 per 32 columns, as llama.cpp does (models/quant.py),
    # in decode-sized products and, where the CPU has AVX512-VNNI, in larger ones. None (the default) = on wherever
    # the weights are quantized on the CPU, unless reference_numerics (a GPU multiplies them with its compute dtype's
    # activations: models/cuda/quant_matmul.py); perplexity stays within 1% of float32
    # (tests/models/test_quant_perplexity.py).
    int8_activations: bool | None = option(
        None,
        "quantized weights multiply activations rounded to int8, as llama.cpp does: faster decode, prefill and "
        "batches, perplexity within 1% of exact float32 (default: on where the weights are quantized, on the CPU)",
    )
    # Exact float32 arithmetic on the stored weights, and a KV pool in the compute dtype: the numerics that match
    # transformers, for tests and comparisons. Off by default: the fast settings above are what users run.
    reference_numerics: bool = option(
        False, "exact float32 products and a KV pool in --dtype, the numerics that match transformers (slower)"
    )

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise InvalidParameterError(
                f"dtype={self.dtype!r} is not supported: use 'auto', 'float32' or 'bfloat16'", param="dtype"
            )
        if self.quantization not in ("auto", "none", "int8", "int4"):
            raise InvalidParameterError(
                f"quantization={self.quantization!r} is not supported: use auto, none, int8 or int4",
                param="quantization",
            )
        if self.int8_activations and self.reference_numerics:
            raise InvalidParameterError(
                "int8_activations rounds activations and reference_numerics asks for exact arithmetic: set one of them",
                param="int8_activations",
            )
        if self.int8_activations and self.quantization == "none":
            raise InvalidParameterError(
                "int8_activations applies to quantized weights, and quantization='none' "
                "leaves none: use quantization 'auto' (a GGUF's packed weights), 'int4' or "
                "'int8'",
                param="int8_activations",
            )


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool: what it stores, how big it is, and whether it is kept and shared at all."""

    # Dtype the KV pool stores keys and values in (KV_CACHE_DTYPES). "auto": int8 (kv/cache.py's format, one scale
    # per token and head) on the CPU with the fast numerics; the compute dtype elsewhere, with reference_numerics,
    # or with int8_activations=False (EngineConfig.resolved_kv_cache_dtype).
    kv_cache_dtype: str = option(
        "auto",
        "what the KV pool stores: auto (int8 with the fast numerics, else --dtype), float32, bfloat16, float16 "
        "(half the memory per token of float32) or int8 (about a quarter: one scale per token and kv head); keys "
        "and values rounded once when stored",
        choices=KV_CACHE_DTYPES,
    )
    # Bytes for the paged KV pool (a size such as "2GiB" is parsed); None = max_num_kv_tokens if given, else 2 GiB
    # on the CPU (a GPU's free memory after the weights, less headroom), capped at what max_num_seqs full contexts
    # could use (engine/core.py).
    kv_cache_memory: int | None = option(
        None,
        "KV pool size, e.g. 2GiB or 512MiB (default: 2GiB on cpu, the free memory on a GPU, capped at what "
        "--max-num-seqs contexts need); "
        "not with --max-num-kv-tokens",
        metavar="SIZE",
        type=str,
    )
    max_num_kv_tokens: int | None = option(
        None, "KV pool size in tokens, instead of --kv-cache-memory", metavar="TOKENS"
    )
    block_size: int = option(16, "tokens per KV block", metavar="TOKENS")
    enable_prefix_caching: bool = option(
        True, "reuse the KV blocks of identical prompt prefixes", flag="prefix-caching"
    )
    use_kv_cache: bool = option(
        True,
        "keep K/V between steps (--no-kv-cache recomputes everything each step, to show the cost)",
        flag="kv-cache",
    )

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidParameterError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported: use {', '.join(KV_CACHE_DTYPES)}",
                param="kv_cache_dtype",
            )
        if self.kv_cache_memory is not None and self.max_num_kv_tokens is not None:
            raise InvalidParameterError(
                f"kv_cache_memory={self.kv_cache_memory!r} and max_num_kv_tokens={self.max_num_kv_tokens!r} both "
                f"size the KV pool: give one of them",
                param="kv_cache_memory",
            )
        if self.kv_cache_memory is not None:
            object.__setattr__(self, "kv_cache_memory", parse_size(self.kv_cache_memory))
            if self.kv_cache_memory <= 0:
                raise InvalidParameterError("kv_cache_memory must be positive, e.g. 2GiB", param="kv_cache_memory")
        _check_counts(self, ("block_size",))
        _check_counts(self, ("max_num_kv_tokens",), optional=True)


@dataclass(frozen=True)
class SchedulerConfig:
    """What one step may hold (requests, tokens, passes) and how many requests may wait for it."""

    max_num_seqs: int = option(64, "most requests running at once", metavar="N")
    max_num_batched_tokens: int = option(
        2048, "most tokens computed in one step (prompt chunks + decode tokens)", metavar="TOKENS"
    )
    # Cap on engine requests waiting for a batch slot or KV blocks; past it AsyncEngine refuses new requests
    # (EngineOverloadedError, HTTP 429). None = the KV pool's block count: a waiting request needs a block at least,
    # so a longer queue could never be admitted at once. LLM.generate queues its prompts without this cap.
    max_waiting_requests: int | None = option(
        None,
        "most requests waiting for a batch slot; the server answers 429 past it (default: the KV pool's block count)",
        metavar="N",
    )
    # Multi-step scheduling: forward passes per step when every scheduled request is a plain greedy decode, each
    # pass after the first decoding the token the one before sampled. Scheduling, bookkeeping and output
    # processing then run once for all of them; tokens arrive in bursts of this many, and a request that stops
    # mid-step (EOS) has the rest computed and dropped. 1 = one pass per step.
    num_scheduler_steps: int = option(
        1,
        "forward passes per step while every request is a plain greedy decode (multi-step scheduling: less "
        "per-token overhead, tokens streamed in bursts)",
        metavar="N",
    )

    def __post_init__(self) -> None:
        _check_counts(self, ("max_num_seqs", "max_num_batched_tokens", "num_scheduler_steps"))
        _check_counts(self, ("max_waiting_requests",), optional=True)

    def resolved_max_waiting_requests(self, num_kv_blocks: int) -> int:
        """max_waiting_requests, or the pool's block count when unset (see the field)."""
        return self.max_waiting_requests if self.max_waiting_requests is not None else num_kv_blocks


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: who proposes drafts, and how many the model verifies per step."""

    # The proposer; None = off. "ngram": drafts copied from earlier text of the same request (prompt lookup, no
    # second model); "self:N": the model's own first N layers plus its output head; anything else: the path of a
    # draft model that shares the model's tokenizer.
    speculative_draft: str | None = option(
        None,
        "speculative decoding: ngram (drafts from the request's own earlier text), self:N (the model's first "
        "N layers), or a draft model path with the same tokenizer (default: off)",
        metavar="DRAFT",
    )
    num_speculative_tokens: int = option(
        4, "draft tokens proposed per step and verified in one forward pass", metavar="N"
    )
    # The n-gram proposer looks up the longest suffix of the request's tokens, from ngram_max tokens down to
    # ngram_min, among its earlier tokens and proposes what followed it there.
    ngram_max: int = option(4, "n-gram drafts: longest suffix looked up in the request's earlier tokens", metavar="N")
    ngram_min: int = option(2, "n-gram drafts: shortest suffix looked up", metavar="N")

    def __post_init__(self) -> None:
        _check_counts(self, ("num_speculative_tokens", "ngram_max", "ngram_min"))
        if self.ngram_min > self.ngram_max:
            raise InvalidParameterError(
                f"ngram_min={self.ngram_min} must be <= ngram_max={self.ngram_max}", param="ngram_min"
            )
        draft = self.speculative_draft
        if draft is None:
            return
        if not isinstance(draft, str) or not draft:
            raise InvalidParameterError(
                f"speculative_draft={draft!r} must be 'ngram', 'self:N' or a model path", param="speculative_draft"
            )
        if draft.startswith("self:") and not re.fullmatch(r"self:[1-9][0-9]*", draft):
            raise InvalidParameterError(
                f"speculative_draft={draft!r}: write self:N with N the number of the model's first layers "
                f"the draft runs, e.g. self:4",
                param="speculative_draft",
            )


@dataclass(frozen=True)
class ParallelConfig:
    """How the work is spread: CPU threads in a process, tensor-parallel ranks across processes and machines."""

    num_threads: int | None = option(None, "CPU threads (default: the cores available)", flag="threads", metavar="N")
    # Tensor parallelism: ranks (processes) the model's attention heads and MLP features are split across, one
    # all-reduce per attention block and per MLP block (distributed/); rank 0 schedules. 1 = one process.
    tensor_parallel_size: int = option(
        1,
        "split the model across this many processes (tensor parallelism: attention heads and MLP features; gloo "
        "on CPU, NCCL on CUDA); see docs/scaling.md",
        metavar="N",
    )
    # host:port where the ranks meet (rank 0's machine); None = a free local port (one machine), or env:// under
    # torchrun.
    distributed_init_addr: str | None = option(
        None,
        "host:port where tensor-parallel ranks meet; unset: a free local port, or env:// under torchrun",
        metavar="HOST:PORT",
    )
    nnodes: int = option(1, "machines the tensor-parallel ranks span", metavar="N")
    node_rank: int = option(
        0, "this machine's index among --nnodes (0 runs the engine; others run only their ranks)", metavar="N"
    )

    def __post_init__(self) -> None:
        _check_counts(self, ("num_threads",), optional=True)
        _check_counts(self, ("tensor_parallel_size", "nnodes"))
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise InvalidParameterError(
                f"node_rank={self.node_rank!r} must be in 0..nnodes-1 ({self.nnodes - 1})", param="node_rank"
            )
        if self.tensor_parallel_size % self.nnodes:
            raise InvalidParameterError(
                f"tensor_parallel_size={self.tensor_parallel_size} must be a multiple of nnodes={self.nnodes} "
                f"(the same number of ranks on every machine)",
                param="tensor_parallel_size",
            )
        if self.nnodes > 1 and self.distributed_init_addr is None:
            raise InvalidParameterError(
                "nnodes > 1 needs distributed_init_addr, the head machine's host:port", param="distributed_init_addr"
            )


@dataclass(frozen=True)
class EngineConfig:
    """How the engine loads its model and shares the machine between requests: the model and its device here, the
    rest in parts (module docstring). Build it from flat names with from_flat."""

    model: str | None = option(
        None,
        "GGUF file or Hugging Face model folder (default: the embedded SmolLM2-135M-Instruct Q4_1)",
        metavar="PATH",
    )
    device: str = option("cpu", "torch device, e.g. cpu or cuda", metavar="DEVICE")
    max_model_len: int | None = option(
        None, "longest sequence, prompt + output (default: the model's context length)", metavar="TOKENS"
    )
    # Embeddings: the pooling every request gets unless it names its own (PoolingParams.pooling), in place of the
    # model file's; None = the file's, else "last" for causal models and "cls" for encoders (docs/embeddings.md).
    pooling: str | None = option(
        None,
        "embeddings: which tokens make the vector, last, mean or cls (default: what the model file says, else last "
        "for causal models and cls for encoders)",
        choices=("last", "mean", "cls"),
    )
    seed: int = option(0, "seed for requests that have none", flag="engine-seed", metavar="N")
    # On a GPU, replay decode steps from recorded CUDA graphs (runner/cuda_graphs.py); off = every step launches
    # its kernels one by one from Python (vLLM's --enforce-eager). No effect on the CPU.
    cuda_graphs: bool = option(
        True,
        "on a GPU, replay decode steps from CUDA graphs (--no-cuda-graphs launches every kernel from Python)",
        flag="cuda-graphs",
    )
    numerics: NumericsConfig = dataclasses.field(default_factory=NumericsConfig)
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = dataclasses.field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.pooling not in (None, "last", "mean", "cls"):
            raise InvalidParameterError(
                f"pooling={self.pooling!r} is not supported: use last, mean or cls", param="pooling"
            )
        _check_counts(self, ("max_model_len",), optional=True)
        self._check_across_parts()

    @classmethod
    def parts(cls) -> dict[str, type]:
        """The parts by field name (numerics, cache, ...), in the order the flags list them."""
        return {
            f.name: f.default_factory for f in dataclasses.fields(cls) if f.default_factory is not dataclasses.MISSING
        }

    @classmethod
    def flat_fields(cls) -> dict[str, dataclasses.Field]:
        """Every setting by its name, EngineConfig's own and the parts': the names from_flat, LLM(...) and the
        flags take."""
        parts = cls.parts()
        return {f.name: f for c in (cls, *parts.values()) for f in dataclasses.fields(c) if f.name not in parts}

    @classmethod
    def from_flat(cls, **options: Any) -> EngineConfig:
        """The config from settings named flat (`max_num_seqs=8`, as LLM(...), the command line and Ray Serve's
        args give them): the one place each name goes to the part that declares it. Unknown names are refused."""
        known = cls.flat_fields()
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise InvalidParameterError(
                f"unknown engine option(s) {unknown}; known options: {sorted(known)}", param=unknown[0]
            )

        def given(config_class: type) -> dict[str, Any]:
            names = {f.name for f in dataclasses.fields(config_class)}
            return {name: value for name, value in options.items() if name in names}

        parts = {name: part(**given(part)) for name, part in cls.parts().items()}
        return cls(**given(cls), **parts)

    def multi_step_conflict(self) -> str | None:
        """Why several forward passes per step (num_scheduler_steps > 1) cannot run with these settings, or None.
        The rule's one statement: __post_init__ refuses the combination with it, and LLM asks it before making
        multi-step scheduling its offline default."""
        if self.speculative.speculative_draft is not None:
            return (
                "num_scheduler_steps > 1 does not combine with speculative decoding (a step verifies drafts in one "
                "pass): set one of them"
            )
        if not self.cache.use_kv_cache:
            return (
                "num_scheduler_steps > 1 needs use_kv_cache: without the cache every step recomputes the whole sequence"
            )
        return None

    def _check_across_parts(self) -> None:
        """The rules that span parts (each part checked its own fields when it was built)."""
        if self.numerics.int8_activations and self.device != "cpu":
            raise InvalidParameterError(
                f"int8_activations is the CPU kernels' arithmetic; on device={self.device!r} "
                "quantized weights multiply activations in the compute dtype: drop it",
                param="int8_activations",
            )
        draft = self.speculative.speculative_draft
        if draft is not None and not self.cache.use_kv_cache:
            raise InvalidParameterError(
                "speculative decoding verifies drafts against the KV cache: drop speculative_draft, or keep "
                "use_kv_cache on",
                param="speculative_draft",
            )
        if draft is not None and self.parallel.tensor_parallel_size > 1:
            raise InvalidParameterError(
                "speculative decoding does not run under tensor parallelism yet: drop "
                "speculative_draft or use tensor_parallel_size=1",
                param="speculative_draft",
            )
        conflict = self.multi_step_conflict()
        if self.scheduler.num_scheduler_steps > 1 and conflict is not None:
            raise InvalidParameterError(conflict, param="num_scheduler_steps")
        if self.scheduler.max_num_batched_tokens < self.cache.block_size:
            raise InvalidParameterError(
                f"max_num_batched_tokens={self.scheduler.max_num_batched_tokens} must be at least "
                f"block_size={self.cache.block_size}",
                param="max_num_batched_tokens",
            )

    @property
    def resolved_dtype(self) -> str:
        """The compute dtype ("auto" resolved by device)."""
        if self.numerics.dtype != "auto":
            return self.numerics.dtype
        return "float32" if self.device == "cpu" else "bfloat16"

    @property
    def resolved_int8_activations(self) -> bool | None:
        """int8_activations with reference_numerics, the weight format and the device applied: False, True, or
        None (on where weights are quantized, decided at load)."""
        numerics = self.numerics
        if numerics.reference_numerics or numerics.quantization == "none" or self.device != "cpu":
            return False
        return numerics.int8_activations

    @property
    def resolved_kv_cache_dtype(self) -> str:
        """The dtype name the KV pool is allocated in ("auto" resolved: CacheConfig.kv_cache_dtype)."""
        if self.cache.kv_cache_dtype != "auto":
            return self.cache.kv_cache_dtype
        return "int8" if self.device == "cpu" and self.resolved_int8_activations is not False else self.resolved_dtype
