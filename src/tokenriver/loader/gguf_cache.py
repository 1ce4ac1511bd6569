"""A small on-disk index of a GGUF file's header, so that loading the file again skips reading it.

The first load of a file reads its header (loader/gguf_header.py, called by loader/gguf.py) and stores here what
tokenriver takes from it: every metadata field as a plain value (the tokenizer's vocabulary and merges included)
and the tensor table (name, type, shape, byte offset). Later loads read that JSON, whose parser decodes a large
vocabulary's strings in C rather than one by one in Python, and slice each tensor out of a read-only memory map
of the file at its stored offset.

An entry is used only when it describes the bytes on disk now: same real path, size, modification time and
format version, and the same SHA-256 of the header (metadata, tensor table and padding, everything before
the first tensor's data). Anything else (no entry, a stale or malformed one, an unreadable or unwritable
cache directory) is logged at INFO and the caller reads the header from the file: a cache problem costs
time, never gives a wrong model. JSON only, never pickle.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

logger = logging.getLogger(__name__)

# Bump when what an entry holds, or how it is read, changes: older entries are then ignored and rewritten.
FORMAT_VERSION = 2

# Tensor types read as typed arrays (as GGUFReader gives them); every other type is raw bytes (`tensor_array`).
_ITEM_TYPES = {
    gguf.GGMLQuantizationType.F16: np.float16,
    gguf.GGMLQuantizationType.F32: np.float32,
    gguf.GGMLQuantizationType.F64: np.float64,
    gguf.GGMLQuantizationType.I8: np.int8,
    gguf.GGMLQuantizationType.I16: np.int16,
    gguf.GGMLQuantizationType.I32: np.int32,
    gguf.GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's data lies in the file."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    # GGUF order: innermost dimension first (a [out_features, in_features] matrix is stored as (in, out)).
    shape: tuple[int, ...]
    # Absolute byte offset of the tensor's data in the file.
    data_offset: int
    n_bytes: int


@dataclass(frozen=True)
class GGUFIndex:
    """What tokenriver takes from a GGUF header."""

    # Every metadata key → field.contents() (str, int, float, bool, or a list of them).
    fields: dict[str, Any]
    tensors: list[TensorEntry]
    # Bytes before the first tensor's data: the header the SHA-256 covers.
    header_length: int


class _UnusableEntry(ValueError):
    """An entry that does not describe the file on disk (stale, malformed, or of another format)."""


def default_cache_dir() -> str:
    """$XDG_CACHE_HOME/tokenriver, else ~/.cache/tokenriver (the XDG base directory convention)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tokenriver")


