"""A "llama" (SentencePiece BPE, byte fallback) GGUF vocabulary against sentencepiece itself.

The fields come from a small model trained by the `spm_model` fixture: pieces with "▁", `<0xNN>` byte tokens,
scores and no merges, so the merges are derived from the scores as for a real llama GGUF.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from tokenriver.loader import tokenizer_files
from tokenriver.loader.tokenizer_files import tokenizer_from_gguf_fields
from tokenriver.tokenizer.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  two leading spaces",
    "trailing  ",
    "café über",
    "x\ty\nz",
    "12345",
    "☃ snowman 日本 😀",
]


@pytest.fixture(scope="module")
def spm_tokenizer(spm_model) -> Tokenizer:
    return tokenizer_from_gguf_fields(spm_model[1])


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_sentencepiece(spm_model, spm_tokenizer, text):
    processor, _ = spm_model
    assert spm_tokenizer.encode(text, add_special_tokens=False) == processor.encode(text)
    assert spm_tokenizer.encode(text) == [1, *processor.encode(text)]  # add_bos_token
    assert spm_tokenizer.decode(spm_tokenizer.encode(text)) == processor.decode(processor.encode(text)) == text


def test_random_text_matches_sentencepiece(spm_model, spm_tokenizer):
    processor, _ = spm_model
    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyz ABCHT.,!\t\n  éü日😀☃0123"
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        ids = spm_tokenizer.encode(text, add_special_tokens=False)
        assert ids == processor.encode(text), text
        assert spm_tokenizer.decode(ids) == text


def test_byte_fallback_for_characters_outside_the_vocabulary(spm_model, spm_tokenizer):
    processor, fields = spm_model
    tokens = fields["tokenizer.ggml.tokens"]
    assert "☃" not in "".join(tokens)
    ids = spm_tokenizer.encode("☃", add_special_tokens=False)
    pieces = [spm_tokenizer.id_to_token(i) for i in ids]
    assert pieces == ["▁", "<0xE2>", "<0x98>", "<0x83>"]
    assert spm_tokenizer.decode(ids) == "☃"
    # A lone byte of a multi-byte character is not text.
    assert spm_tokenizer.token_text(ids[1]) == "\ufffd"
    assert spm_tokenizer.token_text(ids[0]) == " "


def test_leading_space_is_kept_by_token_text(spm_tokenizer):
    ids = spm_tokenizer.encode("Hello world", add_special_tokens=False)
    assert spm_tokenizer.id_to_token(ids[-1]).startswith("▁")
    assert spm_tokenizer.token_text(ids[-1]).startswith(" ")
    # ...while decoding the text removes the one space the encoder put in front of it.
    assert spm_tokenizer.decode(ids) == "Hello world"


def test_special_tokens_are_matched_and_a_space_is_prefixed_after_them(spm_tokenizer):
    """As llama.cpp: the text after a special token gets its own "▁" prefix."""
    ids = spm_tokenizer.encode("fox</s>dog", add_special_tokens=False)
    assert 2 in ids
    assert ids[ids.index(2) + 1 :] == spm_tokenizer.encode("dog", add_special_tokens=False)
    assert spm_tokenizer.decode(ids, skip_special_tokens=False) == "fox</s> dog"
    assert spm_tokenizer.all_special_ids == frozenset({0, 1, 2})
    assert spm_tokenizer.eos_token_ids == [2]
    assert spm_tokenizer.bos_token_id == 1


def test_add_space_prefix_false(spm_model):
    _, fields = spm_model
    tokenizer = tokenizer_from_gguf_fields({**fields, "tokenizer.ggml.add_space_prefix": False})
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    assert tokenizer.id_to_token(ids[0])[0] != "▁"
    assert tokenizer.decode(ids) == "Hello world"


def test_same_as_transformers_converter_where_it_agrees_with_sentencepiece(spm_model, spm_tokenizer):
    """transformers' GGUF converter builds the same model; its pre-tokenizer only differs on leading spaces."""
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    _, fields = spm_model
    tokenizer_dict = {
        "tokenizer_type": "llama",
        "tokens": fields["tokenizer.ggml.tokens"],
        "scores": fields["tokenizer.ggml.scores"],
        "token_type": fields["tokenizer.ggml.token_type"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "unk_token_id": 0,
    }
    backend, _ = mapping.convert_gguf_tokenizer("llama", tokenizer_dict)
    for text in TEXTS:
        if text.startswith(" "):
            continue
        ids = spm_tokenizer.encode(text, add_special_tokens=False)
        assert ids == backend.encode(text, add_special_tokens=False).ids, text
        assert spm_tokenizer.decode(ids) == backend.decode(ids)


def test_merges_listed_in_the_file_are_used(spm_model, spm_tokenizer):
    """A GGUF may list merges instead of scores; the same merges give the same ids."""
    _, fields = spm_model
    tokens = fields["tokenizer.ggml.tokens"]
    ids = {token: index for index, token in enumerate(tokens)}
    pairs = []
    for token, score in sorted(zip(tokens, fields["tokenizer.ggml.scores"]), key=lambda p: -p[1]):
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ids and token[i:] in ids]
        pairs += [f"{left} {right}" for left, right in sorted(splits, key=lambda s: (ids[s[0]], ids[s[1]]))]
    without_scores = {k: v for k, v in fields.items() if k != "tokenizer.ggml.scores"}
    tokenizer = tokenizer_from_gguf_fields({**without_scores, "tokenizer.ggml.merges": pairs})
    for text in TEXTS:
        assert tokenizer.encode(text) == spm_tokenizer.encode(text), text


