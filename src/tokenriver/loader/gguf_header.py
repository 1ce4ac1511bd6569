"""A GGUF file's header (metadata and tensor table) read in one pass over the mapped bytes.

gguf.GGUFReader makes a numpy view per element of every metadata array: ~300k for a 151,936-token vocabulary and
its merges, seconds before the first weight is read. Here each field becomes a plain Python value at once: a
numeric array one numpy read and `tolist()`, a string array one slice and decode per string. The values are
GGUFReader's `contents()` (tests/loader/test_gguf_header.py compares them on every test file), but for an array
of arrays, which stays nested where GGUFReader flattens it.

Every length and count is checked against the bytes left before it is used, so a damaged header is a
GGUFHeaderError saying where, never a huge allocation, a read past the end or a hang. Names are unique and not
empty, and every tensor's bytes lie inside the file. `check_layout` adds llama.cpp's rule for where the tensors'
data lies (one after another, in table order, each at the next multiple of the alignment): a tensor whose shape or
type was damaged then no longer ends where the next one starts, which its byte count alone cannot show.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from tokenriver.loader.gguf_cache import GGUFIndex, TensorEntry

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# The most values any GGML type packs into one byte (IQ1_S: 256 in 50 bytes), rounded up: no dimension of a tensor
# whose bytes lie in a file can exceed this many times the file's size.
_MAX_VALUES_PER_BYTE = 8
# Scalar value types and their little-endian numpy types.
_SCALARS = {
    GGUFValueType.UINT8: "<u1",
    GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4",
    GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4",
    GGUFValueType.BOOL: "<u1",
    GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT64: "<f8",
}


class GGUFHeaderError(ValueError):
    """The header cannot be read: what and at which byte."""


class _Cursor:
    """Reads values from the mapped bytes in the file's byte order, checking every read against the end."""

    def __init__(self, data: np.ndarray, byte_order: str) -> None:
        self.data = data
        self.buffer = memoryview(data)
        self.position = 0
        self.byte_order = byte_order  # "<" or ">"

    def _dtype(self, code: str) -> np.dtype:
        return np.dtype(self.byte_order + code[1:])

    def _take(self, count: int, what: str) -> int:
        start = self.position
        if count < 0 or start + count > len(self.data):
            raise GGUFHeaderError(f"{what} at byte {start} runs past the end of the file ({len(self.data)} bytes)")
        self.position = start + count
        return start

    def scalar(self, code: str, what: str) -> int | float:
        dtype = self._dtype(code)
        start = self._take(dtype.itemsize, what)
        return np.frombuffer(self.buffer, dtype, 1, start)[0].item()

    def array(self, code: str, count: int, what: str) -> np.ndarray:
        dtype = self._dtype(code)
        if count > (len(self.data) - self.position) // dtype.itemsize:
            raise GGUFHeaderError(f"{what} at byte {self.position} claims {count} items, more than the file holds")
        start = self._take(count * dtype.itemsize, what)
        return np.frombuffer(self.buffer, dtype, count, start)

    def string(self, what: str) -> str:
        length = self.scalar("<u8", what)
        start = self._take(length, what)
        return self._decode(start, length, what)

    def strings(self, count: int, what: str) -> list[str]:
        """count strings, each a u64 length and its bytes."""
        if count > (len(self.data) - self.position) // 8:
            raise GGUFHeaderError(f"{what} at byte {self.position} claims {count} strings, more than the file holds")
        little = self.byte_order == "<"
        buffer, end, position, values = self.buffer, len(self.data), self.position, []
        for _ in range(count):
            if position + 8 > end:
                raise GGUFHeaderError(f"{what} at byte {position} runs past the end of the file ({end} bytes)")
            length = int.from_bytes(buffer[position : position + 8], "little" if little else "big")
            position += 8
            if length > end - position:
                raise GGUFHeaderError(f"{what} at byte {position} runs past the end of the file ({end} bytes)")
            values.append(self._decode(position, length, what))
            position += length
        self.position = position
        return values

    def _decode(self, start: int, length: int, what: str) -> str:
        try:
            return str(self.buffer[start : start + length], "utf-8")
        except UnicodeDecodeError as error:
            raise GGUFHeaderError(f"{what} at byte {start} is not UTF-8 ({error.reason})") from None


