"""BERT-family encoders: BERT and XLM-RoBERTa, for embeddings and cross-encoder reranking.

One page, top to bottom: embeddings (word + position + token type, LayerNorm) → N × encoder layer (self-attention,
then dense + LayerNorm of the sum with the layer's input: post-LN; then a GELU MLP, post-LN the same way) → the last
layer's hidden states, transformers' `last_hidden_state`. A cross-encoder adds its classification head on the first
token's hidden state (`score`). Parameter names are Hugging Face's (`BertForSequenceClassification`,
`XLMRobertaForSequenceClassification`), except that query/key/value run as one fused projection
(`attention.self.qkv_proj`; `FUSED_PROJECTIONS` tells the loader which checkpoint tensors to stack). A bare
`BertModel` / `XLMRobertaModel` checkpoint is the same model without the head: the loader puts its weights under
`bert.` / `roberta.` and leaves out its unused pooler.

An encoder differs from the decoder pages (models/llama.py) in three ways:
- attention is bidirectional: every token of a request sees every other token of that request, never one of another
  request. A step's tokens are several requests' whole prompts flattened one after another (`metadata.query_lens`
  gives each one's length; pooling requests are never chunked), and each request runs its own SDPA call, so a
  request's numbers do not depend on what it is batched with;
- nothing is cached: the KV cache argument is accepted, to be called like the decoders, and ignored;
- nothing is generated: there is no output projection and no `compute_logits`. The runner pools the rows `forward`
  returns (mean, [CLS] or last token) into an embedding, or hands the [CLS] row to `score`.

Token types are not an input: they are derived from the ids, type 0 up to and including the first [SEP]
(`config.sep_token_id`) and type 1 after it. That is exactly what the tokenizer gives a (query, document) pair,
"[CLS] query [SEP] document [SEP]", and all zeros for a single text. XLM-RoBERTa's tokenizer gives no token types
(every token is type 0), and its loader leaves sep_token_id None so that none are derived.

Positions are the engine's, from 0 in each request. XLM-RoBERTa counts them from padding_idx + 1
(`config.position_offset`), as transformers does for a prompt without padding tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenriver.errors import InvalidParameterError
from tokenriver.kv.cache import KVCache
from tokenriver.models.attention_metadata import AttentionMetadata
from tokenriver.models.config import ModelConfig

# Fused module → the Hugging Face modules whose weights (and biases) it stacks, in output order.
FUSED_PROJECTIONS = {
    "attention.self.qkv_proj": ("attention.self.query", "attention.self.key", "attention.self.value"),
}


def bidirectional_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, metadata: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Each request's tokens attend to all of that request's tokens, and to no other request's.

    query, key, value: [num_tokens, num_heads, head_dim], the requests' rows one after another (`metadata.query_lens`).
    Returns [num_tokens, num_heads, head_dim]. One SDPA call per request: no mask, no padding, and a request's result
    is the same whatever else is in the step.
    """
    output = torch.empty_like(query, memory_format=torch.contiguous_format)  # [num_tokens, num_heads, head_dim]
    starts = metadata.query_start_loc
    for i, length in enumerate(metadata.query_lens):
        rows = slice(starts[i], starts[i] + length)
        # [1, num_heads, length, head_dim]: with a batch dimension SDPA takes its fused kernels.
        q, k, v = (x[rows].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, scale=scale)  # [1, num_heads, length, head_dim]
        output[rows] = out[0].transpose(0, 1)
    return output


def derive_token_types(input_ids: torch.Tensor, metadata: AttentionMetadata, sep_token_id: int) -> torch.Tensor:
    """[num_tokens] token ids → [num_tokens] int64 token types: in each request 0 up to and including its first
    [SEP], 1 after it (the pair "[CLS] A [SEP] B [SEP]" gives A and its [SEP] type 0, B and its [SEP] type 1)."""
    is_sep = (input_ids == sep_token_id).long()  # [num_tokens]
    types = torch.zeros_like(input_ids)  # [num_tokens]
    starts = metadata.query_start_loc
    for i, length in enumerate(metadata.query_lens):
        rows = slice(starts[i], starts[i] + length)
        seps_before = is_sep[rows].cumsum(0) - is_sep[rows]  # [length]: [SEP]s strictly before each token
        types[rows] = (seps_before > 0).long()
    return types


class BertEmbeddings(nn.Module):
    """LayerNorm(word + token type + position embedding) of each token."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.position_offset = config.position_offset
        self.sep_token_id = config.sep_token_id if config.type_vocab_size > 1 else None
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        # XLM-RoBERTa's table also holds the rows before position_offset, which no token uses.
        num_positions = config.max_position_embeddings + config.position_offset
        self.position_embeddings = nn.Embedding(num_positions, config.hidden_size)
        self.token_type_embeddings = (
            nn.Embedding(config.type_vocab_size, config.hidden_size) if config.type_vocab_size else None
        )
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [num_tokens] → [num_tokens, hidden_size]."""
        hidden = self.word_embeddings(input_ids)  # [num_tokens, hidden_size]
        if self.token_type_embeddings is not None:
            if self.sep_token_id is None:
                token_types = torch.zeros_like(input_ids)  # [num_tokens]
            else:
                token_types = derive_token_types(input_ids, metadata, self.sep_token_id)  # [num_tokens]
            hidden = hidden + self.token_type_embeddings(token_types)
        hidden = hidden + self.position_embeddings(positions + self.position_offset)
        return self.LayerNorm(hidden)


