"""Our GGUF and folder tokenizers against transformers on the embedded SmolLM2 GGUF.

One documented difference: for pre-tokenizer "smollm", llama.cpp (and SmolLM's own tokenizer.json) cut
every digit out before GPT-2's regex; transformers' GGUF loader does not. The two only disagree on a run
of two or more whitespace characters right before a digit, which is tested against llama.cpp's split.
"""

from __future__ import annotations

import os
import re

import pytest

from tokenriver.loader.tokenizer_files import tokenizer_from_folder, tokenizer_from_gguf_fields

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  two leading spaces and trailing   ",
    "tabs\t\tand\tnewlines\n\nand\r\nwindows line ends\n",
    "    \t  \n\n   \t",
    "def square(x):\n    return x ** 2  # a comment\n\nclass A:\n\tpass\n",
    'if (a != b && c >= 3) { printf("%d\\n", a); }',
    "emoji 😀🎉👍🏽 and a family 👨‍👩‍👧 done",
    "中文字符测试，日本語のテキスト、한국어 텍스트",
    "café naïve résumé Ångström façade über",
    "numbers 12345 and 3.14159 and 1,000,000",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>x<file_sep>",
    "it's they're we've I'm you'll he'd",
    "",
    " ",
]

# Where transformers' GGUF loader and llama.cpp legitimately differ (see the module docstring).
_WHITESPACE_RUN_BEFORE_DIGIT = re.compile(r"\s{2,}\d")
# llama.cpp's pre-tokenizer for "smollm": every digit alone, then GPT-2's regex on the rest.
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


@pytest.fixture(scope="module")
def hf_tokenizer(smollm_gguf_path):
    transformers = pytest.importorskip("transformers")
    directory, name = os.path.split(smollm_gguf_path)
    return transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)


def test_corpus_avoids_the_documented_difference():
    assert not any(_WHITESPACE_RUN_BEFORE_DIGIT.search(text) for text in TEXTS)


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_encode_and_decode_match_transformers(smollm_tokenizer, hf_tokenizer, text):
    ids = smollm_tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text)
    plain = hf_tokenizer.encode(text, add_special_tokens=False)
    assert smollm_tokenizer.encode(text, add_special_tokens=False) == plain
    for skip in (True, False):
        assert smollm_tokenizer.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(
            ids, skip_special_tokens=skip
        )


def test_special_tokens_in_text_are_single_ids(smollm_tokenizer):
    ids = smollm_tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert smollm_tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_digits_follow_llama_cpp_split(smollm_tokenizer, hf_tokenizer):
    """Reference: llama.cpp's "smollm" split (digits alone, then GPT-2's regex), each piece merged by transformers."""
    regex = pytest.importorskip("regex")
    for text in ["a  1", "x\n\n2", "total:   42 items\t\t7", "   9"]:
        pieces = []
        for chunk in regex.split(r"(\p{N})", text):
            pieces += regex.findall(_GPT2_REGEX, chunk)
        expected = [i for piece in pieces for i in hf_tokenizer.encode(piece, add_special_tokens=False)]
        assert smollm_tokenizer.encode(text) == expected, text
        assert smollm_tokenizer.decode(expected) == text


def test_gguf_properties(smollm_tokenizer):
    assert smollm_tokenizer.vocab_size == 49152
    assert smollm_tokenizer.bos_token_id == 1
    # <|im_end|> is EOS; <|endoftext|> also ends generation (llama.cpp's end-of-generation list).
    assert smollm_tokenizer.eos_token_ids == [2, 0]
    assert smollm_tokenizer.all_special_ids == frozenset(range(17))
    assert smollm_tokenizer.is_special(2) and not smollm_tokenizer.is_special(17)
    # add_bos_token is false in this GGUF: nothing is prepended.
    assert smollm_tokenizer.encode("hi") == smollm_tokenizer.encode("hi", add_special_tokens=False)
    hello = smollm_tokenizer.encode(" Hello")
    assert len(hello) == 1
    assert smollm_tokenizer.id_to_token(hello[0]) == "ĠHello"
    assert smollm_tokenizer.token_text(hello[0]) == " Hello"
    assert smollm_tokenizer.token_text(2) == "<|im_end|>"


