"""engine/token_cost.py: the cost of a token against the reference model and the loaded weights themselves.

The parameter count and the multiply-adds per token are checked against transformers' model of the same file (its
parameters' numels, its linear layers' rows × columns); the bytes a pass reads against the packed buffers the
kernels stream; the two rules that are not sums over every weight (a lookup table is not streamed unless it is the
output layer; a mixture of experts runs top-k of its experts) on small models built here.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenriver.engine.llm import LLM
from tokenriver.engine.token_cost import attended_positions, token_cost
from tokenriver.loader.load import LoadedModel
from tokenriver.models.config import ModelConfig
from tokenriver.models.llama import LlamaForCausalLM
from tokenriver.models.moe import Qwen3MoeForCausalLM
from tokenriver.models.quant import Int4Linear, Int8Linear

KV_BYTES_PER_TOKEN = 12 * 1024
TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4)


def _loaded(model: nn.Module, config: ModelConfig) -> LoadedModel:
    num_parameters = sum(p.numel() for p in model.parameters())  # torch counts a tied parameter once
    return LoadedModel(model, config, tokenizer=None, path="", num_parameters=num_parameters, num_bytes=0)


def test_parameters_and_multiply_adds_are_the_reference_models(loaded_default, hf_reference):
    reference, _ = hf_reference
    cost = token_cost(loaded_default, KV_BYTES_PER_TOKEN)
    assert cost.num_parameters == sum(p.numel() for p in reference.parameters())
    linears = [m for m in reference.modules() if isinstance(m, nn.Linear)]
    assert cost.multiply_adds_per_token == sum(m.in_features * m.out_features for m in linears)
    head = reference.get_output_embeddings()
    assert cost.output_multiply_adds == head.in_features * head.out_features
    config = reference.config
    heads = config.num_hidden_layers * config.num_attention_heads * config.head_dim
    assert cost.attention_multiply_adds_per_position == 2 * heads


def test_bytes_per_pass_are_the_packed_buffers_the_kernels_stream(loaded_default):
    cost = token_cost(loaded_default, KV_BYTES_PER_TOKEN)
    packed = {
        m.qweight.data_ptr(): m for m in loaded_default.model.modules() if isinstance(m, (Int4Linear, Int8Linear))
    }
    buffers = [t for m in packed.values() for t in (m.qweight, m.scales, getattr(m, "mins", None)) if t is not None]
    norms = list(loaded_default.model.parameters())
    assert all(p.dtype == torch.float32 and p.dim() == 1 for p in norms)  # the only float weights: the norms
    assert cost.weight_bytes_per_pass == sum(t.nbytes for t in buffers + norms)
    # The embedding is tied: its table is the output layer's, read whole by every pass.
    assert loaded_default.model.model.embed_tokens.table is loaded_default.model.lm_head
    assert cost.pass_bytes(100) == cost.weight_bytes_per_pass + 100 * KV_BYTES_PER_TOKEN


def test_a_float32_model_reads_four_bytes_per_parameter(loaded_float32):
    cost = token_cost(loaded_float32, KV_BYTES_PER_TOKEN)
    assert cost.weight_bytes_per_pass == 4 * loaded_float32.num_parameters


def test_an_untied_embedding_table_is_looked_up_not_streamed():
    config = ModelConfig(architecture="llama", **TINY, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    cost = token_cost(_loaded(model, config), KV_BYTES_PER_TOKEN)
    table = model.model.embed_tokens.weight.numel()
    assert cost.weight_bytes_per_pass == 4 * (cost.num_parameters - table)
    # Per token: every matrix, the output layer included, and no lookup.
    assert cost.multiply_adds_per_token == sum(
        m.in_features * m.out_features for m in model.modules() if isinstance(m, nn.Linear)
    )


def test_a_mixture_of_experts_counts_the_experts_a_token_runs():
    config = ModelConfig(
        architecture="qwen3_moe", **TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=8
    )
    model = Qwen3MoeForCausalLM(config)
    cost = token_cost(_loaded(model, config), KV_BYTES_PER_TOKEN)
    hidden, q, kv = 16, 4 * 4, 2 * 4
    attention = hidden * (q + 2 * kv) + q * hidden
    router = hidden * 8
    two_experts = 2 * (hidden * 2 * 8 + 8 * hidden)
    assert cost.multiply_adds_per_token == 2 * (attention + router + two_experts) + hidden * 64


def test_attended_positions_are_the_causal_pairs():
    for num_tokens, num_context in [(1, 1), (1, 30), (5, 5), (5, 12), (16, 40)]:
        pairs = sum(1 for i in range(num_tokens) for _ in range(num_context - num_tokens + i + 1))
        assert attended_positions(num_tokens, num_context) == pairs


def test_the_engine_publishes_the_cost_with_its_model_info(loaded_default):
    llm = LLM.from_loaded(loaded_default, max_num_kv_tokens=1024)
    info = llm.engine.model_info
    assert info.token_cost == token_cost(loaded_default, info.kv_bytes_per_token)
    assert info.token_cost.num_parameters == info.num_parameters