def _cached_entries(cache_dir) -> list:
    return sorted((cache_dir / "merges").glob("*.npy"))


def test_derived_merges_are_cached_and_read_back(spm_model, tmp_path, monkeypatch):
    processor, fields = spm_model
    first = tokenizer_from_gguf_fields(fields, cache_dir=str(tmp_path))
    (entry,) = _cached_entries(tmp_path)

    def not_again(*args):
        raise AssertionError("the merges were derived again instead of read from the cache")

    monkeypatch.setattr(tokenizer_files, "_merges_from_scores", not_again)
    second = tokenizer_from_gguf_fields(fields, cache_dir=str(tmp_path))
    for text in TEXTS:
        assert second.encode(text) == first.encode(text) == [1, *processor.encode(text)]
    assert _cached_entries(tmp_path) == [entry]


@pytest.mark.parametrize("content", [b"not an array", "out of range"])
def test_an_unusable_merges_entry_is_derived_and_written_again(spm_model, tmp_path, content):
    processor, fields = spm_model
    tokenizer_from_gguf_fields(fields, cache_dir=str(tmp_path))
    (entry,) = _cached_entries(tmp_path)
    good = entry.read_bytes()
    if content == "out of range":
        np.save(entry, np.array([[0, len(fields["tokenizer.ggml.tokens"])]], dtype=np.int32))
    else:
        entry.write_bytes(content)
    tokenizer = tokenizer_from_gguf_fields(fields, cache_dir=str(tmp_path))
    assert tokenizer.encode(TEXTS[1]) == [1, *processor.encode(TEXTS[1])]
    assert entry.read_bytes() == good


def test_another_vocabulary_gets_its_own_merges_entry(spm_model, tmp_path):
    _, fields = spm_model
    tokenizer_from_gguf_fields(fields, cache_dir=str(tmp_path))
    scores = list(fields["tokenizer.ggml.scores"])
    scores[-1] -= 1.0
    tokenizer_from_gguf_fields({**fields, "tokenizer.ggml.scores": scores}, cache_dir=str(tmp_path))
    assert len(_cached_entries(tmp_path)) == 2


def test_an_unwritable_cache_directory_still_gives_the_tokenizer(spm_model, tmp_path):
    processor, fields = spm_model
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    tokenizer = tokenizer_from_gguf_fields(fields, cache_dir=str(blocked))
    assert tokenizer.encode(TEXTS[1]) == [1, *processor.encode(TEXTS[1])]
