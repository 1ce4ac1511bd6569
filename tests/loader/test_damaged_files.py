"""A corpus of damaged model files: each one is refused with a one-line error that names what is wrong, or loads and
generates; none crashes, hangs or lets an exception from deep inside escape.

Each copy has one header field edited (a dimension, a dimension count, a tensor's type or data offset, a count or
length, a value's type tag, a config value that contradicts another) or is cut short. Most start from a small file
of K-quant and legacy types written here (two layers, an untied output projection); a handful from the embedded
SmolLM2 file, copied in the kernel (copy_file_range) and edited in place. Every load and its generation run in a
forked child (tests/loader/forked_loads.py), so a segfault or a hang is reported with the case's name.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_layout import ARRAY, BOOL, FIELD_COUNT_AT, FLOAT32, STRING, TENSOR_COUNT_AT, UINT64, Layout, read_layout
from loader_gguf_writing import TINY, tiny_llama_tensors, write_gguf

Q = gguf.GGMLQuantizationType
HERE = Path(__file__).parent
# A load and a few tokens take well under a second on these files; a child still running after this is hung.
CHILD_TIMEOUT_S = 60
MAX_TOKENS = 3
# The small file: a Q6_K embedding, a layer mixing types as Q4_K_M does, a layer of other types, a Q8_0 output.
SMALL_TYPES = [Q.Q6_K, Q.Q4_K, Q.Q4_K, Q.Q6_K, Q.Q4_K, Q.Q4_K, Q.Q5_0, Q.Q6_K]
SMALL_TYPES += [Q.Q5_K, Q.Q8_0, Q.Q8_0, Q.Q4_0, Q.Q5_K, Q.Q5_K, Q.Q4_1]
SMALL_TOKENS = [chr(ord("a") + i) for i in range(26)] + ["Ġ", "<s>", "</s>", ".", ",", "ab"]
PROMPTS = {"small": "abc", "embedded": "The capital of France is"}
# The embedded file's header (its 49,152-token vocabulary included) lies well inside this many first bytes.
EMBEDDED_HEADER_BYTES = 16 << 20

# An edit: the bytes to write at each offset, and the length to cut the file to (None: keep it whole).
Patch = tuple[int, bytes]


@dataclass(frozen=True)
class Edit:
    patches: tuple[Patch, ...] = ()
    truncate_to: int | None = None


@dataclass(frozen=True)
class Damage:
    """One damaged copy: which file it starts from, the edit, and what must happen."""

    name: str
    base: str  # "small" or "embedded"
    edit: Callable[[Layout, int], Edit]  # (the base's layout, its size) → the edit
    # Words the one-line error must contain; SAME: it loads and generates the undamaged file's tokens; EITHER: a
    # one-line error or a generation are both right (the edit leaves a file whose parts all fit together).
    expect: tuple[str, ...] | str


SAME = "same tokens"
EITHER = "refused or generated"


def _u32(at: int, value: int) -> Edit:
    return Edit(((at, struct.pack("<I", value)),))


def _u64(at: int, value: int) -> Edit:
    return Edit(((at, struct.pack("<Q", value)),))


def dim(tensor: str, index: int, value: int) -> Callable[[Layout, int], Edit]:
    """Set dimension `index` (GGUF order: 0 is the innermost, a matrix's in_features) of a tensor."""
    return lambda layout, size: _u64(layout.tensors[tensor].dims_at + 8 * index, value)


def shape(tensor: str, dims: tuple[int, ...]) -> Callable[[Layout, int], Edit]:
    """Set all of a tensor's dimensions (as many as it has, GGUF order)."""
    return lambda layout, size: Edit(
        tuple((layout.tensors[tensor].dims_at + 8 * index, struct.pack("<Q", d)) for index, d in enumerate(dims))
    )


def num_dims(tensor: str, value: int) -> Callable[[Layout, int], Edit]:
    return lambda layout, size: _u32(layout.tensors[tensor].num_dims_at, value)


def tensor_type(tensor: str, value: int) -> Callable[[Layout, int], Edit]:
    return lambda layout, size: _u32(layout.tensors[tensor].type_at, value)


def data_offset(tensor: str, value: Callable[[Layout, int], int]) -> Callable[[Layout, int], Edit]:
    """Set a tensor's data offset (relative to the data section) to value(layout, file size)."""
    return lambda layout, size: _u64(layout.tensors[tensor].offset_at, value(layout, size))


def array_count(field: str, value: Callable[[int], int]) -> Callable[[Layout, int], Edit]:
    """Set an array field's item count to value(its count now)."""

    def edit(layout: Layout, size: int) -> Edit:
        return _u64(layout.fields[field].value_at + 4, value(layout.fields[field].count))

    return edit


def string_length(field: str, value: int) -> Callable[[Layout, int], Edit]:
    return lambda layout, size: _u64(layout.fields[field].value_at, value)


def value_type(field: str, kind: int) -> Callable[[Layout, int], Edit]:
    return lambda layout, size: _u32(layout.fields[field].type_at, kind)


def array_item_type(field: str, kind: int) -> Callable[[Layout, int], Edit]:
    return lambda layout, size: _u32(layout.fields[field].value_at, kind)


def uint32_value(field: str, value: int) -> Callable[[Layout, int], Edit]:
    return lambda layout, size: _u32(layout.fields[field].value_at, value)


def float32_value(field: str, value: float) -> Callable[[Layout, int], Edit]:
    return lambda layout, size: Edit(((layout.fields[field].value_at, struct.pack("<f", value)),))


def header_count(at: int, value: Callable[[int], int]) -> Callable[[Layout, int], Edit]:
    """Set the tensor count (TENSOR_COUNT_AT) or the metadata count (FIELD_COUNT_AT) to value(its count now)."""

    def edit(layout: Layout, size: int) -> Edit:
        count = len(layout.tensors) if at == TENSOR_COUNT_AT else len(layout.fields)
        return _u64(at, value(count))

    return edit


def truncate(where: Callable[[Layout, int], int]) -> Callable[[Layout, int], Edit]:
    return lambda layout, size: Edit(truncate_to=where(layout, size))


CORPUS = [
    # --- dimensions: a changed byte count no longer ends where the next tensor starts ----------------------------
    Damage("embedding_width_0", "small", dim("token_embd.weight", 0, 0), ("token_embd.weight", "[0, 32]")),
    Damage("embedding_rows_0", "small", dim("token_embd.weight", 1, 0), ("token_embd.weight", "[256, 0]")),
    Damage("huge_dimension", "small", dim("blk.0.ffn_down.weight", 1, 2**40), ("blk.0.ffn_down.weight", "could hold")),
    Damage("dimension_2_63", "small", dim("blk.1.ffn_up.weight", 1, 2**63), ("blk.1.ffn_up.weight",)),
    Damage("q_rows_not_hidden", "small", dim("blk.0.attn_q.weight", 1, 128), ("blk.0.attn_q.weight", "[256, 128]")),
    Damage("q_rows_not_heads", "small", dim("blk.1.attn_q.weight", 1, 2), ("blk.1.attn_q.weight", "[256, 2]")),
    Damage("k_columns_wider", "small", dim("blk.0.attn_k.weight", 0, 512), ("blk.0.attn_k.weight", "[512, 128]")),
    Damage("v_columns_narrower", "small", dim("blk.1.attn_v.weight", 0, 32), ("blk.1.attn_v.weight", "[32, 128]")),
    Damage("norm_width", "small", dim("output_norm.weight", 0, 128), ("output_norm.weight", "[128]")),
    # --- dimensions of the last tensor, or of the same byte count: checked against the config ----------------------
    Damage("output_rows", "small", dim("output.weight", 1, 16), ("output.weight", "(16, 256) (expected (32, 256))")),
    Damage("output_rows_0", "small", dim("output.weight", 1, 0), ("output.weight", "(0, 256) (expected (32, 256))")),
    Damage("q_reshaped", "small", shape("blk.0.attn_q.weight", (512, 128)), ("blk.0.attn_q.weight", "(128, 512)")),
    Damage("k_transposed", "small", shape("blk.1.attn_k.weight", (128, 256)), ("blk.1.attn_k.weight", "(256, 128)")),
    Damage("output_transposed", "small", shape("output.weight", (32, 256)), ("output.weight", "(256, 32)")),
    Damage(
        "fewer_embedding_rows_than_tokens",
        "small",
        shape("token_embd.weight", (512, 16)),
        ("token_embd.weight (16, 512)",),
    ),
    # --- dimension counts ----------------------------------------------------------------------------------------
    Damage("embedding_three_dims", "small", num_dims("token_embd.weight", 3), ()),
    Damage("embedding_one_dim", "small", num_dims("token_embd.weight", 1), ()),
    Damage("norm_two_dims", "small", num_dims("blk.0.attn_norm.weight", 2), ()),
    Damage("norm_no_dims", "small", num_dims("blk.1.ffn_norm.weight", 0), ()),
    Damage("five_dims", "small", num_dims("blk.0.ffn_gate.weight", 5), ("blk.0.ffn_gate.weight", "dimensions")),
    # --- tensor data offsets ---------------------------------------------------------------------------------------
    Damage("offset_past_end", "small", data_offset("token_embd.weight", lambda layout, size: size), ("past the end",)),
    Damage("offset_2_63", "small", data_offset("blk.1.ffn_down.weight", lambda layout, size: 2**63), ("past the end",)),
    Damage(
        "misaligned_offset",
        "small",
        data_offset("blk.0.ffn_up.weight", lambda layout, size: layout.tensors["blk.0.ffn_up.weight"].offset + 1),
        ("blk.0.ffn_up.weight", "alignment"),
    ),
    Damage(
        "overlapping_offset",
        "small",
        data_offset("blk.0.ffn_up.weight", lambda layout, size: layout.tensors["blk.0.ffn_gate.weight"].offset),
        ("blk.0.ffn_up.weight", "blk.0.ffn_gate.weight"),
    ),
    # --- tensor types ----------------------------------------------------------------------------------------------
    Damage("unknown_type", "small", tensor_type("blk.0.attn_q.weight", 999), ("blk.0.attn_q.weight", "999")),
    Damage("bigger_type", "small", tensor_type("blk.0.attn_q.weight", Q.Q8_0), ("blk.0.attn_q.weight", "Q8_0")),
    Damage("smaller_type", "small", tensor_type("blk.0.ffn_down.weight", Q.Q2_K), ("blk.0.ffn_down.weight", "Q2_K")),
    Damage("unsupported_type", "small", tensor_type("blk.1.attn_k.weight", Q.TQ2_0), ("blk.1.attn_k.weight", "TQ2_0")),
    Damage("float_norm_as_q8_0", "small", tensor_type("blk.1.attn_norm.weight", Q.Q8_0), ("blk.1.attn_norm.weight",)),
    # Types of the same byte count, and the last tensor (nothing follows it): the layout holds.
    Damage("norm_as_int32", "small", tensor_type("blk.0.ffn_norm.weight", Q.I32), ("blk.0.ffn_norm.weight", "I32")),
    Damage("same_size_type", "small", tensor_type("blk.0.attn_output.weight", Q.Q4_0), EITHER),
    Damage("output_as_smaller_type", "small", tensor_type("output.weight", Q.Q4_0), EITHER),
    # --- counts and lengths ------------------------------------------------------------------------------------------
    Damage("huge_vocabulary_count", "small", array_count("tokenizer.ggml.tokens", lambda n: 2**40), ("tokens",)),
    Damage("huge_merges_count", "small", array_count("tokenizer.ggml.merges", lambda n: 2**62), ("merges",)),
    Damage("vocabulary_count_plus_one", "small", array_count("tokenizer.ggml.tokens", lambda n: n + 1), ()),
    Damage("token_types_count_2_64", "small", array_count("tokenizer.ggml.token_type", lambda n: 2**64 - 1), ()),
    Damage("huge_string_length", "small", string_length("general.name", 2**40), ("general.name",)),
    Damage("string_length_2_64", "small", string_length("tokenizer.ggml.model", 2**64 - 1), ()),
    Damage("huge_tensor_count", "small", header_count(TENSOR_COUNT_AT, lambda n: 2**40), ("tensor count",)),
    Damage("tensor_count_plus_one", "small", header_count(TENSOR_COUNT_AT, lambda n: n + 1), ()),
    Damage("huge_field_count", "small", header_count(FIELD_COUNT_AT, lambda n: 2**40), ("metadata count",)),
    Damage("field_count_minus_one", "small", header_count(FIELD_COUNT_AT, lambda n: n - 1), ()),
    # --- value type tags -----------------------------------------------------------------------------------------
    Damage("width_as_float", "small", value_type("llama.embedding_length", FLOAT32), ("llama.embedding_length",)),
    Damage("width_as_bool", "small", value_type("llama.embedding_length", BOOL), ()),
    Damage("layers_as_string", "small", value_type("llama.block_count", STRING), ()),
    Damage("context_as_uint64", "small", value_type("llama.context_length", UINT64), ()),
    Damage("heads_as_array", "small", value_type("llama.attention.head_count", ARRAY), ()),
    Damage("unknown_value_type", "small", value_type("llama.feed_forward_length", 77), ("77",)),
    Damage("vocabulary_of_floats", "small", array_item_type("tokenizer.ggml.tokens", FLOAT32), ()),
    # --- truncation ----------------------------------------------------------------------------------------------
    Damage("cut_in_header", "small", truncate(lambda layout, size: layout.table_end // 2), ("truncated",)),
    Damage("cut_in_tensor_table", "small", truncate(lambda layout, size: layout.table_end - 5), ("truncated",)),
    Damage("cut_in_weights", "small", truncate(lambda layout, size: size - 1000), ("output.weight", "past the end")),
    # --- config values that contradict each other or the tensors ---------------------------------------------------
    Damage("heads_not_dividing_width", "small", uint32_value("llama.attention.head_count", 3), ("head_count=3",)),
    Damage("heads_0", "small", uint32_value("llama.attention.head_count", 0), ("head_count=0",)),
    Damage("kv_heads_not_dividing", "small", uint32_value("llama.attention.head_count_kv", 3), ("num_kv_heads=3",)),
    Damage("layers_0", "small", uint32_value("llama.block_count", 0), ("block_count=0",)),
    Damage("layers_more_than_tensors", "small", uint32_value("llama.block_count", 3), ("block_count=3", "2 layers")),
    Damage("layers_2_31", "small", uint32_value("llama.block_count", 2**31), ("block_count=2147483648",)),
    Damage("layers_fewer_than_tensors", "small", uint32_value("llama.block_count", 1), ("block_count=1", "blk.1")),
    Damage("context_0", "small", uint32_value("llama.context_length", 0), ("context_length=0",)),
    Damage("context_2_32", "small", uint32_value("llama.context_length", 2**32 - 1), SAME),
    Damage("width_2_32", "small", uint32_value("llama.embedding_length", 2**32 - 1), ("embedding_length=4294967295",)),
    Damage("width_512", "small", uint32_value("llama.embedding_length", 512), ("rope.dimension_count=64", "128")),
    Damage("mlp_width_2_32", "small", uint32_value("llama.feed_forward_length", 2**32 - 1), ("blk.0.ffn_gate.weight",)),
    Damage("rope_dims_odd", "small", uint32_value("llama.rope.dimension_count", 7), ("rope.dimension_count=7",)),
    Damage("rope_base_nan", "small", float32_value("llama.rope.freq_base", float("nan")), ("rope.freq_base=nan",)),
    Damage("rope_base_negative", "small", float32_value("llama.rope.freq_base", -1.0), ("rope.freq_base=-1.0",)),
    Damage(
        "norm_epsilon_nan",
        "small",
        float32_value("llama.attention.layer_norm_rms_epsilon", float("nan")),
        ("layer_norm_rms_epsilon=nan",),
    ),
    Damage("eos_out_of_vocabulary", "small", uint32_value("tokenizer.ggml.eos_token_id", 2**31), ("eos_token_id",)),
    # --- the embedded file ---------------------------------------------------------------------------------------
    Damage("embedded_width_0", "embedded", dim("token_embd.weight", 0, 0), ("token_embd.weight", "[0, 49152]")),
    Damage(
        "embedded_half_the_rows",
        "embedded",
        shape("token_embd.weight", (1152, 24576)),
        ("vocab_size=49152", "24576 rows"),
    ),
    Damage(
        "embedded_transposed_down",
        "embedded",
        shape("blk.3.ffn_down.weight", (576, 1536)),
        ("blk.3.ffn_down.weight", "(1536, 576) (expected (576, 1536))"),
    ),
    Damage("embedded_heads_8", "embedded", uint32_value("llama.attention.head_count", 8), ("head size 72",)),
    Damage("embedded_vocab_size_key", "embedded", uint32_value("llama.vocab_size", 49_000), ("vocab_size", "49152")),
    Damage(
        "embedded_offset_past_end",
        "embedded",
        data_offset("blk.29.ffn_down.weight", lambda layout, size: size),
        ("blk.29.ffn_down.weight", "past the end"),
    ),
    Damage("embedded_cut_in_weights", "embedded", truncate(lambda layout, size: size * 3 // 5), ("past the end",)),
]
CLI_CASES = ["heads_0", "unknown_type", "cut_in_weights", "embedded_width_0"]


def _write_small(path: Path) -> None:
    rng = np.random.default_rng(11)
    tensors = tiny_llama_tensors(SMALL_TYPES, rng)
    output = (rng.standard_normal((TINY["vocab_size"], TINY["hidden_size"])) * 0.1).astype(np.float32)
    tensors["output.weight"] = (output, Q.Q8_0)
    token_types = [1] * 27 + [3, 3] + [1] * 3  # <s> and </s> are control tokens
    fields = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": SMALL_TOKENS,
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.token_type": token_types,
        "tokenizer.ggml.bos_token_id": 27,
        "tokenizer.ggml.eos_token_id": 28,
    }
    write_gguf(str(path), tensors, num_layers=2, extra=fields, rng=rng)


def _damaged_copy(damage: Damage, bases: dict[str, Path], layouts: dict[str, Layout], folder: Path) -> Path:
    """The base file with the damage's edit: copied in the kernel (without reading it here), then patched."""
    source = bases[damage.base]
    size = source.stat().st_size
    edit = damage.edit(layouts[damage.base], size)
    path = folder / f"{damage.name}.gguf"
    with open(source, "rb") as reader, open(path, "wb") as writer:
        length = size if edit.truncate_to is None else edit.truncate_to
        copied = 0
        while copied < length:
            copied += os.copy_file_range(reader.fileno(), writer.fileno(), length - copied)
    with open(path, "r+b") as file:
        for offset, data in edit.patches:
            file.seek(offset)
            file.write(data)
    return path


def _run(jobs: list[dict]) -> list[dict]:
    """forked_loads.py over `jobs`: one outcome per job."""
    request = json.dumps({"timeout": CHILD_TIMEOUT_S, "jobs": jobs})
    result = subprocess.run(
        [sys.executable, str(HERE / "forked_loads.py")],
        input=request,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S * 4 + 120,
        env=dict(os.environ),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    outcomes = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(outcomes) == len(jobs), result.stderr[-4000:]
    return outcomes


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, default_model_path) -> dict[str, tuple[Path, dict]]:
    """Each damaged copy's path and outcome; the undamaged bases' outcomes under "small" and "embedded"."""
    folder = tmp_path_factory.mktemp("damaged")
    bases = {"small": folder / "small.gguf", "embedded": Path(default_model_path)}
    _write_small(bases["small"])
    layouts = {"small": read_layout(bases["small"].read_bytes())}
    with open(default_model_path, "rb") as file:
        layouts["embedded"] = read_layout(file.read(EMBEDDED_HEADER_BYTES))
    paths = dict(bases)
    paths |= {damage.name: _damaged_copy(damage, bases, layouts, folder) for damage in CORPUS}
    prompts = {name: PROMPTS[name] for name in bases} | {damage.name: PROMPTS[damage.base] for damage in CORPUS}
    jobs = [{"path": str(paths[name]), "prompt": prompts[name], "max_tokens": MAX_TOKENS} for name in paths]
    outcomes = _run(jobs)
    return {name: (paths[name], outcome) for name, outcome in zip(paths, outcomes)}


def test_the_undamaged_files_generate(corpus):
    for name in ("small", "embedded"):
        _, outcome = corpus[name]
        assert outcome["outcome"] == "generated", outcome
        assert len(outcome["token_ids"]) == MAX_TOKENS


@pytest.mark.parametrize("damage", CORPUS, ids=lambda damage: damage.name)
def test_a_damaged_file_is_refused_or_generates(corpus, damage):
    _, outcome = corpus[damage.name]
    kind = outcome["outcome"]
    assert kind in ("refused", "generated"), f"{damage.name}: {kind}: {outcome.get('signal') or outcome}"
    if kind == "refused":
        message = outcome["message"]
        assert "\n" not in message, message
        assert damage.expect != SAME, f"{damage.name} was refused: {message}"
        words = () if damage.expect == EITHER else damage.expect
        assert all(word in message for word in words), f"{damage.name}: {message!r} lacks {words}"
    else:
        assert damage.expect in (SAME, EITHER), f"{damage.name} loaded and generated {outcome['token_ids']}"
        if damage.expect == SAME:
            assert outcome["token_ids"] == corpus[damage.base][1]["token_ids"]


@pytest.mark.parametrize("name", CLI_CASES)
def test_the_cli_prints_one_error_line_and_exits_2(corpus, name):
    path, _ = corpus[name]
    result = subprocess.run(
        [sys.executable, "-m", "tokenriver.cli", "generate", "x", "--model", str(path), "--max-tokens", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )
    assert result.returncode == 2, result.stderr[-4000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(path) in lines[0], result.stderr[-4000:]


def test_an_edited_copy_differs_from_its_base_only_where_edited(tmp_path):
    """The corpus's own check: an edit writes the bytes it says at the offsets it says, and nothing else."""
    base = tmp_path / "small.gguf"
    _write_small(base)
    layout = read_layout(base.read_bytes())
    damage = Damage("check", "small", dim("blk.0.attn_q.weight", 1, 7), ())
    path = _damaged_copy(damage, {"small": base}, {"small": layout}, tmp_path)
    before, after = base.read_bytes(), path.read_bytes()
    changed = [i for i in range(len(before)) if before[i] != after[i]]
    at = layout.tensors["blk.0.attn_q.weight"].dims_at + 8
    assert len(after) == len(before) and changed and all(at <= i < at + 8 for i in changed)
    assert struct.unpack_from("<Q", after, at) == (7,)
