"""This process's resident memory, read from Linux's /proc and mincore(2): what the memory account is made of.

Three readings, all of this process and all in bytes:
- `read_status()`: the totals /proc/self/status keeps (resident, of it anonymous and file-backed, and the peak);
- `resident_bytes(ranges)`: of some address ranges (the weights' storages, the KV pool's tensors), the pages
  resident now, by mincore(2): a page that was reserved but never touched is not resident;
- `mapped_file_bytes(paths)`: the resident pages of the mappings of some files (a model file the weights still
  point into), from /proc/self/smaps.
Stdlib only. Where there is no /proc (not Linux) each answers None.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
from collections.abc import Iterable
from dataclasses import dataclass

_PAGE = mmap.PAGESIZE
# mincore(2) sets the low bit of a page's byte when the page is resident; the other bits are reserved.
_LOW_BIT = bytes(byte & 1 for byte in range(256))


@dataclass(frozen=True)
class ProcessMemory:
    """/proc/self/status's memory lines, in bytes."""

    # VmRSS: resident now, anonymous + file-backed + shared memory.
    resident: int
    # RssAnon: the heap, anonymous mappings (the weight arena, the KV pool's touched pages).
    anonymous: int
    # RssFile: pages of mapped files (the libraries' code, a mapped model file).
    file: int
    # RssShmem: shared memory (tensor parallelism's shared tensors).
    shared: int
    # VmHWM: the most this process has had resident since it started.
    peak: int


def read_status() -> ProcessMemory | None:
    """The process's memory now; None where /proc/self/status is not there."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            lines = status.read().splitlines()
    except OSError:
        return None
    values = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
            values[key] = int(value.split()[0]) * 1024  # "1234 kB"
    if len(values) < 5:
        return None
    return ProcessMemory(values["VmRSS"], values["RssAnon"], values["RssFile"], values["RssShmem"], values["VmHWM"])


def resident_bytes(ranges: Iterable[tuple[int, int]]) -> int | None:
    """Bytes resident now of the pages under (address, length) ranges, each page counted once; None where
    mincore(2) is not available. Meant for anonymous memory (for a file mapping it tells the page cache instead)."""
    mincore = _mincore()
    if mincore is None:
        return None
    pages = _merge(
        (start // _PAGE * _PAGE, -(-(start + length) // _PAGE) * _PAGE) for start, length in ranges if length
    )
    resident = 0
    for start, end in pages:
        vector = (ctypes.c_ubyte * ((end - start) // _PAGE))()
        if mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vector) != 0:
            return None
        resident += bytes(vector).translate(_LOW_BIT).count(1) * _PAGE
    return resident


def mapped_file_bytes(paths: Iterable[str]) -> int | None:
    """Resident bytes of this process's mappings of the files at `paths`; None where /proc/self/smaps is not
    there."""
    wanted = {os.path.realpath(path) for path in paths}
    resident, counting = 0, False
    try:
        with open("/proc/self/smaps", encoding="utf-8", errors="surrogateescape") as smaps:
            for line in smaps:
                head, _, rest = line.partition(" ")
                if not head.endswith(":"):  # "start-end perms offset dev inode [path]" opens a mapping
                    fields = rest.split(maxsplit=4)
                    counting = len(fields) == 5 and fields[4].rstrip("\n") in wanted
                elif counting and head == "Rss:":
                    resident += int(rest.split()[0]) * 1024
    except OSError:
        return None
    return resident


def _merge(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """[start, end) ranges sorted and merged where they overlap or touch."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


@functools.cache
def _mincore():  # type: ignore[no-untyped-def]
    """libc's mincore (from the symbols the process has loaded), or None."""
    if not os.path.exists("/proc/self/status"):
        return None
    function = getattr(ctypes.CDLL(None, use_errno=True), "mincore", None)
    if function is not None:
        function.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
        function.restype = ctypes.c_int
    return function
