"""A query and its documents → one scoring input per document, in the form the model was trained to judge.

Two kinds of model rerank, and each reads its pair its own way:

- a cross-encoder (an encoder with a classification head: BERT, XLM-RoBERTa) reads `[CLS] query [SEP] document
  [SEP]`, the tokenizer's pair encoding, and its head gives the score;
- a causal model reads an instruction, the query and the document through its chat template and answers "yes" or
  "no": the score is P(yes) / (P(yes) + P(no)) at the answer's position. This is Qwen3-Reranker's prompt, word for
  word, with the thinking block closed (its template's `enable_thinking=False`); any instruction-tuned model can
  judge the same way, less well than one trained for it.

Shared by LLM.rerank and the server's /v1/rerank, so both score a pair from the same token ids.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenriver.errors import InvalidParameterError
from tokenriver.params import PoolingParams
from tokenriver.tokenizer.tokenizer import Tokenizer

JUDGE_SYSTEM_PROMPT = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct provided. "
    'Note that the answer can only be "yes" or "no".'
)
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


@dataclass(frozen=True)
class RerankResult:
    """One document's place in a reranking, best first."""

    # The document's position in the list given.
    index: int
    # Its relevance in [0, 1].
    relevance_score: float
    document: str


def rerank_inputs(
    tokenizer: Tokenizer, is_causal: bool, query: str, documents: list[str], instruction: str | None = None
) -> tuple[list[list[int]], PoolingParams]:
    """Each document's scoring input (token ids), and the params that score them all."""
    if not is_causal:
        return [tokenizer.encode_pair(query, document) for document in documents], PoolingParams(task="score")
    judge = PoolingParams(task="score", score_token_ids=(_one_token(tokenizer, "no"), _one_token(tokenizer, "yes")))
    instruction = instruction or DEFAULT_INSTRUCTION
    inputs = []
    for document in documents:
        question = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
        inputs.append(tokenizer.encode(_judge_prompt(tokenizer, question), add_special_tokens=False))
    return inputs, judge


def check_top_n(top_n: object) -> None:
    """top_n, how many of the best documents to return: an integer >= 1, or None for all of them."""
    if top_n is not None and (not isinstance(top_n, int) or top_n < 1):
        raise InvalidParameterError(f"top_n={top_n!r} must be an integer >= 1", param="top_n")


def ranked(documents: list[str], scores: list[float], top_n: int | None) -> list[RerankResult]:
    """The documents best first (ties keep their order), at most top_n of them."""
    order = sorted(range(len(documents)), key=lambda i: -scores[i])
    return [RerankResult(i, scores[i], documents[i]) for i in order[: top_n if top_n is not None else None]]


def _judge_prompt(tokenizer: Tokenizer, question: str) -> str:
    if tokenizer.chat_template is None:
        return f"{JUDGE_SYSTEM_PROMPT}\n\n{question}\n\nAnswer: "
    messages = [{"role": "system", "content": JUDGE_SYSTEM_PROMPT}, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False)


def _one_token(tokenizer: Tokenizer, word: str) -> int:
    token_ids = tokenizer.encode(word, add_special_tokens=False)
    if len(token_ids) != 1:
        raise InvalidParameterError(
            f"this model's vocabulary writes {word!r} as {len(token_ids)} tokens, so it cannot answer yes or no "
            f"in one token; rerank with a cross-encoder or a model whose vocabulary has the word",
            param="model",
        )
    return token_ids[0]