def is_big_endian(data: np.ndarray) -> bool:
    """Whether the file was written big-endian (its version's bytes swapped, as GGUFReader tells)."""
    return len(data) >= 8 and int.from_bytes(bytes(data[4:8]), "little") & 0xFFFF == 0


def read_header(data: np.ndarray) -> GGUFIndex:
    """The metadata (every field as GGUFReader's contents() gives it) and tensor table of a GGUF file, data its
    bytes ([size] uint8, e.g. a read-only memory map)."""
    if bytes(data[:4]) != GGUF_MAGIC:
        raise GGUFHeaderError("the file does not start with the GGUF magic")
    cursor = _Cursor(data, "<")
    cursor.position = 4
    if is_big_endian(data):
        cursor.byte_order = ">"
    version = cursor.scalar("<u4", "the version")
    if version not in SUPPORTED_VERSIONS:
        raise GGUFHeaderError(f"GGUF version {version} is not supported (versions {SUPPORTED_VERSIONS} are)")
    num_tensors = cursor.scalar("<u8", "the tensor count")
    num_fields = cursor.scalar("<u8", "the metadata count")
    fields = {}
    for index in range(_bounded(num_fields, cursor, 13, "the metadata count")):  # a name, a type, a value
        name = cursor.string(f"the name of metadata field {index}")
        if not name:
            raise GGUFHeaderError(f"metadata field {index} has an empty name")
        if name in fields:
            raise GGUFHeaderError(f"metadata field {index} repeats the name {name!r}")
        fields[name] = _value(cursor, name)
    tensors = [_tensor_info(cursor, index) for index in range(_bounded(num_tensors, cursor, 24, "the tensor count"))]
    names = [name for name, *_ in tensors]
    if len(set(names)) != len(names):
        repeated = next(name for index, name in enumerate(names) if name in names[:index])
        raise GGUFHeaderError(f"the tensor table names {repeated} twice")
    alignment = alignment_of(fields)
    data_start = -(-cursor.position // alignment) * alignment
    entries = [_entry(name, kind, shape, data_start + offset, len(data)) for name, kind, shape, offset in tensors]
    return GGUFIndex(fields=fields, tensors=entries, header_length=data_start)


def alignment_of(fields: dict) -> int:
    """The alignment of the tensors' data (general.alignment, else 32), a power of two."""
    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFHeaderError(f"general.alignment={alignment!r} is not a power of two")
    return alignment


def check_layout(index: GGUFIndex) -> None:
    """llama.cpp's rule for where the data lies (its gguf_init refuses a file that breaks it): the first tensor at
    the start of the data section, each next one at the end of the one before it rounded up to the alignment.

    Why: read_header only knows that each tensor's bytes lie in the file. A damaged dimension or type changes how
    many bytes a tensor takes, and a damaged offset moves them; either way the tensor would be read from bytes
    that belong to its neighbours (or to none), and load as noise. Here such a tensor no longer meets the next.
    """
    alignment = alignment_of(index.fields)
    expected = index.header_length
    previous = None
    for tensor in index.tensors:
        start = tensor.data_offset - index.header_length  # where the table says, from the start of the data section
        if start % alignment:
            raise GGUFHeaderError(
                f"tensor {tensor.name}'s data offset {start} is not a multiple of the alignment {alignment}"
            )
        if tensor.data_offset != expected:
            if previous is None:
                raise GGUFHeaderError(
                    f"the first tensor, {tensor.name}, starts {start} bytes into the data section instead of at its "
                    f"start"
                )
            shape = ", ".join(map(str, previous.shape))
            raise GGUFHeaderError(
                f"tensor {tensor.name}'s data starts at byte {tensor.data_offset}, but tensor {previous.name} before "
                f"it ({previous.tensor_type.name} [{shape}], {previous.n_bytes} bytes) ends at byte "
                f"{previous.data_offset + previous.n_bytes}, so {tensor.name} should start at byte {expected}: "
                f"the shape or type of {previous.name}, or the offset of {tensor.name}, is damaged"
            )
        expected = -(-(tensor.data_offset + tensor.n_bytes) // alignment) * alignment
        previous = tensor


def _bounded(count: int, cursor: _Cursor, min_bytes: int, what: str) -> int:
    """count, if the bytes left could hold that many items of at least min_bytes."""
    if count > (len(cursor.data) - cursor.position) // min_bytes:
        raise GGUFHeaderError(f"{what} ({count}) is more than the file could hold")
    return count


def _value(cursor: _Cursor, name: str) -> object:
    kind = _value_type(cursor.scalar("<u4", f"the type of {name}"), name)
    if kind == GGUFValueType.STRING:
        return cursor.string(name)
    if kind == GGUFValueType.ARRAY:
        return _array(cursor, name)
    value = cursor.scalar(_SCALARS[kind], name)
    return bool(value) if kind == GGUFValueType.BOOL else value


def _array(cursor: _Cursor, name: str) -> list:
    item = _value_type(cursor.scalar("<u4", f"the item type of {name}"), name)
    count = cursor.scalar("<u8", f"the length of {name}")
    if item == GGUFValueType.STRING:
        return cursor.strings(count, name)
    if item == GGUFValueType.ARRAY:
        return [_array(cursor, name) for _ in range(_bounded(count, cursor, 12, name))]
    values = cursor.array(_SCALARS[item], count, name).tolist()
    return [bool(v) for v in values] if item == GGUFValueType.BOOL else values


def _value_type(code: int, name: str) -> GGUFValueType:
    try:
        return GGUFValueType(code)
    except ValueError:
        raise GGUFHeaderError(f"{name} has an unknown value type {code}") from None


def _tensor_info(cursor: _Cursor, index: int) -> tuple[str, GGMLQuantizationType, tuple[int, ...], int]:
    name = cursor.string(f"the name of tensor {index}")
    if not name:
        raise GGUFHeaderError(f"tensor {index} has an empty name")
    num_dims = cursor.scalar("<u4", f"the dimension count of {name}")
    if num_dims > 4:
        raise GGUFHeaderError(f"tensor {name} has {num_dims} dimensions (at most 4)")
    shape = tuple(int(d) for d in cursor.array("<u8", num_dims, f"the shape of {name}"))
    code = cursor.scalar("<u4", f"the type of {name}")
    try:
        kind = GGMLQuantizationType(code)
    except ValueError:
        raise GGUFHeaderError(f"tensor {name} has an unknown type {code}") from None
    return name, kind, shape, cursor.scalar("<u8", f"the data offset of {name}")


def _entry(name: str, kind: GGMLQuantizationType, shape: tuple[int, ...], offset: int, size: int) -> TensorEntry:
    """The tensor's place in the file, its byte count from its type and shape, checked against the file."""
    if kind not in GGML_QUANT_SIZES:
        raise GGUFHeaderError(f"tensor {name} has type {kind.name}, whose block size gguf does not know")
    block_size, type_size = GGML_QUANT_SIZES[kind]
    if block_size > 1 and not shape:
        raise GGUFHeaderError(f"tensor {name} of type {kind.name} has no dimensions (its blocks need rows)")
    if shape and shape[0] % block_size:
        raise GGUFHeaderError(f"tensor {name}: rows of {shape[0]} values are not whole {kind.name} blocks")
    if any(d > _MAX_VALUES_PER_BYTE * size for d in shape):  # bytes of 0 (another dimension is 0) still fit
        raise GGUFHeaderError(f"tensor {name} has shape {list(shape)}, a dimension more than the file could hold")
    n_bytes = int(np.prod(shape, dtype=object)) // block_size * type_size
    if offset + n_bytes > size:
        raise GGUFHeaderError(f"tensor {name}'s {n_bytes} bytes at byte {offset} run past the end ({size} bytes)")
    return TensorEntry(name, kind, shape, offset, n_bytes)
