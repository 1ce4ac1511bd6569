"""The encoders (models/bert.py: BERT, XLM-RoBERTa; models/nomic_bert.py) against transformers on tiny random models
saved as Hugging Face folders, and GGUF files written from them as llama.cpp's converter writes encoders.

float32, no quantization: every token's last hidden state within 1e-4 relative error, mean- and [CLS]-pooled vectors
at cosine >= 0.9999, a cross-encoder's score equal to transformers' logits; inputs are the tokenizer's pair
encodings (token types derived from [SEP] must be the tokenizer's). Several requests in one step give each request's
rows as it alone gets them: bit for bit with quantized weights (the engine's default numerics: every product
computes a row alone), within rounding with float32 weights, whose library GEMM may round a row differently in
another batch shape.
"""

from __future__ import annotations

import dataclasses
import json

import gguf
import pytest
import torch
from encoder_reference import (
    CLS_ID,
    ENCODER_SIZES,
    SEP_ID,
    cosine,
    encoder_metadata,
    pair_token_types,
    random_pair,
    row_relative_error,
    run_encoder,
    save_folder,
    widen,
    write_encoder_gguf,
    write_wordpiece_tokenizer,
)

from tokenriver.errors import InvalidParameterError, ModelLoadError
from tokenriver.loader.assemble import build_model
from tokenriver.loader.gguf import read_gguf
from tokenriver.loader.load import load_model
from tokenriver.loader.safetensors import read_hf_config, read_hf_folder
from tokenriver.loader.tokenizer_files import tokenizer_from_folder, tokenizer_from_gguf_fields
from tokenriver.models.bert import derive_token_types
from tokenriver.models.config import ModelConfig
from tokenriver.models.quant import QuantizedEmbedding

transformers = pytest.importorskip("transformers")

QUERY, DOCUMENT = "What is a quick cat?", "The lazy dog jumps over the brown foxes!"


def load_folder(folder, quantization: str = "none") -> torch.nn.Module:
    checkpoint = read_hf_folder(str(folder))
    return build_model(checkpoint.config, checkpoint.weights, "cpu", str(folder), quantization)


def reference_hidden(reference: torch.nn.Module, ids: list[int], token_types: list[int] | None) -> torch.Tensor:
    """transformers' last_hidden_state [n, hidden] of one unpadded input."""
    with torch.no_grad():
        out = reference(
            torch.tensor([ids]),
            token_type_ids=None if token_types is None else torch.tensor([token_types]),
            output_hidden_states=True,
        )
    return out.hidden_states[-1][0]


