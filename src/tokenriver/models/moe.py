"""Mixture-of-experts decoders: Qwen3-MoE, Qwen2-MoE and Mixtral.

All are the Qwen3 page (models/qwen3.py: Qwen3-MoE with its q/k norms, Mixtral and Qwen2-MoE without, Qwen2-MoE
with a QKV bias) with the MLP replaced by a sparse block: a router (`gate`, one logit per expert) picks each token's
top num_experts_per_tok experts by softmax probability, renormalizes the chosen probabilities to sum to one where
the architecture does (norm_topk_prob: Mixtral always, the Qwens per config), and the token's output is the
weighted sum of those experts' SwiGLU MLPs. Qwen2-MoE adds a shared expert every token goes through, scaled by
sigmoid(shared_expert_gate(x)). Routing (the router's logits, softmax and top-k, and the shared gate) runs in the
native ops the native decoder runs (models/cpu/decoder.py) where they apply, so both paths choose alike.

In a ragged batch the (token, expert) pairs are sorted by expert, so each expert multiplies only the rows of the
tokens routed to it, once, as one matrix; experts no token chose cost nothing. Each expert is an ordinary
projection pair (gate_up_proj, down_proj), so the loader can install a quantized linear per expert. Parameter names
are Hugging Face's Qwen3-MoE ones (`mlp.gate`, `mlp.experts.{e}.gate_proj` ...); the loader renames Mixtral's
(`block_sparse_moe`, `w1`/`w3`/`w2`) to them, as transformers 5 itself does.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenriver.models.config import ModelConfig
from tokenriver.models.fast_path import FastPath, fast_path
from tokenriver.models.layers import SwiGLUMLP
from tokenriver.models.qwen3 import FUSED_PROJECTIONS as DENSE_FUSED_PROJECTIONS
from tokenriver.models.qwen3 import Qwen3ForCausalLM

# Each expert's gate_proj and up_proj stacked, besides the attention's q/k/v.
FUSED_PROJECTIONS = {**DENSE_FUSED_PROJECTIONS, "gate_up_proj": ("gate_proj", "up_proj")}


class SparseMoeBlock(nn.Module):
    """Router + experts: y = sum over the token's top-k experts e of weight_e * expert_e(x)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            SwiGLUMLP(config.hidden_size, config.moe_intermediate_size) for _ in range(config.num_experts)
        )
        self.shared_expert: SwiGLUMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = SwiGLUMLP(config.hidden_size, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def gates(self) -> list[nn.Module]:
        """The router, and the shared expert's gate where there is one."""
        return [self.gate] if self.shared_expert_gate is None else [self.gate, self.shared_expert_gate]

    def fast_routing(self, x: torch.Tensor) -> FastPath | None:
        """x's fast path where it routes this block (the native decoder routes the same way, with the same
        kernels, so that both paths choose alike), else None."""
        fast = fast_path(x)
        return fast if fast is not None and fast.routes_moe(self.gates(), len(self.experts)) else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] → (chosen experts [T, top_k] int64, their weights [T, top_k] in x's dtype)."""
        fast = self.fast_routing(x)
        routed = None if fast is None else fast.moe_route(x, self.gate.weight, self.top_k, self.norm_topk_prob)
        if routed is not None:
            return routed
        probabilities = torch.softmax(self.gate(x).float(), dim=-1)  # [T, num_experts]
        weights, experts = probabilities.topk(self.top_k, dim=-1)  # [T, top_k] each
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] → [T, hidden]."""
        experts, weights = self.route(x)
        flat_experts = experts.flatten()  # [T * top_k]: pair p is token p // top_k's (p % top_k)-th choice
        order = flat_experts.argsort(stable=True)  # pairs grouped by expert, tokens in order within each
        counts = torch.bincount(flat_experts, minlength=len(self.experts)).tolist()
        tokens = order // self.top_k  # [T * top_k] token of each sorted pair
        pair_weights = weights.flatten().index_select(0, order)[:, None]  # [T * top_k, 1]
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                rows = tokens[start : start + count]
                out.index_add_(0, rows, expert(x.index_select(0, rows)) * pair_weights[start : start + count])
            start += count
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            fast = self.fast_routing(x)
            gate = None if fast is None else fast.sigmoid_gate(x, self.shared_expert_gate.weight[0])  # [T, 1]
            if gate is None:
                gate = torch.sigmoid(self.shared_expert_gate(x))
            out += gate * self.shared_expert(x)  # [T, 1] * [T, hidden]
        return out


def sparse_mlp(config: ModelConfig, layer_idx: int) -> nn.Module:
    return SparseMoeBlock(config)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE: Qwen3's attention (with q/k norms) and a sparse MLP in every layer."""

    fused_projections = FUSED_PROJECTIONS

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, sparse_mlp)


class Qwen2MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen2-MoE: Qwen2's attention (QKV bias, no q/k norms), routed experts plus a gated shared expert."""

    fused_projections = FUSED_PROJECTIONS

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, sparse_mlp)


class MixtralForCausalLM(Qwen3ForCausalLM):
    """Mixtral: Mistral's attention (no q/k norms; config.qk_norm is false) and a sparse MLP in every layer."""

    fused_projections = FUSED_PROJECTIONS

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, sparse_mlp)
