"""AttentionMetadata: what a step's attention needs to know, built once per step from plain lengths and tables.

A step is ragged: request i contributes `query_lens[i]` new tokens (a prompt chunk, or one decode token) and attends
to `seq_lens[i]` tokens in all, its cached prefix plus itself. Token t of request i sits at position
`seq_lens[i] - query_lens[i] + t` and may see positions 0..that position. Its key and value go into the slot
`block_tables[i][position // block_size] * block_size + position % block_size` of the pool.

Besides those, the metadata carries what the fast paths read, derived once per step so that no layer derives it
again: the native CPU kernel's token and chunk lists (`kernel_queries`, `kernel_chunks`, built on the CPU only), and
for the GPU's route (models/cuda/attention.py) the decode requests' tables and lengths and the layout of the fresh
prompts' padded batch. A CUDA graph's metadata holds tensors alone (`for_decode_graph`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

# Requests with at most this many new tokens attend token by token in the native kernel, longer ones through its
# chunk path: at one token the former is faster, at two they are even (benchmarks/results/attention.md).
MAX_KERNEL_QUERY_LEN = 2


def to_device(values: list, device: torch.device | str) -> torch.Tensor:
    """An int64 tensor of `values` (a list, or a list of equal-length lists) on `device`. To a GPU it goes through
    pinned memory without waiting: a plain copy would first wait for every kernel queued on the device, so the host
    could never prepare a step while the GPU runs the one before."""
    tensor = torch.tensor(values, dtype=torch.long)
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each one may attend to."""

    # Flat cache slot of each new token: [num_tokens] int64.
    slot_mapping: torch.Tensor
    # Tokens of each request in this step; sums to num_tokens.
    query_lens: list[int]
    # Context length of each request after this step (cached prefix + new tokens).
    seq_lens: list[int]
    # Block ids of each request, padded with 0: [num_requests, max_num_blocks] int64.
    block_tables: torch.Tensor
    block_size: int
    # Indices (into the request list) of requests whose query length is 1.
    decode_indices: list[int]
    # Indices of the other requests (prompt chunks, speculative verification).
    prefill_indices: list[int]
    # One row per token of the requests with at most MAX_KERNEL_QUERY_LEN new tokens, for the native kernel:
    # (its flat token row, its request's index, the context length it sees) [num_kernel_tokens, 3] int64; None if
    # there are no such requests, or off the CPU.
    kernel_queries: torch.Tensor | None
    # One row per request with more new tokens than that (a prompt chunk), for the native kernel's chunk path:
    # (its first flat token row, its index, its number of new tokens, its context length after them)
    # [num_chunks, 4] int64; None if there are none, or off the CPU.
    kernel_chunks: torch.Tensor | None

    @cached_property
    def query_start_loc(self) -> list[int]:
        """Flat row of each request's first token, plus num_tokens at the end."""
        starts = [0]
        for length in self.query_lens:
            starts.append(starts[-1] + length)
        return starts

    @cached_property
    def decode_block_tables(self) -> torch.Tensor:
        """[len(decode_indices), max_decode_blocks] block ids of the decode requests (the GPU route)."""
        max_len = max(self.seq_lens[i] for i in self.decode_indices)
        num_blocks = (max_len + self.block_size - 1) // self.block_size
        rows = to_device(self.decode_indices, self.block_tables.device)
        return self.block_tables.index_select(0, rows)[:, :num_blocks]

    @cached_property
    def decode_lengths(self) -> torch.Tensor:
        """[len(decode_indices)] int64 context length of each decode request (the GPU route)."""
        return to_device([self.seq_lens[i] for i in self.decode_indices], self.block_tables.device)

    @cached_property
    def decode_mask(self) -> torch.Tensor:
        """[len(decode_indices), max_decode_blocks * block_size] bool: which gathered slots are real tokens."""
        num_slots = self.decode_block_tables.shape[1] * self.block_size
        slots = torch.arange(num_slots, device=self.block_tables.device)
        return slots[None, :] < self.decode_lengths[:, None]

    @cached_property
    def fresh_prompts(self) -> "FreshPrompts":
        """The prompt chunks with nothing cached before them, for one padded attention call (the GPU route)."""
        indices = [i for i in self.prefill_indices if self.query_lens[i] == self.seq_lens[i]]
        max_len = max((self.query_lens[i] for i in indices), default=0)
        if len(indices) < 2 or len(indices) * max_len > 2 * sum(self.query_lens[i] for i in indices):
            # One prompt, or lengths so uneven that padding would be most of the work: one call per prompt.
            return FreshPrompts(indices, frozenset(indices), max_len, None, None, None)
        starts = self.query_start_loc
        rows: list[int] = []
        padded_rows: list[int] = []
        gather: list[int] = []
        for b, i in enumerate(indices):
            length = self.query_lens[i]
            rows.extend(range(starts[i], starts[i] + length))
            padded_rows.extend(range(b * max_len, b * max_len + length))
            gather.extend(starts[i] + min(j, length - 1) for j in range(max_len))
        device = self.block_tables.device
        return FreshPrompts(
            indices,
            frozenset(indices),
            max_len,
            to_device(rows, device),
            to_device(padded_rows, device),
            to_device(gather, device),
        )

    @classmethod
    def for_decode_graph(
        cls, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int
    ) -> "AttentionMetadata":
        """A batch of one-token decodes described by tensors alone, for a CUDA graph (runner/cuda_graphs.py): a
        graph replays the kernels it recorded on whatever its input buffers hold, so no length may be read back to
        the host. slot_mapping, seq_lens [B] and block_tables [B, num_blocks] are those buffers; the Python lists
        hold the batch's shape, each length as its upper bound num_blocks * block_size."""
        batch, num_blocks = block_tables.shape
        metadata = cls(
            slot_mapping=slot_mapping,
            query_lens=[1] * batch,
            seq_lens=[num_blocks * block_size] * batch,
            block_tables=block_tables,
            block_size=block_size,
            decode_indices=list(range(batch)),
            prefill_indices=[],
            kernel_queries=None,
            kernel_chunks=None,
        )
        metadata.decode_block_tables = block_tables
        metadata.decode_lengths = seq_lens
        return metadata

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        max_kernel_query_len: int = MAX_KERNEL_QUERY_LEN,
    ) -> "AttentionMetadata":
        """Derive slots, padding and the per-kernel split from per-request lengths and block tables.

        max_kernel_query_len: requests with at most this many new tokens go to the native kernel token by token,
        longer ones to its chunk path (benchmarks move it; the engine keeps the default).
        """
        slots: list[int] = []
        kernel_queries: list[tuple[int, int, int]] = []
        kernel_chunks: list[tuple[int, int, int, int]] = []
        row = 0
        for i, (query_len, seq_len, blocks) in enumerate(zip(query_lens, seq_lens, block_tables)):
            for position in range(seq_len - query_len, seq_len):
                slots.append(blocks[position // block_size] * block_size + position % block_size)
            if query_len <= max_kernel_query_len:
                # The token at `position` sees positions 0..position: position + 1 tokens.
                kernel_queries.extend((row + t, i, seq_len - query_len + t + 1) for t in range(query_len))
            else:
                kernel_chunks.append((row, i, query_len, seq_len))
            row += query_len
        on_cpu = torch.device(device).type == "cpu"
        max_blocks = max((len(b) for b in block_tables), default=0)
        padded = [b + [0] * (max_blocks - len(b)) for b in block_tables]
        return cls(
            slot_mapping=to_device(slots, device),
            query_lens=list(query_lens),
            seq_lens=list(seq_lens),
            block_tables=to_device(padded, device),
            block_size=block_size,
            decode_indices=[i for i, q in enumerate(query_lens) if q == 1],
            prefill_indices=[i for i, q in enumerate(query_lens) if q != 1],
            # Only the native (CPU) kernels read these: elsewhere they would be two copies to the device per step.
            kernel_queries=torch.tensor(kernel_queries, dtype=torch.long) if kernel_queries and on_cpu else None,
            kernel_chunks=torch.tensor(kernel_chunks, dtype=torch.long) if kernel_chunks and on_cpu else None,
        )


@dataclass
class FreshPrompts:
    """The prompt chunks of a step that start at position 0, laid out for one padded batch: B requests, each
    right-padded to the longest (L tokens). Causal attention from the top-left never lets a real token see the
    padding after it, so padded rows are computed and dropped."""

    indices: list[int]  # requests, in the step's order
    index_set: frozenset[int]
    max_len: int
    # None where they run one call each (a single prompt, or padding that would outweigh the prompts).
    rows: torch.Tensor | None  # [num_fresh_tokens] their flat rows
    padded_rows: torch.Tensor | None  # [num_fresh_tokens] each one's row in the [B * L] padded batch
    gather: torch.Tensor | None  # [B * L] the flat row each padded row copies (a padding row copies its last token)