def entry_path(path: str, cache_dir: str | None = None) -> str:
    """The cache file of the GGUF at `path`: one per real path, so a changed file overwrites its old entry."""
    key = hashlib.sha256(os.path.realpath(path).encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return os.path.join(cache_dir or default_cache_dir(), "gguf", f"{key}.json")


def load_index(path: str, cache_dir: str | None = None) -> GGUFIndex | None:
    """The stored index of `path` if it matches the file as it is now; None (logged) otherwise."""
    cache_file = entry_path(path, cache_dir)
    try:
        with open(cache_file, encoding="utf-8") as handle:
            entry = json.load(handle)
        return _check_entry(path, entry)
    except FileNotFoundError:
        logger.info("no GGUF index cached for %s at %s; parsing the file", path, cache_file)
    except _UnusableEntry as error:
        logger.info("GGUF index %s not used for %s (%s); parsing the file", cache_file, path, error)
    except (OSError, ValueError, TypeError, KeyError) as error:  # unreadable file or malformed JSON
        logger.info(
            "GGUF index %s of %s is unreadable (%s: %s); parsing the file",
            cache_file,
            path,
            type(error).__name__,
            error,
        )
    return None


def store_index(path: str, index: GGUFIndex, header: bytes, stat: os.stat_result, cache_dir: str | None = None) -> None:
    """Write the index of `path` (whose first `index.header_length` bytes are `header`, parsed when the file had
    `stat`); a failure is logged and otherwise ignored: the next load parses the file again."""
    cache_file = entry_path(path, cache_dir)
    entry = {
        "format": FORMAT_VERSION,
        "path": os.path.realpath(path),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "header_length": index.header_length,
        "header_sha256": hashlib.sha256(header).hexdigest(),
        "fields": index.fields,
        "tensors": [[t.name, int(t.tensor_type), list(t.shape), t.data_offset, t.n_bytes] for t in index.tensors],
    }
    try:
        write_atomically(cache_file, json.dumps(entry, separators=(",", ":")).encode("utf-8"))
    except (OSError, ValueError, TypeError) as error:  # unwritable directory, or a field JSON cannot hold
        logger.info(
            "could not cache the GGUF index of %s at %s (%s: %s); the next load parses it again",
            path,
            cache_file,
            type(error).__name__,
            error,
        )


def write_atomically(path: str, data: bytes) -> None:
    """Write `data` beside `path` and rename it there (creating the folder): a reader never sees half an entry,
    even with two writers. OSError if the folder is not writable."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def tensor_array(mapped: np.ndarray, tensor: TensorEntry) -> np.ndarray:
    """The tensor's data as GGUFReader gives it, a view of `mapped` (the whole file as uint8): typed
    [outermost, ..., innermost] for float/int types, raw bytes [..., row bytes] for block-quantized ones."""
    dims = tuple(reversed(tensor.shape))
    raw = mapped[tensor.data_offset : tensor.data_offset + tensor.n_bytes]  # [n_bytes] uint8
    item_type = _ITEM_TYPES.get(tensor.tensor_type)
    if item_type is None:
        return raw.reshape(gguf.quant_shape_to_byte_shape(dims, tensor.tensor_type))
    return raw.view(item_type).reshape(dims)


def _check_entry(path: str, entry: Any) -> GGUFIndex:
    """Turn a parsed JSON entry into a GGUFIndex, or raise _UnusableEntry saying why it does not fit `path`."""
    if not isinstance(entry, dict):
        raise _UnusableEntry(f"the entry is a JSON {type(entry).__name__}, not an object")
    if entry.get("format") != FORMAT_VERSION:
        raise _UnusableEntry(f"format {entry.get('format')!r}, this tokenriver reads format {FORMAT_VERSION}")
    stat = os.stat(path)
    recorded = (entry["path"], entry["size"], entry["mtime_ns"])
    actual = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
    if recorded != actual:
        raise _UnusableEntry(f"stale: recorded (path, size, mtime_ns) {recorded}, the file now has {actual}")
    header_length = entry["header_length"]
    if not isinstance(header_length, int) or not 0 < header_length <= stat.st_size:
        raise _UnusableEntry(f"header_length {header_length!r} does not fit a {stat.st_size}-byte file")
    with open(path, "rb") as file:
        header = file.read(header_length)
    if hashlib.sha256(header).hexdigest() != entry["header_sha256"]:
        raise _UnusableEntry("stale: the file's header bytes changed")
    fields = entry["fields"]
    if not isinstance(fields, dict):
        raise _UnusableEntry("fields is not an object")
    tensors = [_tensor_entry(row, header_length, stat.st_size) for row in entry["tensors"]]
    return GGUFIndex(fields=fields, tensors=tensors, header_length=header_length)


def _tensor_entry(row: Any, header_length: int, file_size: int) -> TensorEntry:
    """One [name, type, shape, offset, n_bytes] row, checked to lie inside the file's data section."""
    name, type_id, shape, data_offset, n_bytes = row
    tensor_type = gguf.GGMLQuantizationType(type_id)
    if not isinstance(name, str) or not all(isinstance(d, int) and d > 0 for d in shape):
        raise _UnusableEntry(f"tensor row {row!r} is malformed")
    block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
    expected_bytes = int(np.prod(shape)) * type_size // block_size
    if n_bytes != expected_bytes or not header_length <= data_offset <= file_size - n_bytes:
        raise _UnusableEntry(
            f"tensor {name}: {n_bytes} bytes at offset {data_offset} do not fit its shape "
            f"{shape} ({expected_bytes} bytes) or the file ({file_size} bytes)"
        )
    return TensorEntry(name, tensor_type, tuple(shape), data_offset, n_bytes)