def test_folder_tokenizer_matches_transformers(hf_tokenizer, tmp_path):
    hf_tokenizer.save_pretrained(tmp_path)
    tokenizer = tokenizer_from_folder(str(tmp_path))
    for text in [*TEXTS, "a  1", "x\n\n2"]:
        assert tokenizer.encode(text) == hf_tokenizer.encode(text), text
        ids = hf_tokenizer.encode(text)
        assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_ids == [2, 0]
    assert tokenizer.vocab_size == 49152
    assert tokenizer.chat_template == hf_tokenizer.chat_template
    messages = [{"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(messages) == hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_folder_reads_generation_config_eos_ids(hf_tokenizer, tmp_path):
    hf_tokenizer.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 7]}')
    assert tokenizer_from_folder(str(tmp_path)).eos_token_ids == [2, 7, 0]


CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about cats 🐱 in 中文."},
    ],
    [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "One"},
        {"role": "assistant", "content": "Two"},
        {"role": "user", "content": "Three\n  with\tspaces "},
        {"role": "assistant", "content": "Four"},
    ],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(smollm_tokenizer, hf_tokenizer, messages, add_generation_prompt):
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert smollm_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    ids = smollm_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    expected_ids = hf_tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )
    assert ids == list(expected_ids)


# Exercises what transformers' jinja environment adds: tojson without HTML escaping, loop controls,
# namespace, the special token variables, extra kwargs, tools and the {% generation %} block.
FEATURE_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(count=0) %}"
    "{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
    "{% for message in messages %}"
    "  {% if message['role'] == 'skip' %}{% continue %}{% endif %}"
    "  {% set ns.count = ns.count + 1 %}"
    "  {% if message['role'] == 'assistant' %}"
    "{% generation %}<{{ message['role'] }}>{{ message['content'] }}{{ eos_token }}{% endgeneration %}\n"
    "  {% else %}<{{ message['role'] }}>{{ message['content'] | trim }}\n{% endif %}"
    "  {% if ns.count >= 4 %}{% break %}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% if enable_thinking %}<think>{% endif %}{% endif %}"
    "[{{ ns.count }} {{ unk_token }} {{ pad_token }} {{ {'a': '<&>', 'b': [1, 2]} | tojson(indent=2) }}]"
)


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_template_features_match_transformers(smollm_fields, hf_tokenizer, enable_thinking):
    tokenizer = tokenizer_from_gguf_fields({**smollm_fields, "tokenizer.chat_template": FEATURE_TEMPLATE})
    messages = [
        {"role": "system", "content": "  sys <b>&</b>  "},
        {"role": "skip", "content": "ignored"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1", "tool_calls": None},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "never rendered"},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in <city> & more"}}]
    ours = tokenizer.apply_chat_template(messages, tools=tools, enable_thinking=enable_thinking)
    expected = hf_tokenizer.apply_chat_template(
        messages,
        chat_template=FEATURE_TEMPLATE,
        tools=tools,
        enable_thinking=enable_thinking,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert ours == expected


def test_a_token_spelled_outside_the_byte_alphabet_is_respelled(smollm_fields, smollm_tokenizer):
    """Old converters wrote some byte-level tokens as plain text (" the" for "Ġthe"): read byte by byte, such a token
    is the same token."""
    tokens = list(smollm_fields["tokenizer.ggml.tokens"])
    index = tokens.index("Ġthe")
    tokens[index] = " the"
    respelled = tokenizer_from_gguf_fields({**smollm_fields, "tokenizer.ggml.tokens": tokens})
    text = "Over the river, the bridge."
    assert index in smollm_tokenizer.encode(text)
    assert respelled.encode(text) == smollm_tokenizer.encode(text)
