"""Tokenizer errors name what is wrong (file, field, message index) and how to fix it."""

from __future__ import annotations

import pytest

from tokenriver.errors import InvalidParameterError, ModelLoadError
from tokenriver.loader.tokenizer_files import tokenizer_from_folder, tokenizer_from_gguf_fields
from tokenriver.tokenizer.chat_template import render_chat_template


@pytest.fixture(scope="module")
def folder_tokenizer_json() -> str:
    """A valid (tiny) tokenizer.json to copy into test folders."""
    tokenizers = pytest.importorskip("tokenizers")
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
    return backend.to_str()


def test_missing_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        tokenizer_from_folder(str(tmp_path / "nope"))


def test_folder_without_tokenizer_json(tmp_path):
    with pytest.raises(ModelLoadError, match="tokenizer.json") as error:
        tokenizer_from_folder(str(tmp_path))
    assert error.value.path == str(tmp_path / "tokenizer.json")


def test_damaged_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(ModelLoadError, match="not a valid tokenizer.json"):
        tokenizer_from_folder(str(tmp_path))


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("tokenizer_config.json", "{not json", "tokenizer_config.json is not valid JSON"),
        ("special_tokens_map.json", "[1, 2]", "special_tokens_map.json must hold a JSON object"),
        ("generation_config.json", '{"eos_token_id": "two"}', "eos_token_id must be an int or a list of ints"),
    ],
)
def test_damaged_side_files_are_named(tmp_path, folder_tokenizer_json, name, content, message):
    (tmp_path / "tokenizer.json").write_text(folder_tokenizer_json)
    (tmp_path / name).write_text(content)
    with pytest.raises(ModelLoadError, match=message):
        tokenizer_from_folder(str(tmp_path))


def test_folder_with_only_tokenizer_json_works(tmp_path, folder_tokenizer_json):
    (tmp_path / "tokenizer.json").write_text(folder_tokenizer_json)
    tokenizer = tokenizer_from_folder(str(tmp_path))
    assert tokenizer.encode("abba") == [2, 1, 0]
    assert tokenizer.chat_template is None
    assert tokenizer.bos_token_id is None
    assert tokenizer.eos_token_ids == []


def test_gguf_fields_without_vocabulary():
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.tokens"):
        tokenizer_from_gguf_fields({"tokenizer.ggml.model": "gpt2"})


def test_gguf_unsupported_tokenizer_model(smollm_fields):
    with pytest.raises(ModelLoadError, match="'t5' is not supported"):
        tokenizer_from_gguf_fields({**smollm_fields, "tokenizer.ggml.model": "t5"})


def test_gguf_special_id_outside_vocabulary(smollm_fields):
    with pytest.raises(ModelLoadError, match="eos_token_id=99999"):
        tokenizer_from_gguf_fields({**smollm_fields, "tokenizer.ggml.eos_token_id": 99999})


def test_no_chat_template_says_to_send_a_plain_prompt(smollm_fields):
    fields = {k: v for k, v in smollm_fields.items() if k != "tokenizer.chat_template"}
    tokenizer = tokenizer_from_gguf_fields(fields)
    assert tokenizer.chat_template is None
    with pytest.raises(InvalidParameterError, match="no chat template.*plain prompt") as error:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert error.value.param == "messages"


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ("hello", "non-empty list"),
        ([], "non-empty list"),
        ([{"role": "user", "content": "a"}, "b"], r"messages\[1\] must be a dict"),
        ([{"content": "a"}], r"messages\[0\] needs a string 'role'"),
        ([{"role": "user", "content": "a"}, {"role": "assistant"}], r"messages\[1\] .*has no 'content'"),
    ],
)
def test_bad_messages_name_the_index(smollm_tokenizer, messages, message):
    with pytest.raises(InvalidParameterError, match=message) as error:
        smollm_tokenizer.apply_chat_template(messages)
    assert error.value.param == "messages"


def test_template_exception_becomes_invalid_parameter(smollm_fields):
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversations must start with user') }}{% endif %}ok"
    )
    tokenizer = tokenizer_from_gguf_fields({**smollm_fields, "tokenizer.chat_template": template})
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(InvalidParameterError, match="Conversations must start with user") as error:
        tokenizer.apply_chat_template([{"role": "assistant", "content": "x"}])
    assert error.value.param == "messages"


def test_template_syntax_error_becomes_invalid_parameter():
    with pytest.raises(InvalidParameterError, match="does not compile") as error:
        render_chat_template("{% for m in messages %}", [], add_generation_prompt=True, special_tokens={})
    assert error.value.param == "chat_template"


def test_template_sandbox_blocks_unsafe_access():
    template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(InvalidParameterError):
        render_chat_template(
            template, [{"role": "user", "content": "x"}], add_generation_prompt=True, special_tokens={}
        )
