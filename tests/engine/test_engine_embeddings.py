"""Embeddings and reranking through the engine (PoolingParams): against transformers, and exact under the defaults.

References: transformers' final hidden states on the same weights (the embedded model dequantized, and a tiny random
Qwen3 saved as a sentence-transformers folder that asks for last-token pooling, as Qwen3-Embedding does), pooled
and normalized as sentence-transformers does: cosine >= 0.9999. A yes/no rerank score equals the one computed from
the engine's own prompt logprobs of "yes" and "no". With the default settings, an input embedded in a batch, next
to generating requests, equals the same input embedded alone, bit for bit; pooling requests leave no block behind
and do not change what a generation that follows them produces.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from tokenriver.engine.llm import LLM
from tokenriver.engine.rerank import rerank_inputs
from tokenriver.errors import ContextLengthError, InvalidParameterError
from tokenriver.params import PoolingParams, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))
from arch_reference import random_ids, widen, write_byte_tokenizer  # noqa: E402

TEXTS = [
    "The cat sat on the mat.",
    "A dog barked at the mailman all morning long, and nobody came to see why.",
    "Paris is the capital of France.",
    "Paged attention keeps the KV cache in fixed-size blocks.",
]


def cosine(a: list[float], b: list[float]) -> float:
    return torch.nn.functional.cosine_similarity(torch.tensor(a), torch.tensor(b), dim=0).item()


@pytest.fixture(scope="module")
def llm(loaded_default) -> LLM:
    return LLM.from_loaded(loaded_default, max_num_batched_tokens=256)


def embed(llm: LLM, prompts: list, params: PoolingParams | None = None) -> list[list[float]]:
    return [output.embedding for output in llm.embed(prompts, params, use_tqdm=False)]


# ----- against transformers --------------------------------------------------------------------------


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embedded_model_matches_transformers(loaded_float32, hf_reference, pooling):
    model, tokenizer = hf_reference
    ours = embed(LLM.from_loaded(loaded_float32), TEXTS, PoolingParams(pooling=pooling))
    for text, got in zip(TEXTS, ours):
        ids = LLM.from_loaded(loaded_float32).get_tokenizer().encode(text)
        with torch.no_grad():
            hidden = model.model(torch.tensor([ids])).last_hidden_state[0]  # [T, hidden]
        want = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
        want = torch.nn.functional.normalize(want, dim=0).tolist()
        assert cosine(got, want) >= 0.9999, cosine(got, want)
        assert math.isclose(sum(x * x for x in got), 1.0, rel_tol=1e-5)


@pytest.fixture(scope="module")
def qwen3_embedding_folder(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A tiny random Qwen3 saved as a sentence-transformers folder: last-token pooling, then Normalize."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(
        vocab_size=257,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    reference = widen(transformers.Qwen3Model(config), seed=5)
    folder = tmp_path_factory.mktemp("qwen3_embedding")
    transformers.Qwen3ForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    causal = transformers.Qwen3ForCausalLM.from_pretrained(folder)
    causal.model.load_state_dict(reference.state_dict())
    causal.save_pretrained(folder, safe_serialization=True)
    write_byte_tokenizer(folder)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, "pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False})
    )
    return folder, reference


def test_qwen3_embedding_folder_matches_transformers(qwen3_embedding_folder):
    folder, reference = qwen3_embedding_folder
    # The float weights as stored, and a float32 KV pool: transformers' numbers (the defaults' int8 KV pool is
    # within 2e-4 of them).
    llm = LLM(str(folder), quantization="none")
    assert llm.engine.loaded.config.pooling == "last"
    prompts = [random_ids(n, 256, seed=n) for n in (5, 17, 40)]
    ours = embed(llm, [{"prompt_token_ids": ids} for ids in prompts])
    short = embed(llm, [{"prompt_token_ids": ids} for ids in prompts], PoolingParams(dimensions=16))
    for ids, got, got_short in zip(prompts, ours, short):
        with torch.no_grad():
            last = reference(torch.tensor([ids])).last_hidden_state[0, -1]  # [hidden]
        want = torch.nn.functional.normalize(last, dim=0).tolist()
        assert cosine(got, want) >= 0.9999, cosine(got, want)
        # Matryoshka: the first 16 values, normalized again.
        want_short = torch.nn.functional.normalize(last[:16], dim=0).tolist()
        assert len(got_short) == 16 and cosine(got_short, want_short) >= 0.9999


def test_yes_no_score_is_the_judges_own_probability(llm):
    query, documents = "What is the capital of France?", TEXTS
    inputs, params = rerank_inputs(llm.get_tokenizer(), True, query, documents)
    no_id, yes_id = params.score_token_ids
    results = llm.rerank(query, documents, use_tqdm=False)
    scores = {r.index: r.relevance_score for r in results}
    for index, ids in enumerate(inputs):
        logprob = {}
        for answer in (no_id, yes_id):
            (output,) = llm.generate(
                [{"prompt_token_ids": ids + [answer]}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
            )
            logprob[answer] = output.prompt_logprobs[-1][answer].logprob
        want = math.exp(logprob[yes_id]) / (math.exp(logprob[yes_id]) + math.exp(logprob[no_id]))
        assert math.isclose(scores[index], want, abs_tol=1e-5), (scores[index], want)


# ----- exact under the defaults --------------------------------------------------------------------------


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_batched_equals_alone(llm, pooling):
    params = PoolingParams(pooling=pooling)
    together = embed(llm, TEXTS, params)
    alone = [embed(llm, [text], params)[0] for text in TEXTS]
    assert together == alone


def test_embeddings_next_to_generation(llm):
    """Pooling requests batched with generating ones: both give what they give alone, and nothing is left held."""
    engine = llm.engine
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want_text = llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0].token_ids
    want_vectors = [embed(llm, [text])[0] for text in TEXTS]
    llm.reset_prefix_cache()
    tokenizer = llm.get_tokenizer()
    engine.add_request("gen", tokenizer.encode("Once upon a time"), params)
    engine.step()
    for index, text in enumerate(TEXTS):
        engine.add_request(f"embed-{index}", tokenizer.encode(text), PoolingParams())
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert finished["gen"].outputs[0].token_ids == want_text
    assert [finished[f"embed-{i}"].embedding for i in range(len(TEXTS))] == want_vectors
    assert engine.block_manager.num_used_blocks == 0


def test_an_embedded_prompt_does_not_feed_the_prefix_cache(llm):
    prompt = " ".join(TEXTS)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm.reset_prefix_cache()
    cold = llm.generate([prompt], params, use_tqdm=False)[0]
    llm.reset_prefix_cache()
    embed(llm, [prompt])
    after = llm.generate([prompt], params, use_tqdm=False)[0]
    assert after.num_cached_tokens == 0
    assert after.outputs[0].token_ids == cold.outputs[0].token_ids


def test_rerank_batched_equals_alone(llm):
    query = "Which sentence is about cats?"
    together = {r.index: r.relevance_score for r in llm.rerank(query, TEXTS, use_tqdm=False)}
    alone = {i: llm.rerank(query, [text], use_tqdm=False)[0].relevance_score for i, text in enumerate(TEXTS)}
    assert together == alone
    best_two = llm.rerank(query, TEXTS, top_n=2, use_tqdm=False)
    assert [r.index for r in best_two] == sorted(together, key=lambda i: -together[i])[:2]


def test_the_engine_pooling_overrides_the_file_and_a_request_overrides_both(loaded_default):
    mean_engine = LLM.from_loaded(loaded_default, pooling="mean")
    default_engine = LLM.from_loaded(loaded_default)
    assert embed(mean_engine, TEXTS[:1]) == embed(default_engine, TEXTS[:1], PoolingParams(pooling="mean"))
    assert embed(mean_engine, TEXTS[:1], PoolingParams(pooling="last")) == embed(default_engine, TEXTS[:1])
    with pytest.raises(InvalidParameterError, match="pooling"):
        LLM.from_loaded(loaded_default, pooling="max")


# ----- limits ------------------------------------------------------------------------------------------------


def test_limits_are_clear_errors(llm):
    with pytest.raises(ContextLengthError, match="max_num_batched_tokens"):
        llm.embed([{"prompt_token_ids": [1] * 300}], use_tqdm=False)
    with pytest.raises(InvalidParameterError, match="dimensions"):
        llm.embed(["hi"], PoolingParams(dimensions=10_000), use_tqdm=False)
    with pytest.raises(InvalidParameterError, match="score_token_ids"):
        llm.generate(["hi"], PoolingParams(task="score"), use_tqdm=False)
    with pytest.raises(InvalidParameterError, match="pooling"):
        PoolingParams(pooling="max")
    assert llm.engine.block_manager.num_used_blocks == 0
    assert not llm.engine.has_unfinished_requests()
