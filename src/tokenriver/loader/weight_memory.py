"""Where a loaded model's weights live: one anonymous mapping that the kernel backs with 2 MiB pages.

Decoding streams every weight once per step, so its speed is the speed of reading memory. With ordinary 4 KiB
pages a 200 MB stream crosses 50,000 pages, each a TLB miss whose walk (two levels of tables inside a VM) stalls
the hardware prefetcher at every page boundary; on 2 MiB pages there are a hundred. Linux gives transparent huge
pages to a mapping that asks for them (`madvise(MADV_HUGEPAGE)`, the default policy being "madvise"), but PyTorch's
allocator does not ask. So the weights live in a `WeightArena`, one mapping that does (benchmarks/HISTORY.md has the
measurements):
- the loader makes the large packed weights in it directly (`WeightArena.empty`), while a second thread faults in
  the pages a little ahead of them: in a VM a page the guest never touched is slow to fault in, and the other core
  is otherwise idle during much of a load;
- whatever was made elsewhere moves in afterwards (`WeightArena.adopt`), storage by storage, each freed as soon as
  its copy is made, so a load's peak memory grows by one storage at most (`move_into_arena`).
Where the platform has no huge pages, nothing moves.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import math
import mmap
import threading
from collections.abc import Callable, Iterator

import torch
from torch import nn

from tokenriver.config import default_num_threads
from tokenriver.models.quant import QuantizedLinear

# Alignment of each tensor in the mapping: a cache line, and a multiple of every element size.
_ALIGNMENT = 64
_HUGE_PAGE = 2 * 2**20
# Freed copies handed back to the OS after every this many bytes, so that a load's peak stays close to its end.
_TRIM_EVERY_BYTES = 16 * 2**20
# How far the faulting thread runs ahead of the tensors made in the arena: enough to stay ahead of a converter,
# small enough that a load's peak memory hardly grows (the pages past the end are handed back at close()).
_POPULATE_AHEAD = 64 * 2**20
_POPULATE_STEP = 8 * 2**20
# Linux's values (huge pages are Linux-only); Python 3.11's mmap module names neither.
_MAP_NORESERVE = 0x4000
_MADV_POPULATE_WRITE = 23


def huge_pages_available() -> bool:
    """Whether this platform can back a mapping with transparent huge pages on request."""
    return hasattr(mmap, "MADV_HUGEPAGE")


class WeightArena:
    """One huge-page mapping of `capacity` bytes that tensors are made in, one after the other, and never freed
    apart: it holds a model's weights for the model's lifetime.

    The capacity is only reserved: pages are faulted in as tensors fill them (by the populating thread, if asked
    for, a little ahead of them), so a generous capacity costs address space, not memory.
    """

    def __init__(self, capacity: int, populate: bool = False, populate_limit: int | None = None) -> None:
        """Raises OSError where the mapping cannot be made (no huge pages, no address space).

        populate_limit: the populating thread faults in no page past this many bytes (the loader passes a lower
        bound of what the weights will take, so that pages faulted ahead are pages the weights then fill; without
        it, up to _POPULATE_AHEAD bytes past the last tensor stay resident until close())."""
        if not huge_pages_available():
            raise OSError("this platform has no transparent huge pages")
        # Private and anonymous: shared memory gets no huge pages. Not reserved: most of the capacity stays untouched.
        self._mapping = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
        self._mapping.madvise(mmap.MADV_HUGEPAGE)
        self._bytes = torch.frombuffer(self._mapping, dtype=torch.uint8)  # [capacity] uint8; keeps the mapping alive
        self.capacity = capacity
        self.used = 0
        self._populated = 0
        limit = capacity if populate_limit is None else -(-max(0, populate_limit) // _HUGE_PAGE) * _HUGE_PAGE
        self._populate_end = min(capacity, limit)
        self._closed = False
        self._changed = threading.Condition()
        self._populator: threading.Thread | None = None
        if populate:
            self._populator = threading.Thread(target=self._populate, name="tokenriver-weight-pages", daemon=True)
            self._populator.start()

    @property
    def storage(self) -> torch.UntypedStorage:
        """The storage every tensor of the arena views."""
        return self._bytes.untyped_storage()

    def empty(self, shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized contiguous tensor in the arena; in ordinary memory once the arena is full or closed
        (adopt() can move it in later)."""
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        with self._changed:
            start = -(-self.used // _ALIGNMENT) * _ALIGNMENT
            if self._closed or start + nbytes > self.capacity:
                return torch.empty(tuple(shape), dtype=dtype)
            self.used = start + nbytes
            self._changed.notify()
        return self._bytes[start : start + nbytes].view(dtype).view(tuple(shape))

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` lives in the arena (empty() may have made it elsewhere)."""
        return tensor.untyped_storage().data_ptr() == self.storage.data_ptr()

    def adopt(self, model: nn.Module) -> bool:
        """Move every CPU parameter and buffer of `model` that lives elsewhere into the arena; False, moving
        nothing, if they do not all fit.

        Tensors that share a storage (a tied embedding and output projection, views of a fused matrix) keep
        sharing it. Native kernels bound by the quantized layers are bound again to the new addresses.
        """
        by_storage = _by_storage(model, outside=self)
        if not by_storage:
            return True
        if self._closed or -(-self.used // _ALIGNMENT) * _ALIGNMENT + _aligned_bytes(by_storage) > self.capacity:
            return False
        trim = _malloc_trim()
        trim()  # what the load freed before, first
        freed = 0
        with torch.no_grad():
            for views in by_storage.values():
                storage = views[0].untyped_storage()
                destination = self.empty((storage.nbytes(),), torch.uint8)
                destination.copy_(torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,)))
                start = destination.storage_offset()
                freed += storage.nbytes()
                del storage
                for view in views:
                    view.set_(
                        self.storage, start // view.element_size() + view.storage_offset(), view.size(), view.stride()
                    )
                if freed >= _TRIM_EVERY_BYTES:
                    trim()
                    freed = 0
        trim()
        _rebind_native(model)
        return True

    def close(self) -> None:
        """Stop making tensors here (empty() falls back to ordinary memory) and hand back the pages faulted in
        past the last tensor."""
        with self._changed:
            self._closed = True
            self._changed.notify()
        if self._populator is not None:
            self._populator.join()
        tail = -(-self.used // _HUGE_PAGE) * _HUGE_PAGE
        if tail < self._populated:
            self._mapping.madvise(mmap.MADV_DONTNEED, tail, self._populated - tail)

    def _populate(self) -> None:
        """Fault pages in a little ahead of the tensors being made (MADV_POPULATE_WRITE, Linux 5.14+; through
        ctypes, which lets go of the GIL, so the loader's thread runs meanwhile)."""
        madvise = _libc_function("madvise")
        base = self._bytes.data_ptr()
        while True:
            with self._changed:
                while not self._closed and self._populated >= min(self.used + _POPULATE_AHEAD, self._populate_end):
                    self._changed.wait()
                if self._closed:
                    return
                start = self._populated
            end = min(start + _POPULATE_STEP, self._populate_end)
            if (
                madvise is None
                or madvise(ctypes.c_void_p(base + start), ctypes.c_size_t(end - start), _MADV_POPULATE_WRITE) != 0
            ):
                return  # an older kernel: the loader's own writes fault the pages in
            with self._changed:
                self._populated = end


def move_weights_to_huge_pages(model: nn.Module) -> int:
    """Move every CPU parameter and buffer of `model` into one new huge-page mapping; returns its size in bytes
    (0 where nothing moved).

    Call it before anything keeps raw pointers into the weights: the native kernels bound by the quantized layers
    are bound again here, and nothing else binds before the engine starts.
    """
    by_storage = _by_storage(model)
    if not by_storage or not huge_pages_available():
        return 0
    try:
        arena = WeightArena(_aligned_bytes(by_storage))
    except OSError:  # a kernel built without THP, or no address space: the weights stay where they are
        return 0
    arena.adopt(model)
    return arena.capacity


@contextlib.contextmanager
def moving_to_huge_pages(model: nn.Module, arena: WeightArena | None = None) -> Iterator[None]:
    """Move `model`'s weights into `arena` (closing it), or into a new mapping, on another thread for the
    duration of the block, which must not touch the model's tensors; its error, if any, is raised at the end of
    the block."""
    errors: list[BaseException] = []

    def move() -> None:
        try:
            move_into_arena(model, arena)
        except BaseException as error:  # handed to the caller's thread below
            errors.append(error)

    mover = threading.Thread(target=move, name="tokenriver-weight-move", daemon=True)
    mover.start()
    try:
        yield
    finally:
        mover.join()
    if errors:
        raise errors[0]


def move_into_arena(model: nn.Module, arena: WeightArena | None = None) -> None:
    """Move `model`'s weights made elsewhere into `arena` and close it; everything into a mapping of its own where
    they do not fit, or into a new one without an arena. Copies on all of PyTorch's threads (a load runs on one)."""
    caller_threads = torch.get_num_threads()
    torch.set_num_threads(default_num_threads())
    try:
        if arena is None or not arena.adopt(model):  # a full arena: everything to a mapping of its own
            move_weights_to_huge_pages(model)
    finally:
        if arena is not None:
            arena.close()
        torch.set_num_threads(caller_threads)


def _tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    """Each parameter and buffer object once (a module reached twice, as a tied table is, yields its own once)."""
    seen: set[int] = set()
    for module in model.modules():
        for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                yield tensor


def _by_storage(model: nn.Module, outside: WeightArena | None = None) -> dict[int, list[torch.Tensor]]:
    """Storage address → the CPU tensors of `model` viewing it (those not in `outside`): each storage is copied
    once, and all its views follow it."""
    by_storage: dict[int, list[torch.Tensor]] = {}
    for tensor in _tensors(model):
        if (
            tensor.device.type == "cpu"
            and tensor.untyped_storage().nbytes() > 0
            and (outside is None or not outside.holds(tensor))
        ):
            by_storage.setdefault(tensor.untyped_storage().data_ptr(), []).append(tensor)
    return by_storage


def _aligned_bytes(by_storage: dict[int, list[torch.Tensor]]) -> int:
    """Bytes the storages take one after the other, each starting on an _ALIGNMENT boundary."""
    return sum(-(-views[0].untyped_storage().nbytes() // _ALIGNMENT) * _ALIGNMENT for views in by_storage.values())


def _rebind_native(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.rebind()


@functools.cache
def _libc_function(name: str) -> Callable[..., int] | None:
    library = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(library, use_errno=True), name, None) if library is not None else None


def release_freed_heap() -> None:
    """Hand the memory a load freed back to the OS (glibc keeps freed heap pages otherwise)."""
    _malloc_trim()()


def _malloc_trim() -> Callable[[], None]:
    """glibc's malloc_trim(0), which hands freed heap memory back to the OS (glibc keeps it otherwise), or a no-op."""
    trim = _libc_function("malloc_trim")
    return (lambda: None) if trim is None else (lambda: trim(0))
