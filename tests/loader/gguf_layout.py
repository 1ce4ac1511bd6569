"""Where each field of a GGUF header lies in the file, so that a test can damage exactly one of them.

A walk over the header with struct, independent of the loader's parser (loader/gguf_header.py) that the damaged
copies test: for each metadata field the byte offsets of its type tag and value (a string's or an array's length
included), for each tensor those of its dimension count, dimensions, type and data offset.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

# GGUF value types (gguf.GGUFValueType): scalar sizes, and the two variable-length kinds.
SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9
UINT32, FLOAT32, BOOL, UINT64 = 4, 6, 7, 10
# Byte offsets of the header's counts.
TENSOR_COUNT_AT, FIELD_COUNT_AT = 8, 16


@dataclass(frozen=True)
class FieldAt:
    """One metadata field: the byte offset of its type tag and of its value (for a string, the u64 length; for an
    array, the item type, then the u64 count at value_at + 4), and an array's item count."""

    type_at: int
    value_at: int
    kind: int
    count: int | None = None


@dataclass(frozen=True)
class TensorAt:
    """One tensor's entry in the tensor table: byte offsets of its fields, and the dimensions (innermost first)
    and data offset (relative to the data section) it has."""

    num_dims_at: int
    dims_at: int
    type_at: int
    offset_at: int
    dims: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class Layout:
    fields: dict[str, FieldAt]
    tensors: dict[str, TensorAt]
    # Where the tensor table ends (the data section starts at the next multiple of the alignment).
    table_end: int


def read_layout(header: bytes) -> Layout:
    """The layout of a little-endian GGUF v3 file whose first bytes (the whole header at least) are `header`."""
    position = 24
    num_tensors, num_fields = struct.unpack_from("<QQ", header, TENSOR_COUNT_AT)

    def take(fmt: str) -> int:
        nonlocal position
        (value,) = struct.unpack_from(fmt, header, position)
        position += struct.calcsize(fmt)
        return value

    def skip_string() -> str:
        nonlocal position
        length = take("<Q")
        position += length
        return header[position - length : position].decode("utf-8")

    def skip_value(kind: int) -> None:
        nonlocal position
        if kind == STRING:
            skip_string()
        elif kind == ARRAY:
            item, count = take("<I"), take("<Q")
            for _ in range(count):
                skip_value(item)
        else:
            position += SCALAR_SIZES[kind]

    fields = {}
    for _ in range(num_fields):
        name = skip_string()
        type_at = position
        kind = take("<I")
        value_at = position
        skip_value(kind)
        count = struct.unpack_from("<Q", header, value_at + 4)[0] if kind == ARRAY else None
        fields[name] = FieldAt(type_at, value_at, kind, count)
    tensors = {}
    for _ in range(num_tensors):
        name = skip_string()
        num_dims_at = position
        num_dims = take("<I")
        dims = tuple(take("<Q") for _ in range(num_dims))
        type_at = position
        take("<I")
        offset_at = position
        tensors[name] = TensorAt(num_dims_at, num_dims_at + 4, type_at, offset_at, dims, take("<Q"))
    return Layout(fields, tensors, position)
