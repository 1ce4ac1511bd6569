"""The greedy passes of a multi-step decode in one native call (models/cpu/csrc/decoder.cpp's decoder_greedy_f32).

A multi-step decode (`num_scheduler_steps`) runs several forward passes for plain greedy requests, each decoding
the token the pass before chose. Between two passes the runner embeds the tokens, gathers the rotary rows, builds
the attention metadata, runs the final norm and the output projection, and takes each row's argmax: a few hundred
microseconds of Python a pass, an eighth of a small model's decode step, and slower than its arithmetic suggests
because the weights streamed by every pass have pushed Python's own data out of the caches. Here one call runs
all the passes: the same kernels with the same arguments, so tokens and logprobs equal the runner's own loop bit for
bit (tests/models/cpu/test_native_greedy.py).

Contract: `GreedyLoop.build(model, decoder)` returns None unless the model's parts around the stack have a native
form: an embedding that is a float32 table or a quantized layer on the native backend (scaled by a constant where
the model scales it, Gemma), `RotaryEmbedding` tables, a float32 RMSNorm (Gemma's (1 + weight) bound as that sum),
and an output projection that is a native quantized layer without bias or soft-capping. `run` returns the passes it
finished; the caller runs any left its own way.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from tokenriver.kv.cache import KVCache
from tokenriver.models.cpu.decoder import NativeDecoder, linear_spec
from tokenriver.models.cpu.kernels import GreedyLoopSpec, LinearSpec, is_contiguous_f32
from tokenriver.models.gemma import GemmaRMSNorm
from tokenriver.models.layers import RMSNorm, RotaryEmbedding
from tokenriver.models.quant import QuantizedEmbedding

# (argmax, largest logit, log-sum-exp) per pass and row: [passes, rows] each.
PassReductions = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class GreedyLoop:
    """A model's embedding, rotary tables, final norm and output projection, bound once for its greedy passes."""

    def __init__(
        self,
        native: NativeDecoder,
        decoder: nn.Module,
        table: LinearSpec | None,
        float_table: torch.Tensor | None,
        vocab_size: int,
        embed_scale: float,
        final_norm: torch.Tensor,
        eps: float,
        lm_head: LinearSpec,
        keep: list[object],
    ) -> None:
        self._native = native
        self._rotary = (decoder.rotary_emb, getattr(decoder, "rotary_emb_local", None))
        self._linears = (table, lm_head)  # the structures the spec's pointers point to
        self._keep = keep  # every tensor the specs point into
        self._spec = GreedyLoopSpec(
            None if table is None else ctypes.pointer(table),
            None if float_table is None else float_table.data_ptr(),
            vocab_size,
            embed_scale,
            final_norm=final_norm.data_ptr(),
            final_norm_eps=eps,
            lm_head=ctypes.pointer(lm_head),
        )

    @classmethod
    def build(cls, model: nn.Module, native: NativeDecoder) -> GreedyLoop | None:
        """Bind `model` (a causal LM whose decoder, `model.model`, `native` runs), or None where a part around the
        stack has no native form (module docstring)."""
        decoder = model.model
        keep: list[object] = []
        embed = decoder.embed_tokens
        table = float_table = None
        if isinstance(embed, QuantizedEmbedding) and embed.dtype == torch.float32:
            table = linear_spec(embed.table)
            vocab_size = embed.table.out_features
            keep.append(embed.table)
        elif isinstance(embed, nn.Embedding) and is_contiguous_f32(embed.weight) and embed.weight.is_cpu:
            float_table = embed.weight.detach()
            vocab_size = embed.num_embeddings
            keep.append(float_table)
        if table is None and float_table is None:
            return None
        local = getattr(decoder, "rotary_emb_local", None)
        if any(rotary is not None and type(rotary) is not RotaryEmbedding for rotary in (decoder.rotary_emb, local)):
            return None
        norm = decoder.norm
        if type(norm) is RMSNorm:
            final_norm = norm.weight.detach()
        elif type(norm) is GemmaRMSNorm:
            final_norm = 1.0 + norm.weight.detach()  # as the module computes it each call
        else:
            return None
        lm_head = model.lm_head
        head = linear_spec(lm_head)
        if (
            head is None
            or lm_head.bias is not None
            or not is_contiguous_f32(final_norm)
            or getattr(model.config, "final_logit_softcapping", None) is not None
        ):
            return None
        keep += [final_norm, lm_head]
        return cls(
            native,
            decoder,
            table,
            float_table,
            vocab_size,
            float(getattr(decoder, "embed_scale", 0.0)),
            final_norm,
            norm.eps,
            head,
            keep,
        )

    def run(
        self, num_passes: int, token_ids: list[int], positions: list[int], block_tables: torch.Tensor, kv_cache: KVCache
    ) -> PassReductions:
        """num_passes greedy passes of len(token_ids) one-token requests: pass p decodes, for request b, token_ids[b]
        (p = 0) or its argmax of pass p - 1, at position positions[b] + p, its slots in block_tables [B, max_blocks]
        int64 (which must cover every pass). The reductions of the passes it finished ([finished, B] each)."""
        num_rows = len(token_ids)
        cos, sin = self._rotary[0].tables(max(positions) + num_passes, torch.device("cpu"))
        local_cos, local_sin = (
            (cos, sin)
            if self._rotary[1] is None
            else self._rotary[1].tables(max(positions) + num_passes, torch.device("cpu"))
        )
        first_tokens = torch.tensor(token_ids, dtype=torch.int64)  # [B]
        first_positions = torch.tensor(positions, dtype=torch.int64)  # [B]
        argmax = torch.empty(num_passes, num_rows, dtype=torch.int64)  # [P, B]
        max_logits = torch.empty(num_passes, num_rows, dtype=torch.float32)  # [P, B]
        lse = torch.empty(num_passes, num_rows, dtype=torch.float32)  # [P, B]
        spec = self._spec
        spec.cos_table, spec.sin_table = cos.data_ptr(), sin.data_ptr()
        spec.local_cos_table, spec.local_sin_table = local_cos.data_ptr(), local_sin.data_ptr()
        spec.num_positions = min(cos.shape[0], local_cos.shape[0])
        spec.num_passes = num_passes
        spec.first_tokens, spec.first_positions = first_tokens.data_ptr(), first_positions.data_ptr()
        spec.tokens, spec.max_logits, spec.log_normalizers = argmax.data_ptr(), max_logits.data_ptr(), lse.data_ptr()
        finished = self._native.greedy_passes(spec, kv_cache, block_tables)
        return argmax[:finished], max_logits[:finished], lse[:finished]
