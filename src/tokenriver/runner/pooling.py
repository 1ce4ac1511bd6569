"""A pooling request's final hidden states → its embedding or its relevance score.

The rules are sentence-transformers' and the rerankers' own:

1. pooling picks the rows that make the vector: "last" the last token (a causal model has read the whole input
   only there), "mean" the average over every token, "cls" the first token (an encoder's [CLS]);
2. `dimensions` keeps the vector's first values (Matryoshka models are trained so that a prefix is an
   embedding too), and only then is it normalized to unit length;
3. a score comes from the model's classification head on the first token (a cross-encoder: sigmoid of its one
   logit, or the probability of label 1 of two), or, on a causal model, from the output layer at the last
   token: P(yes) / (P(yes) + P(no)), Qwen3-Reranker's rule.

Each request's rows are pooled on their own, with the same operations whatever else ran in the step, so a
request's vector does not depend on its batch.
"""

from __future__ import annotations

import torch

from tokenriver.models.contract import CausalLM, PoolingModel
from tokenriver.params import PoolingParams


def pool(model: CausalLM | PoolingModel, hidden: torch.Tensor, params: PoolingParams) -> list[float]:
    """hidden: [num_tokens, hidden_size], one request's whole prompt → its embedding, or [score]."""
    if params.task == "score":
        return [relevance_score(model, hidden, params)]
    if params.pooling == "mean":
        vector = hidden.float().mean(dim=0)  # [hidden_size]
    elif params.pooling == "cls":
        vector = hidden[0].float()
    else:
        vector = hidden[-1].float()
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.tolist()


def relevance_score(model: CausalLM | PoolingModel, hidden: torch.Tensor, params: PoolingParams) -> float:
    """A (query, document) prompt's relevance in [0, 1] (rule 3 of the module docstring)."""
    if params.score_token_ids is not None:
        no_id, yes_id = params.score_token_ids
        logits = model.compute_logits(hidden[-1:])[0]  # [vocab]
        pair = logits[[no_id, yes_id]].float()  # [2]: no, yes
        return torch.softmax(pair, dim=0)[1].item()
    logits = model.score(hidden[:1])[0].float()  # [num_labels]
    if logits.numel() == 1:
        return torch.sigmoid(logits[0]).item()
    return torch.softmax(logits, dim=0)[1].item()