class BertSelfAttention(nn.Module):
    """Multi-head self-attention over each request's own tokens (HF's `attention.self`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        # query, key and value stacked: one product for all three.
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * config.num_heads * config.head_dim)

    def forward(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """hidden [T, hidden_size] → [T, num_heads * head_dim], the heads' outputs side by side."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden).view(num_tokens, 3 * self.num_heads, self.head_dim)  # [T, 3 * heads, head_dim]
        query, key, value = qkv.split(self.num_heads, dim=1)  # [T, heads, head_dim] each, views
        out = bidirectional_attention(query, key, value, metadata, self.scale)  # [T, heads, head_dim]
        return out.view(num_tokens, self.num_heads * self.head_dim)


class BertAddNorm(nn.Module):
    """LayerNorm(dense(x) + residual): how each half of a post-LN layer ends (HF's BertSelfOutput and BertOutput,
    the `attention.output` and `output` modules)."""

    def __init__(self, in_features: int, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, hidden_size)
        self.LayerNorm = nn.LayerNorm(hidden_size, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    """Self-attention, then dense + LayerNorm with the residual (HF's `attention`: `self` and `output`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertAddNorm(config.num_heads * config.head_dim, config.hidden_size, config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        return self.output(self.self(hidden, metadata), hidden)


class BertIntermediate(nn.Module):
    """The MLP's first half: dense to intermediate_size, then GELU (exact, or its tanh approximation)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.approximate = "tanh" if config.hidden_act == "gelu_pytorch_tanh" else "none"

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(hidden), approximate=self.approximate)  # [T, intermediate_size]


class BertLayer(nn.Module):
    """Post-LN encoder layer: a = LN(x + attn(x)), then LN(a + mlp(a))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertAddNorm(config.intermediate_size, config.hidden_size, config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """hidden [T, hidden_size] → [T, hidden_size]."""
        attended = self.attention(hidden, metadata)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    """The layer stack (HF's `encoder.layer`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_layers))

    def forward(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        for layer in self.layer:
            hidden = layer(hidden, metadata)
        return hidden


class BertPooler(nn.Module):
    """tanh(dense(x)) of the [CLS] hidden state: the first half of BERT's classification head."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(cls_hidden))  # [N, hidden_size]


class BertModel(nn.Module):
    """Embeddings and the encoder; the pooler where a classification head reads it (HF's BertModel)."""

    def __init__(self, config: ModelConfig, add_pooling_layer: bool) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] → the last layer's hidden states [T, hidden_size]."""
        return self.encoder(self.embeddings(input_ids, positions, metadata), metadata)


def no_head_error(config: ModelConfig) -> InvalidParameterError:
    """The error for asking an embedding model (num_labels 0) for a score."""
    return InvalidParameterError(
        f"{config.name or config.architecture} has no classification head (num_labels=0): it embeds text and "
        f"cannot score a pair; use a cross-encoder (a *ForSequenceClassification model) for reranking",
        param="model",
    )


class BertForPooling(nn.Module):
    """BERT for embeddings and, with a classification head (config.num_labels > 0), for cross-encoder scores.

    The engine calls `forward` on a step's flattened prompts and pools the rows it returns; a cross-encoder's score
    is `score(hidden[first row of the request])`: the classifier applied to the pooler applied to the [CLS] token's
    hidden state, transformers' BertForSequenceClassification logits (dropout is off at inference).
    """

    fused_projections = FUSED_PROJECTIONS
    # The encoder's layers run in its own forward: no native decoder takes them (models/contract.py).
    layer_layout = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.bert = BertModel(config, add_pooling_layer=config.num_labels > 0)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels) if config.num_labels else None

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache | None, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions [num_tokens] int64, whole prompts one after another → the last layer's hidden states
        [num_tokens, hidden_size] in the parameters' dtype. kv_cache is ignored: an encoder keeps none."""
        return self.bert(input_ids, positions, metadata)

    @torch.inference_mode()
    def score(self, pooled: torch.Tensor) -> torch.Tensor:
        """pooled: [N, hidden_size], each request's [CLS] (first token) hidden state → [N, num_labels] float32
        logits."""
        if self.classifier is None or self.bert.pooler is None:
            raise no_head_error(self.config)
        return self.classifier(self.bert.pooler(pooled)).float()


class XLMRobertaClassificationHead(nn.Module):
    """out_proj(tanh(dense(x))) of the <s> hidden state (HF's `classifier` of XLMRobertaForSequenceClassification)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(cls_hidden)))  # [N, num_labels]


class XLMRobertaForPooling(nn.Module):
    """XLM-RoBERTa: BERT's encoder under the name `roberta`, positions from padding_idx + 1, no token types, and a
    classification head of its own (dense, tanh, out_proj) instead of BERT's pooler + classifier."""

    fused_projections = FUSED_PROJECTIONS
    # The encoder's layers run in its own forward: no native decoder takes them (models/contract.py).
    layer_layout = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.roberta = BertModel(config, add_pooling_layer=False)
        self.classifier = XLMRobertaClassificationHead(config) if config.num_labels else None

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache | None, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """As BertForPooling.forward: [num_tokens] ids and positions → [num_tokens, hidden_size]."""
        return self.roberta(input_ids, positions, metadata)

    @torch.inference_mode()
    def score(self, pooled: torch.Tensor) -> torch.Tensor:
        """pooled: [N, hidden_size], each request's <s> (first token) hidden state → [N, num_labels] float32."""
        if self.classifier is None:
            raise no_head_error(self.config)
        return self.classifier(pooled).float()
