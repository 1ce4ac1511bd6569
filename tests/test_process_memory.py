"""process_memory: the readings the memory account is made of, on memory whose residency a test controls."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest

from tokenriver.process_memory import mapped_file_bytes, read_status, resident_bytes

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's /proc")
PAGE = mmap.PAGESIZE


def _address(mapping: mmap.mmap) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(mapping))


def test_status_reads_the_resident_memory_and_its_parts():
    status = read_status()
    assert status is not None
    assert status.resident > 0 and status.peak >= status.resident
    assert status.anonymous + status.file + status.shared == status.resident


def test_an_anonymous_mapping_is_resident_only_where_it_was_touched():
    mapping = mmap.mmap(-1, 64 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = _address(mapping)
    assert resident_bytes([(start, 64 * PAGE)]) == 0
    for page in (0, 5, 6, 63):
        mapping[page * PAGE] = 1
    assert resident_bytes([(start, 64 * PAGE)]) == 4 * PAGE
    # Ranges that share pages count each page once; a range inside a page counts its page.
    assert resident_bytes([(start, PAGE), (start + 10, 20), (start + 5 * PAGE, 2 * PAGE)]) == 3 * PAGE


def test_a_mapped_file_counts_the_pages_read_through_the_mapping(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)) * (64 * PAGE // 256))
    assert mapped_file_bytes([str(path)]) == 0
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapping:
        assert sum(mapping[page * PAGE] for page in range(0, 64, 8)) >= 0
        assert mapped_file_bytes([str(path)]) >= 8 * PAGE
    assert mapped_file_bytes([str(path)]) == 0
