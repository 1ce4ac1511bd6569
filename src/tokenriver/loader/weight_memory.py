"""Where a loaded model's weights live: one anonymous mapping that the kernel backs with 2 MiB pages.

Decoding streams every weight once per step, so its speed is the speed of reading memory. With ordinary 4 KiB
pages a 200 MB stream crosses 50,000 pages, each a TLB miss whose walk (two levels of tables inside a VM) stalls
the hardware prefetcher at every page boundary; on 2 MiB pages there are a hundred. Linux gives transparent huge
pages to a mapping that asks for them (`madvise(MADV_HUGEPAGE)`, the default policy being "madvise"), but PyTorch's
allocator does not ask. So after a load the weights move, storage by storage, into one mapping that does: the same
bytes, only their addresses change (benchmarks/HISTORY.md has the measurements).

Each storage is freed as soon as its copy is made, so a load's peak memory grows by one storage at most. Where the
platform has no huge pages, nothing moves. The loader runs the move on a second thread while it reads the tokenizer
(`moving_to_huge_pages`): faulting in fresh 2 MiB pages is most of its cost, and the other core is idle then.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import contextlib
import mmap
import threading
from collections.abc import Callable, Iterator

import torch
from torch import nn

from tokenriver.config import default_num_threads

# Alignment of each storage in the mapping: a cache line, and a multiple of every element size.
_ALIGNMENT = 64
# Freed copies handed back to the OS after every this many bytes, so that a load's peak stays close to its end.
_TRIM_EVERY_BYTES = 16 * 2**20


def huge_pages_available() -> bool:
    """Whether this platform can back a mapping with transparent huge pages on request."""
    return hasattr(mmap, "MADV_HUGEPAGE")


def move_weights_to_huge_pages(model: nn.Module) -> int:
    """Move every CPU parameter and buffer of `model` into one huge-page mapping; returns the bytes moved.

    Tensors that share a storage (a tied embedding and output projection, views of a fused matrix) keep sharing it.
    Call it before anything keeps raw pointers into the weights: the native kernels bound by the quantized layers
    are bound again here, and nothing else binds before the engine starts.
    """
    if not huge_pages_available():
        return 0
    # Storage address → the tensors viewing it: each storage is copied once, and all its views follow it.
    by_storage: dict[int, list[torch.Tensor]] = {}
    for tensor in _tensors(model):
        if tensor.device.type == "cpu" and tensor.untyped_storage().nbytes() > 0:
            by_storage.setdefault(tensor.untyped_storage().data_ptr(), []).append(tensor)
    if not by_storage:
        return 0
    offsets: dict[int, int] = {}
    total = 0
    for pointer, views in by_storage.items():
        offsets[pointer] = total
        total += -(-views[0].untyped_storage().nbytes() // _ALIGNMENT) * _ALIGNMENT
    try:
        mapping = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared memory has no THP
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel built without THP, or no address space: the weights stay where they are
        return 0
    arena = torch.frombuffer(mapping, dtype=torch.uint8)  # [total] uint8; keeps the mapping alive
    arena_storage = arena.untyped_storage()
    trim = _malloc_trim()
    trim()  # what the load freed before, first
    freed = 0
    with torch.no_grad():
        for pointer, views in by_storage.items():
            storage = views[0].untyped_storage()
            start = offsets[pointer]
            source = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
            arena[start:start + storage.nbytes()].copy_(source)
            freed += storage.nbytes()
            del source, storage
            for view in views:
                element_size = view.element_size()
                view.set_(arena_storage, start // element_size + view.storage_offset(), view.size(), view.stride())
            if freed >= _TRIM_EVERY_BYTES:
                trim()
                freed = 0
    trim()
    for module in model.modules():
        rebind = getattr(module, "_bind_native", None)
        if rebind is not None:
            rebind()
    return total


@contextlib.contextmanager
def moving_to_huge_pages(model: nn.Module) -> Iterator[None]:
    """Run move_weights_to_huge_pages(model) on another thread for the duration of the block, which must not touch
    the model's tensors; its error, if any, is raised at the end of the block."""
    errors: list[BaseException] = []
    caller_threads = torch.get_num_threads()

    def move() -> None:
        # The load runs on one PyTorch thread; copying (and faulting pages in) runs faster on all of them.
        torch.set_num_threads(default_num_threads())
        try:
            move_weights_to_huge_pages(model)
        except BaseException as error:  # handed to the caller's thread below
            errors.append(error)
        finally:
            torch.set_num_threads(caller_threads)

    mover = threading.Thread(target=move, name="tokenriver-weight-move", daemon=True)
    mover.start()
    try:
        yield
    finally:
        mover.join()
    if errors:
        raise errors[0]


def _tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    """Each parameter and buffer object once (a module reached twice, as a tied table is, yields its own once)."""
    seen: set[int] = set()
    for module in model.modules():
        for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                yield tensor


def _malloc_trim() -> Callable[[], None]:
    """glibc's malloc_trim(0), which hands freed heap memory back to the OS (glibc keeps it otherwise), or a no-op."""
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name is not None else None
    return (lambda: None) if trim is None else (lambda: trim(0))
