"""Encoders (BERT) through the whole engine: LLM.embed and LLM.rerank against transformers, exact under the defaults.

References: a tiny random BERT saved as a sentence-transformers folder (mean pooling, Normalize), embedded as
sentence-transformers computes it (transformers' last hidden state, masked mean, unit length), cosine >= 0.9999;
a tiny random BertForSequenceClassification reranks with sigmoid(its logit) for each (query, document) pair, as
sentence-transformers' CrossEncoder scores it. A Q8_0 GGUF of the same encoder, on the default settings: inputs
embedded together equal the same inputs embedded one by one, bit for bit. An encoder cannot generate, and says so.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gguf
import pytest
import torch

from tokenriver.engine.llm import LLM
from tokenriver.errors import ContextLengthError, InvalidParameterError
from tokenriver.params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))
from encoder_reference import ENCODER_SIZES, save_folder, widen, write_encoder_gguf  # noqa: E402

transformers = pytest.importorskip("transformers")

TEXTS = ["the quick brown fox", "what is the lazy dog?", "a cat is jumping over the dog.", "fox!"]
QUERY = "what is the fox?"


def st_folder(folder: Path, pooling: str) -> None:
    """Make a saved encoder folder a sentence-transformers model: Transformer, Pooling(pooling), Normalize."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    config = {"word_embedding_dimension": ENCODER_SIZES["hidden_size"], f"pooling_mode_{pooling}": True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    reference = widen(transformers.BertModel(transformers.BertConfig(**ENCODER_SIZES)), seed=11)
    folder = save_folder(reference, tmp_path_factory.mktemp("bert_embedder"))
    st_folder(folder, "mean_tokens")
    return reference, folder, transformers.AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    config = transformers.BertConfig(**ENCODER_SIZES, num_labels=1)
    reference = widen(transformers.BertForSequenceClassification(config), seed=12)
    folder = save_folder(reference, tmp_path_factory.mktemp("bert_reranker"))
    return reference, folder, transformers.AutoTokenizer.from_pretrained(str(folder))


def test_embed_matches_sentence_transformers_pooling(embedder):
    reference, folder, tokenizer = embedder
    llm = LLM(str(folder))
    assert llm.engine.loaded.config.pooling == "mean"
    for text, output in zip(TEXTS, llm.embed(TEXTS, use_tqdm=False)):
        encoded = tokenizer(text, return_tensors="pt")
        assert output.prompt_token_ids == encoded["input_ids"][0].tolist()
        with torch.no_grad():
            hidden = reference(**encoded).last_hidden_state[0]  # [T, hidden]
        want = torch.nn.functional.normalize(hidden.mean(dim=0), dim=0)
        got = torch.tensor(output.embedding)
        assert torch.nn.functional.cosine_similarity(got, want, dim=0).item() >= 0.9999


def test_rerank_matches_the_cross_encoders_sigmoid(reranker):
    reference, folder, tokenizer = reranker
    results = LLM(str(folder)).rerank(QUERY, TEXTS, use_tqdm=False)
    assert sorted(r.index for r in results) == list(range(len(TEXTS)))
    for result in results:
        with torch.no_grad():
            logit = reference(**tokenizer(QUERY, TEXTS[result.index], return_tensors="pt")).logits[0, 0]
        assert abs(result.relevance_score - torch.sigmoid(logit).item()) < 1e-5
    scores = [r.relevance_score for r in results]
    assert scores == sorted(scores, reverse=True)


@pytest.fixture(scope="module")
def packed(embedder, tmp_path_factory) -> LLM:
    """The embedder as a Q8_0 GGUF (mean pooling in its header), on the default settings."""
    _, folder, _ = embedder
    path = tmp_path_factory.mktemp("bert_gguf") / "bert-q8_0.gguf"
    write_encoder_gguf(folder, path, "bert", pooling_type=1, quantize=gguf.GGMLQuantizationType.Q8_0)
    return LLM(str(path), max_num_batched_tokens=32)


def test_defaults_embed_a_batch_as_each_alone(packed):
    together = [output.embedding for output in packed.embed(TEXTS, use_tqdm=False)]
    alone = [packed.embed([text], use_tqdm=False)[0].embedding for text in TEXTS]
    assert together == alone
    assert packed.engine.block_manager.num_used_blocks == 0


def test_an_encoder_refuses_to_generate_and_long_inputs(packed):
    with pytest.raises(InvalidParameterError, match="encoder"):
        packed.generate(["the fox"], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ContextLengthError, match="context holds 64 tokens"):
        packed.embed([{"prompt_token_ids": [5] * 65}], use_tqdm=False)
    with pytest.raises(ContextLengthError, match="max_num_batched_tokens"):
        packed.embed([{"prompt_token_ids": [5] * 40}], use_tqdm=False)
    # An encoder keeps no K/V: its pool holds one step's slots, not the default memory's worth.
    info = packed.engine.model_info
    assert info.num_kv_blocks * info.block_size <= info.max_num_batched_tokens + info.max_num_seqs * info.block_size
