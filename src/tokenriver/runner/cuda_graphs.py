"""DecodeGraphs: a GPU's decode steps replayed from CUDA graphs.

A decode step of a small model launches a few hundred small kernels. Launched one by one from Python, each costs
the host more time than the GPU spends running it, so an eager step leaves the GPU idle most of the time. A CUDA
graph records the kernels of one forward pass once and replays them all with one call.

A graph is fixed in its shapes and in the addresses of its buffers, so there is one graph per (batch bucket, block
bucket): the batch padded up to the next of BATCH_BUCKETS, the block tables up to the next power of two blocks. Before
each replay the step's inputs are copied into the graph's buffers. Padding rows decode token 0 at position 0 with a
context of one token, and write their key and value into the pool's padding slot, a block the block manager never
hands out (KVCache.padding_slot); their outputs are dropped.

Only batches of one-token decodes replay graphs. Prompt chunks, speculative verification and batches past the largest
bucket run eagerly. A model whose step reads values back to the host (a mixture of experts counts its tokens per
expert) cannot be recorded: the first failed capture is logged and every later step runs eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tokenriver.kv.cache import KVCache
from tokenriver.models.attention_metadata import AttentionMetadata
from tokenriver.models.layers import RotaryEmbedding

logger = logging.getLogger(__name__)

# Batch sizes a graph is recorded for: a batch runs in the smallest that holds it. Finer steps at small sizes, where
# single-stream latency is what counts; coarser ones above, where the padding is a smaller share.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
# Fewest blocks a graph's tables hold: short contexts share one graph.
MIN_GRAPH_BLOCKS = 8

Forward = Callable[[torch.Tensor, torch.Tensor, KVCache, AttentionMetadata], torch.Tensor]


@dataclass
class _Graph:
    """One recorded decode step and the buffers it reads and writes."""

    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    slot_mapping: torch.Tensor  # [B] int64
    block_tables: torch.Tensor  # [B, num_blocks] int64
    seq_lens: torch.Tensor  # [B] int64
    output: torch.Tensor  # [B, hidden_size]: the final-norm hidden states


class DecodeGraphs:
    """Runs decode batches through recorded CUDA graphs; `run` answers None where a step must run eagerly."""

    def __init__(
        self, forward: Forward, model: nn.Module, kv_cache: KVCache, max_batch: int, max_model_len: int
    ) -> None:
        if kv_cache.padding_slot is None:
            raise ValueError("DecodeGraphs needs a KV pool with a padding block (KVCache(..., padding_block=True))")
        self.forward = forward
        self.kv_cache = kv_cache
        self.device = kv_cache[0][0].device
        self.buckets = [b for b in BATCH_BUCKETS if b < max_batch] + [min(max_batch, BATCH_BUCKETS[-1])]
        self.max_blocks = -(-max_model_len // kv_cache.block_size)
        self.enabled = True
        self._graphs: dict[tuple[int, int], _Graph] = {}
        # Shapes whose recording ran out of memory (a long context in a large batch): they run eagerly.
        self._too_large: set[tuple[int, int]] = set()
        self._pool = torch.cuda.graph_pool_handle()
        # Positions a graph may see are known only on the GPU: every rotary table covers them all before recording.
        for module in model.modules():
            if isinstance(module, RotaryEmbedding):
                module.reserve(max_model_len, self.device)

    @property
    def num_graphs(self) -> int:
        """Graphs recorded so far."""
        return len(self._graphs)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor | None:
        """The step's final-norm hidden states [B, hidden] from a graph, or None if this step runs eagerly."""
        batch = len(metadata.query_lens)
        if not self.enabled or batch == 0 or len(metadata.decode_indices) != batch or batch > self.buckets[-1]:
            return None
        bucket = next(b for b in self.buckets if b >= batch)
        needed = metadata.block_tables.shape[1]
        if needed > self.max_blocks:
            return None
        num_blocks = min(self.max_blocks, max(MIN_GRAPH_BLOCKS, 1 << (needed - 1).bit_length()))
        graph = self._graphs.get((bucket, num_blocks))
        if graph is None:
            if (bucket, num_blocks) in self._too_large:
                return None
            graph = self._capture(bucket, num_blocks)
            if graph is None:
                return None
        graph.input_ids[:batch].copy_(input_ids)
        graph.input_ids[batch:].zero_()
        graph.positions[:batch].copy_(positions)
        graph.positions[batch:].zero_()
        graph.slot_mapping[:batch].copy_(metadata.slot_mapping)
        graph.slot_mapping[batch:].fill_(self.kv_cache.padding_slot)
        # Columns past this step's tables keep older block ids: in range, and masked off by the lengths.
        graph.block_tables[:batch, : metadata.block_tables.shape[1]].copy_(metadata.block_tables)
        graph.seq_lens[:batch].copy_(metadata.decode_lengths)
        graph.seq_lens[batch:].fill_(1)
        graph.graph.replay()
        return graph.output[:batch]

    def _capture(self, batch: int, num_blocks: int) -> _Graph | None:
        """Record the decode step of `batch` rows over `num_blocks` blocks; None if it cannot be: that shape runs
        eagerly from now on when it does not fit in memory, every step when the model's step cannot be recorded."""
        device = self.device
        input_ids = torch.zeros(batch, dtype=torch.long, device=device)
        positions = torch.zeros(batch, dtype=torch.long, device=device)
        slot_mapping = torch.full((batch,), self.kv_cache.padding_slot, dtype=torch.long, device=device)
        block_tables = torch.zeros(batch, num_blocks, dtype=torch.long, device=device)
        seq_lens = torch.ones(batch, dtype=torch.long, device=device)

        def metadata() -> AttentionMetadata:
            # A fresh one per pass: what it derives from the buffers (the length mask) is computed once per
            # instance, and the recorded pass must compute it inside the graph, from the buffers as they are then.
            return AttentionMetadata.for_decode_graph(slot_mapping, block_tables, seq_lens, self.kv_cache.block_size)

        try:
            # Warm up on a side stream first, as PyTorch asks: lazy initialisations (cuBLAS handles, Triton's
            # compilation) must not happen inside the recording. They write only to the padding slot.
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.forward(input_ids, positions, self.kv_cache, metadata())
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                output = self.forward(input_ids, positions, self.kv_cache, metadata())
        except torch.OutOfMemoryError:
            logger.warning(
                "a CUDA graph of %d rows over %d blocks does not fit in memory: such steps run eagerly",
                batch,
                num_blocks,
            )
            self._too_large.add((batch, num_blocks))
            torch.cuda.empty_cache()
            return None
        except Exception as error:  # noqa: BLE001 - whatever the model's code raises while recording, run eagerly
            logger.warning(
                "CUDA graphs off, decode steps run eagerly: recording a %d-row step failed: %s",
                batch,
                str(error).splitlines()[0] if str(error) else type(error).__name__,
            )
            self.enabled = False
            return None
        recorded = _Graph(graph, input_ids, positions, slot_mapping, block_tables, seq_lens, output)
        self._graphs[(batch, num_blocks)] = recorded
        return recorded