def reference_logits(reference: torch.nn.Module, ids: list[int], token_types: list[int] | None) -> torch.Tensor:
    with torch.no_grad():
        types = None if token_types is None else torch.tensor([token_types])
        return reference(torch.tensor([ids]), token_type_ids=types).logits[0]


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """Every token within 1e-4 relative error; mean- and CLS-pooled vectors at cosine >= 0.9999."""
    assert row_relative_error(got, want) < 1e-4, row_relative_error(got, want)
    assert cosine(got.mean(0), want.mean(0)) >= 0.9999
    assert cosine(got[0], want[0]) >= 0.9999


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    reference = widen(transformers.BertModel(transformers.BertConfig(**ENCODER_SIZES)), seed=1)
    folder = save_folder(reference, tmp_path_factory.mktemp("bert"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    return reference, folder, load_folder(folder), tokenizer


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    config = transformers.BertConfig(**ENCODER_SIZES, num_labels=1)
    reference = widen(transformers.BertForSequenceClassification(config), seed=2)
    folder = save_folder(reference, tmp_path_factory.mktemp("bert_cross_encoder"))
    return reference, folder, load_folder(folder)


def test_bert_config(bert, cross_encoder):
    config = bert[2].config
    assert (config.architecture, config.is_causal, config.num_labels) == ("bert", False, 0)
    assert (config.type_vocab_size, config.sep_token_id, config.position_offset) == (2, SEP_ID, 0)
    assert config.pooling is None and config.normalize is None  # no sentence-transformers files
    assert cross_encoder[2].config.num_labels == 1
    assert not hasattr(bert[2], "compute_logits")


def test_the_tokenizer_adds_cls_and_sep_and_encodes_pairs_as_transformers(bert):
    _, folder, _, reference_tokenizer = bert
    tokenizer = load_model(str(folder)).tokenizer
    assert tokenizer.encode(QUERY) == reference_tokenizer(QUERY)["input_ids"]
    assert tokenizer.encode(QUERY)[0] == CLS_ID and tokenizer.encode(QUERY)[-1] == SEP_ID
    pair = reference_tokenizer(QUERY, DOCUMENT)
    assert tokenizer.encode_pair(QUERY, DOCUMENT) == pair["input_ids"]
    # The token types the model derives from [SEP] are the ones the tokenizer gives the pair.
    ids = torch.tensor(pair["input_ids"])
    assert derive_token_types(ids, encoder_metadata([len(ids)]), SEP_ID).tolist() == pair["token_type_ids"]
    assert 1 in pair["token_type_ids"]


@pytest.mark.parametrize("texts", [(QUERY,), (QUERY, DOCUMENT)], ids=["single", "pair"])
def test_bert_hidden_states_match_transformers(bert, texts):
    reference, _, ours, tokenizer = bert
    encoded = tokenizer(*texts)
    (got,) = run_encoder(ours, [encoded["input_ids"]])
    assert_matches(got, reference_hidden(reference, encoded["input_ids"], encoded["token_type_ids"]))


def test_bert_long_random_pair_matches_transformers(bert):
    reference, _, ours, _ = bert
    ids = random_pair(64, seed=5)  # the whole position table
    (got,) = run_encoder(ours, [ids])
    assert_matches(got, reference_hidden(reference, ids, pair_token_types(ids)))


def test_without_derived_token_types_the_pair_would_differ(bert):
    """The check above can fail: the same pair with every token of type 0 gives other hidden states."""
    reference, _, ours, _ = bert
    ids = random_pair(30, seed=6)
    (got,) = run_encoder(ours, [ids])
    assert row_relative_error(got, reference_hidden(reference, ids, [0] * len(ids))) > 1e-2


def test_cross_encoder_score_matches_transformers_logits(cross_encoder):
    reference, _, ours = cross_encoder
    pairs = [random_pair(n, seed=n) for n in (9, 25, 40)]
    rows = run_encoder(ours, pairs)
    scores = ours.score(torch.stack([row[0] for row in rows]))  # each request's [CLS] hidden state
    assert scores.shape == (3, 1) and scores.dtype == torch.float32
    want = torch.stack([reference_logits(reference, ids, pair_token_types(ids)) for ids in pairs])
    assert torch.allclose(scores, want, rtol=1e-4, atol=1e-5), (scores, want)
    assert scores.std() > 0.05  # the three pairs score differently: the check would see a wrong head


def test_an_embedding_model_has_no_score(bert):
    with pytest.raises(InvalidParameterError, match="no classification head"):
        bert[2].score(torch.zeros(1, ENCODER_SIZES["hidden_size"]))


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_a_batch_does_not_change_a_request(cross_encoder, quantization):
    _, folder, float_model = cross_encoder
    model = float_model if quantization == "none" else load_folder(folder, quantization)
    requests = [random_pair(n, seed=10 + n) for n in (5, 4, 37, 64, 12)]
    alone = [run_encoder(model, [ids])[0] for ids in requests]
    together = run_encoder(model, requests)
    for got, want in zip(together, alone):
        if quantization == "int8":
            assert torch.equal(got, want)
        else:
            assert torch.allclose(got, want, rtol=0, atol=1e-5), (got - want).abs().max()


def test_int8_keeps_the_embedding_tables_float_and_stays_close(cross_encoder):
    _, folder, float_model = cross_encoder
    model = load_folder(folder, "int8")
    assert isinstance(model.bert.embeddings.position_embeddings, torch.nn.Embedding)
    ids = random_pair(30, seed=7)
    (got,), (want,) = run_encoder(model, [ids]), run_encoder(float_model, [ids])
    assert cosine(got.mean(0), want.mean(0)) > 0.99


# ----- GGUF -------------------------------------------------------------------------------------------------------


def test_a_bert_gguf_loads_and_matches_the_folder(bert, tmp_path):
    _, folder, ours, tokenizer = bert
    path = tmp_path / "bert.gguf"
    write_encoder_gguf(folder, path, "bert", pooling_type=1)
    checkpoint = read_gguf(str(path))
    config = checkpoint.config
    assert (config.architecture, config.is_causal, config.pooling, config.sep_token_id) == ("bert", False, "mean", 3)
    assert (config.type_vocab_size, config.num_labels, config.max_position_embeddings) == (2, 0, 64)
    model = build_model(config, checkpoint.weights, "cpu", str(path), "none")
    ids = tokenizer(QUERY, DOCUMENT)["input_ids"]
    (got,), (want,) = run_encoder(model, [ids]), run_encoder(ours, [ids])
    assert torch.equal(got, want)
    # The vocabulary llama.cpp respelled is BERT's WordPiece again.
    rebuilt = tokenizer_from_gguf_fields(checkpoint.tokenizer_fields)
    assert rebuilt.encode(DOCUMENT) == tokenizer(DOCUMENT)["input_ids"]
    assert rebuilt.encode_pair(QUERY, DOCUMENT) == ids


def test_a_q8_0_bert_gguf_keeps_its_word_embeddings_packed(bert, tmp_path):
    _, folder, ours, tokenizer = bert
    path = tmp_path / "bert-q8_0.gguf"
    write_encoder_gguf(folder, path, "bert", pooling_type=2, quantize=gguf.GGMLQuantizationType.Q8_0)
    loaded = load_model(str(path))
    assert loaded.config.pooling == "cls" and loaded.config.is_causal is False
    assert isinstance(loaded.model.bert.embeddings.word_embeddings, QuantizedEmbedding)
    ids = loaded.tokenizer.encode_pair(QUERY, DOCUMENT)
    assert ids == tokenizer(QUERY, DOCUMENT)["input_ids"]
    (got,), (want,) = run_encoder(loaded.model, [ids]), run_encoder(ours, [ids])
    assert cosine(got[0], want[0]) > 0.999 and cosine(got.mean(0), want.mean(0)) > 0.999


def test_a_gguf_reranker_head_without_its_dense_layer_is_refused(cross_encoder, tmp_path):
    """llama.cpp's converter leaves out BERT's pooler: the scores could not be the model's."""
    _, folder, _ = cross_encoder
    path = tmp_path / "reranker.gguf"
    write_encoder_gguf(folder, path, "bert", pooling_type=4)
    with pytest.raises(ModelLoadError, match="no dense layer"):
        read_gguf(str(path))


def test_a_bert_gguf_reranker_with_its_pooler_scores_as_the_folder(cross_encoder, tmp_path):
    reference, folder, ours = cross_encoder
    path = tmp_path / "reranker.gguf"
    write_encoder_gguf(folder, path, "bert", pooling_type=4, keep_pooler=True)
    checkpoint = read_gguf(str(path))
    assert (checkpoint.config.pooling, checkpoint.config.num_labels) == ("cls", 1)
    model = build_model(checkpoint.config, checkpoint.weights, "cpu", str(path), "none")
    ids = random_pair(20, seed=3)
    (hidden,) = run_encoder(model, [ids])
    want = reference_logits(reference, ids, pair_token_types(ids))
    assert torch.allclose(model.score(hidden[:1])[0], want, rtol=1e-4, atol=1e-5)


# ----- nomic-bert -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nomic(tmp_path_factory):
    reference = widen(transformers.NomicBertModel(transformers.NomicBertConfig(**ENCODER_SIZES)), seed=4)
    folder = save_folder(reference, tmp_path_factory.mktemp("nomic"))
    return reference, folder, load_folder(folder)


def test_nomic_bert_matches_transformers(nomic):
    reference, _, ours = nomic
    assert (ours.config.architecture, ours.config.rope_theta, ours.config.hidden_act) == ("nomic-bert", 1000.0, "silu")
    for ids in (random_pair(11, seed=1), random_pair(64, seed=2)):
        (got,) = run_encoder(ours, [ids])
        assert_matches(got, reference_hidden(reference, ids, pair_token_types(ids)))


def test_nomic_bert_gguf_matches_the_folder(nomic, tmp_path):
    _, folder, ours = nomic
    path = tmp_path / "nomic.gguf"
    write_encoder_gguf(folder, path, "nomic-bert", pooling_type=1)
    checkpoint = read_gguf(str(path))
    assert (checkpoint.config.architecture, checkpoint.config.rope_theta) == ("nomic-bert", 1000.0)
    model = build_model(checkpoint.config, checkpoint.weights, "cpu", str(path), "none")
    requests = [random_pair(n, seed=n) for n in (7, 33)]
    for got, want in zip(run_encoder(model, requests), run_encoder(ours, requests)):
        assert torch.allclose(got, want, rtol=0, atol=1e-5)


def test_nomic_bert_batch_is_exact_with_int8(nomic):
    model = load_folder(nomic[1], "int8")
    requests = [random_pair(n, seed=20 + n) for n in (4, 50, 9)]
    alone = [run_encoder(model, [ids])[0] for ids in requests]
    for got, want in zip(run_encoder(model, requests), alone):
        assert torch.equal(got, want)


# ----- XLM-RoBERTa ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def xlm_roberta(tmp_path_factory):
    # Real XLM-R checkpoints have one token type; the position table holds padding_idx + 1 unused rows.
    sizes = ENCODER_SIZES | {"max_position_embeddings": ENCODER_SIZES["max_position_embeddings"] + 2}
    config = transformers.XLMRobertaConfig(**sizes, type_vocab_size=1, num_labels=1, pad_token_id=1)
    reference = widen(transformers.XLMRobertaForSequenceClassification(config), seed=8)
    folder = save_folder(reference, tmp_path_factory.mktemp("xlmr"), with_tokenizer=False)
    bare = widen(transformers.XLMRobertaModel(config), seed=9)
    bare_folder = save_folder(bare, tmp_path_factory.mktemp("xlmr_bare"), with_tokenizer=False)
    return reference, folder, load_folder(folder), bare, load_folder(bare_folder)


def test_xlm_roberta_matches_transformers(xlm_roberta):
    reference, _, ours, bare, bare_ours = xlm_roberta
    config = ours.config
    assert (config.architecture, config.position_offset, config.max_position_embeddings) == ("xlm-roberta", 2, 64)
    assert config.sep_token_id is None and bare_ours.config.num_labels == 0
    pairs = [random_pair(n, seed=30 + n) for n in (8, 64)]
    rows = run_encoder(ours, pairs)
    for ids, got in zip(pairs, rows):
        assert_matches(got, reference_hidden(reference, ids, None))
    scores = ours.score(torch.stack([row[0] for row in rows]))
    want = torch.stack([reference_logits(reference, ids, None) for ids in pairs])
    assert torch.allclose(scores, want, rtol=1e-4, atol=1e-5)
    (got,) = run_encoder(bare_ours, [pairs[0]])
    assert_matches(got, reference_hidden(bare, pairs[0], None))


def test_an_xlm_roberta_reranker_gguf_scores_as_transformers(xlm_roberta, tmp_path):
    """llama.cpp converts XLM-RoBERTa as "bert", its position table cut to the rows used."""
    reference, folder, _, _, _ = xlm_roberta
    path = tmp_path / "xlmr-reranker.gguf"
    write_encoder_gguf(folder, path, "bert", pooling_type=4, position_offset=2)
    checkpoint = read_gguf(str(path))
    assert (checkpoint.config.type_vocab_size, checkpoint.config.max_position_embeddings) == (1, 64)
    model = build_model(checkpoint.config, checkpoint.weights, "cpu", str(path), "none")
    ids = random_pair(40, seed=11)
    (hidden,) = run_encoder(model, [ids])
    assert_matches(hidden, reference_hidden(reference, ids, None))
    assert torch.allclose(model.score(hidden[:1])[0], reference_logits(reference, ids, None), rtol=1e-4, atol=1e-5)


def test_nomic_bert_reads_nomics_own_config_names(nomic, tmp_path):
    """nomic-embed-text's config.json as nomic's code wrote it: GPT-2's size names, the rotary base, "swiglu"."""
    _, folder, ours = nomic
    raw = json.loads((folder / "config.json").read_text())
    own = {
        "architectures": ["NomicBertModel"],
        "model_type": "nomic_bert",
        "vocab_size": raw["vocab_size"],
        "n_embd": raw["hidden_size"],
        "n_head": raw["num_attention_heads"],
        "n_layer": raw["num_hidden_layers"],
        "n_inner": raw["intermediate_size"],
        "n_positions": raw["max_position_embeddings"],
        "layer_norm_epsilon": raw["layer_norm_eps"],
        "rotary_emb_base": 1000,
        "rotary_emb_fraction": 1.0,
        "rotary_emb_interleaved": False,
        "activation_function": "swiglu",
        "prenorm": False,
        "qkv_proj_bias": False,
        "type_vocab_size": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(own))
    write_wordpiece_tokenizer(tmp_path)
    assert dataclasses.replace(read_hf_config(str(tmp_path)), name="") == dataclasses.replace(ours.config, name="")
    (tmp_path / "config.json").write_text(json.dumps(own | {"rotary_emb_fraction": 0.5}))
    with pytest.raises(ModelLoadError, match="rotary_emb_fraction=0.5 is not supported"):
        read_hf_config(str(tmp_path))


def test_an_xlm_roberta_tokenizer_encodes_pairs_as_transformers(tmp_path):
    """encode_pair follows the folder's post-processor: RoBERTa joins a pair as "<s> A </s></s> B </s>"."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    pieces = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [(f"\u2581{word}", -1.0) for word in ("what", "is", "a", "cat", "the", "dog")]
    pieces += [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz?!"]
    tokenizer = Tokenizer(models.Unigram(pieces, unk_id=3))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    tokenizer.add_special_tokens(["<s>", "<pad>", "</s>", "<unk>"])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    ids = tokenizer_from_folder(str(tmp_path)).encode_pair("what is a cat?", "the dog!")
    assert ids == reference("what is a cat?", "the dog!")["input_ids"]
    assert ids[0] == 0 and ids[-1] == 2 and [2, 2] == ids[ids.index(2) : ids.index(2) + 2]


def test_the_config_refuses_an_unknown_pooling_and_a_causal_classifier():
    sizes = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=4)
    with pytest.raises(ModelLoadError, match="pooling='max' is not supported"):
        ModelConfig(architecture="bert", **sizes, head_dim=16, is_causal=False, pooling="max")
    with pytest.raises(ModelLoadError, match="a classification head needs an encoder"):
        ModelConfig(architecture="llama", **sizes, head_dim=16, num_labels=2)
