"""IncrementalDetokenizer: streamed deltas equal the full decode, and no character ever comes out broken."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenriver.loader.tokenizer_files import tokenizer_from_gguf_fields
from tokenriver.tokenizer.detokenizer import IncrementalDetokenizer
from tokenriver.tokenizer.tokenizer import Tokenizer

REAL_TEXTS = [
    "Résumé: naïve café, Ångström — “quotes” and ‘apostrophes’.",
    "Emoji 😀👍🏽 and a family 👨‍👩‍👧, flags 🇫🇷!",
    "中文字符测试，日本語のテキスト、한국어 텍스트。",
    "def f(x):\n    return x ** 2\n\n\tdone<|im_end|> after",
    "Mixed: 12 345 ∑∫√ ☃ ü ß ø",
]


def stream(tokenizer: Tokenizer, prompt_ids: list[int], ids: list[int], chunk: int = 1, skip: bool = True) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip)
    deltas = [detokenizer.add_tokens(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detokenizer.flush())
    assert "".join(deltas) == detokenizer.text
    return deltas


@pytest.mark.parametrize("text", REAL_TEXTS)
@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_equal_full_decode(smollm_tokenizer, text, skip, chunk):
    prompt_ids = smollm_tokenizer.encode("<|im_start|>assistant\n")
    ids = smollm_tokenizer.encode(text)
    deltas = stream(smollm_tokenizer, prompt_ids, ids, chunk, skip)
    assert "".join(deltas) == smollm_tokenizer.decode(ids, skip_special_tokens=skip)
    assert deltas[-1] == ""  # text that ends cleanly needs no flush
    assert not any("\ufffd" in delta for delta in deltas)


def test_character_split_over_byte_tokens_comes_out_whole(smollm_tokenizer):
    ids = smollm_tokenizer.encode(" 😀")
    assert len(ids) >= 2  # the emoji is spread over byte tokens
    assert smollm_tokenizer.decode(ids[:1]).endswith("\ufffd")
    detokenizer = IncrementalDetokenizer(smollm_tokenizer, smollm_tokenizer.encode("Hi"))
    deltas = [detokenizer.add_tokens([token_id]) for token_id in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == " 😀"


def test_generation_ending_inside_a_character_is_flushed(smollm_tokenizer):
    ids = smollm_tokenizer.encode("ok 😀")[:-1]
    detokenizer = IncrementalDetokenizer(smollm_tokenizer, [])
    assert detokenizer.add_tokens(ids) == "ok"
    assert detokenizer.flush() == smollm_tokenizer.decode(ids)[len("ok") :]
    assert detokenizer.text == smollm_tokenizer.decode(ids)
    assert detokenizer.flush() == ""


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_token_ids_stream_like_the_full_decode(smollm_tokenizer, data):
    """Any ids, even ones that make invalid UTF-8, fed in any chunks: stream + flush == decode."""
    # Mostly byte-ish tokens (ids of single bytes and multi-byte pieces) so characters get split often.
    byte_tokens = [smollm_tokenizer.encode(ch)[0] for ch in "é中😀"] + list(range(17, 300))
    ids = data.draw(st.lists(st.one_of(st.sampled_from(byte_tokens), st.integers(0, 49151)), max_size=25))
    skip = data.draw(st.booleans())
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=6)))
    detokenizer = IncrementalDetokenizer(smollm_tokenizer, smollm_tokenizer.encode("Say:"), skip)
    pieces = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)])]
    deltas = [detokenizer.add_tokens(piece) for piece in pieces]
    deltas.append(detokenizer.flush())
    assert "".join(deltas) == smollm_tokenizer.decode(ids, skip_special_tokens=skip)
    # Before the flush, no delta ends inside a character.
    assert not any(delta.endswith("\ufffd") for delta in deltas[:-1])


@pytest.fixture(scope="module")
def spm_tokenizer(spm_model) -> Tokenizer:
    return tokenizer_from_gguf_fields(spm_model[1])


@pytest.mark.parametrize("text", ["Hello world, the fox!", "café ☃ 日本 😀 end", "  spaced  out\tand\nlines"])
def test_sentencepiece_stream_keeps_the_space_after_the_prompt(spm_tokenizer, text):
    """With a prompt, deltas are what the generated tokens add to the prompt's text (leading space kept)."""
    prompt_ids = spm_tokenizer.encode("The answer is")
    ids = spm_tokenizer.encode(text, add_special_tokens=False)
    streamed = "".join(stream(spm_tokenizer, prompt_ids, ids))
    prompt_text = spm_tokenizer.decode(prompt_ids)
    assert streamed == spm_tokenizer.decode(prompt_ids + ids)[len(prompt_text) :]
    assert streamed == " " + spm_tokenizer.decode(ids)  # the one documented difference from decode(ids)
    # Without a prompt (or only BOS) there is no space to keep: deltas == decode(ids).
    assert "".join(stream(spm_tokenizer, [], ids)) == spm_tokenizer.decode(ids)
    assert "".join(stream(spm_tokenizer, [1], ids)) == spm_tokenizer.decode(ids)


def test_sentencepiece_byte_fallback_character_comes_out_whole(spm_tokenizer):
    ids = spm_tokenizer.encode("a☃", add_special_tokens=False)
    assert [spm_tokenizer.id_to_token(i) for i in ids[-3:]] == ["<0xE2>", "<0x98>", "<0x83>"]
    detokenizer = IncrementalDetokenizer(spm_tokenizer, [1])
    deltas = [detokenizer.add_tokens([token_id]) for token_id in ids]
    assert deltas[-3:] == ["", "", "☃"]
    assert "".join(deltas) == "a☃"
