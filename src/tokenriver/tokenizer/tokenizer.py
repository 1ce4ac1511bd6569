"""Tokenizer: text <-> token ids for one model, its special ids and its chat template.

Built by the loader from what the model ships (loader/tokenizer_files.py: a GGUF vocabulary or a Hugging Face
folder); encoding and decoding are the `tokenizers` library's. Knows nothing about files, tensors or requests.
"""

from __future__ import annotations

import json
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from tokenriver.errors import InvalidParameterError

# Special tokens with these names end generation, as in llama.cpp (llama-vocab.cpp, `special_eog_ids`).
_END_OF_GENERATION_NAMES = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "<|end_of_text|>",
        "<end_of_utterance>",
    }
)


class Tokenizer:
    """One model's tokenizer: encode, decode, special ids and the chat template.

    Built by loader/tokenizer_files.py (`tokenizer_from_gguf_fields`, `tokenizer_from_folder`). Safe to share
    between threads for encoding and decoding (nothing here mutates the backend after construction).
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: list[int],
        chat_template: str | None,
        special_token_strings: dict[str, str],
        vocab_size: int | None = None,
    ) -> None:
        self._backend = backend
        self._bos_token_id = bos_token_id
        self._chat_template = chat_template
        # bos_token / eos_token / unk_token / pad_token strings, handed to chat templates as transformers does.
        self._special_token_strings = dict(special_token_strings)
        self._vocab_size = vocab_size if vocab_size is not None else backend.get_vocab_size(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()
        self._all_special_ids = frozenset(token_id for token_id, token in added.items() if token.special)
        named_end_ids = [
            token_id
            for token_id, token in sorted(added.items())
            if token.special and token.content in _END_OF_GENERATION_NAMES
        ]
        self._eos_token_ids = list(dict.fromkeys([*eos_token_ids, *named_end_ids]))
        self._piece_decoder = _piece_decoder(backend)

    # ----- vocabulary ---------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids (base vocabulary plus added tokens)."""
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends a sequence: EOS, generation-config EOS ids, GGUF EOT/EOM, end-of-turn tokens."""
        return list(self._eos_token_ids)

    @property
    def all_special_ids(self) -> frozenset[int]:
        """Ids of special (control) tokens: the ones `skip_special_tokens` drops from decoded text."""
        return self._all_special_ids

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def to_json(self) -> str:
        """The tokenizer in Hugging Face `tokenizers` JSON (what grammar engines build their vocabulary from)."""
        return self._backend.to_str()

    def is_special(self, token_id: int) -> bool:
        return token_id in self._all_special_ids

    def id_to_token(self, token_id: int) -> str:
        """The raw vocabulary piece, as spelled in the vocabulary (e.g. "Ġthe", "▁the", "<0x0A>")."""
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            raise InvalidParameterError(
                f"token id {token_id} is outside the vocabulary (0..{self._vocab_size - 1}).", param="token_id"
            )
        return piece

    def token_text(self, token_id: int) -> str:
        """The token decoded on its own, keeping its leading space (for traces and the visualizer).

        A byte token that is only part of a UTF-8 character decodes to U+FFFD; `id_to_token` gives the raw piece.
        """
        piece = self.id_to_token(token_id)
        if self._piece_decoder is None:
            return piece
        return self._piece_decoder.decode([piece])

    # ----- text <-> ids -------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text are matched whole.

        `add_special_tokens` adds BOS (and EOS) only when the model asks for them.
        """
        if not isinstance(text, str):
            raise InvalidParameterError(f"prompt must be a string, got {type(text).__name__}.", param="prompt")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_pair(self, first: str, second: str) -> list[int]:
        """Token ids of a text pair joined as the model's tokenizer joins pairs, special tokens included: BERT's
        "[CLS] first [SEP] second [SEP]", XLM-RoBERTa's "<s> first </s></s> second </s>". A cross-encoder reads
        (query, document) this way; transformers' `tokenizer(first, second)` gives the same ids."""
        for text in (first, second):
            if not isinstance(text, str):
                raise InvalidParameterError(
                    f"each text of a pair must be a string, got {type(text).__name__}.", param="prompt"
                )
        return self._backend.encode(first, second, add_special_tokens=True).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    # ----- chat ---------------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` with the model's chat template; token ids when `tokenize`.

        The rendered text already holds the template's special tokens, so tokenizing adds no BOS of its own
        (as in transformers). `kwargs` (tools, enable_thinking...) are passed to the template.
        """
        if self._chat_template is None:
            raise InvalidParameterError(
                "this model has no chat template, so it cannot format chat messages; "
                "send a plain prompt (a completion request) instead.",
                param="messages",
            )
        _validate_messages(messages)
        from tokenriver.tokenizer.chat_template import render_chat_template  # jinja2, on the first chat

        text = render_chat_template(
            self._chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self._special_token_strings,
            **kwargs,
        )
        if tokenize:
            return self.encode(text, add_special_tokens=False)
        return text


def _piece_decoder(backend: BackendTokenizer) -> BackendTokenizer | None:
    """The backend's decoder without its `Strip` step, to decode one token and keep its leading space.

    SentencePiece decoders strip the space the encoder prepended to the whole text; for a single token seen
    alone (a trace row) that space is part of what the token means.
    """
    if backend.decoder is None:
        return None
    spec = json.loads(backend.decoder.__getstate__())
    if spec.get("type") == "Strip":
        return None
    if spec.get("type") == "Sequence":
        spec["decoders"] = [step for step in spec["decoders"] if step.get("type") != "Strip"]
    shell = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": spec,
        "model": {"type": "BPE", "vocab": {}, "merges": []},
    }
    return BackendTokenizer.from_str(json.dumps(shell)).decoder


# ----- chat input checks ------------------------------------------------------------------------------


def _validate_messages(messages: object) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidParameterError(
            f"messages must be a non-empty list of {{'role': ..., 'content': ...}} dicts, got {type(messages).__name__}"
            + (" (empty)" if isinstance(messages, list) else "")
            + ".",
            param="messages",
        )
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidParameterError(
                f"messages[{index}] must be a dict with 'role' and 'content', got {type(message).__name__}.",
                param="messages",
            )
        if not isinstance(message.get("role"), str):
            raise InvalidParameterError(
                f"messages[{index}] needs a string 'role' (such as 'system', 'user' or 'assistant').",
                param="messages",
            )
        if "content" not in message:
            raise InvalidParameterError(
                f"messages[{index}] (role {message['role']!r}) has no 'content'; add the message text.",
                param="messages",
            )
