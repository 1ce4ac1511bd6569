"""The engine's memory account: every resident MiB of the process, by what holds it, for the startup log.

Each part is measured on its own (tokenriver/process_memory.py), not worked out from the others:
- weights: the resident pages of the model's CPU parameters and buffers (their storages: the loader's weight
  arena), and of the model file's own mapping, which is 0 when every weight is a converted copy;
- KV pool: the pages of the pool's tensors touched so far, beside the bytes it reserves (its tensors are anonymous
  mappings, resident only once a token's K/V is written there);
- tokenizer: what building it added to resident memory, measured by the loader (loader/load.py's LoadMemory);
- runtime: what was resident before the load (the interpreter, torch and the modules imported: anonymous memory)
  and the pages of mapped files now (the libraries' code);
- other: the rest of the resident memory, what none of the parts above holds (the engine's own objects, heap a load
  left behind). tests/engine/test_memory_account.py checks it stays small: a copy of the weights left over from
  the load, or a KV pool written through, would show there.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from tokenriver.loader.load import LoadedModel
from tokenriver.process_memory import mapped_file_bytes, read_status, resident_bytes

_MIB = 2**20


@dataclass(frozen=True)
class MemoryAccount:
    """The process's resident memory by part, in bytes (module docstring)."""

    # VmRSS now, and the process's peak when the load ended and its resident memory then.
    resident: int
    peak_during_load: int
    resident_after_load: int
    weights: int
    weights_mapped_from_file: int
    kv_touched: int
    kv_reserved: int
    tokenizer: int
    runtime: int
    # resident less every part above; negative where a part over-counts (pages that were freed since the load).
    other: int

    def describe(self) -> str:
        """One line for the startup log."""
        return (
            f"memory: weights {_mib(self.weights)} (mapped from the file: {_mib(self.weights_mapped_from_file)}), "
            f"KV pool {_mib(self.kv_touched)} touched of {_mib(self.kv_reserved)}, tokenizer {_mib(self.tokenizer)}, "
            f"runtime (torch, Python, code) {_mib(self.runtime)}, other {_mib(self.other)}: "
            f"RSS {_mib(self.resident)} (peak during the load {_mib(self.peak_during_load)}, "
            f"RSS after it {_mib(self.resident_after_load)})"
        )


def memory_account(loaded: LoadedModel, kv_tensors: Iterable[torch.Tensor]) -> MemoryAccount | None:
    """Account for the process's resident memory now; None where it cannot be read (no /proc: not Linux) or the
    model was not measured as it loaded (a LoadedModel made otherwise than by load_model)."""
    if loaded.memory.resident_after == 0:
        return None
    status = read_status()
    mapped = mapped_file_bytes(_model_files(loaded.path))
    weights = resident_bytes(_storage_ranges(_weight_tensors(loaded.model)))
    kv_list = [tensor for tensor in kv_tensors if tensor.is_cpu]
    kv_touched = resident_bytes((tensor.data_ptr(), tensor.nbytes) for tensor in kv_list)
    if status is None or mapped is None or weights is None or kv_touched is None:
        return None
    runtime = loaded.memory.anonymous_before + status.file + status.shared - mapped
    weights_total = weights + mapped
    parts = weights_total + kv_touched + loaded.memory.tokenizer + runtime
    return MemoryAccount(
        resident=status.resident,
        peak_during_load=loaded.memory.peak,
        resident_after_load=loaded.memory.resident_after,
        weights=weights_total,
        weights_mapped_from_file=mapped,
        kv_touched=kv_touched,
        kv_reserved=sum(tensor.nbytes for tensor in kv_list),
        tokenizer=loaded.memory.tokenizer,
        runtime=runtime,
        other=status.resident - parts,
    )


def _weight_tensors(model: nn.Module) -> list[torch.Tensor]:
    return [tensor for tensor in (*model.parameters(), *model.buffers()) if tensor.is_cpu]


def _storage_ranges(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """(address, bytes) of each distinct storage (the weight arena's is the whole mapping: its pages past the last
    weight were handed back, so they are not resident)."""
    ranges = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes():
            ranges[storage.data_ptr()] = storage.nbytes()
    return list(ranges.items())


def _model_files(path: str) -> list[str]:
    if os.path.isdir(path):
        return [os.path.join(path, name) for name in os.listdir(path)]
    return [path]


def _mib(num_bytes: int) -> str:
    value = num_bytes / _MIB
    return f"{value:.1f} MiB" if abs(value) < 10 else f"{value:.0f} MiB"
