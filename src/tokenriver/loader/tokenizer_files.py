"""A model's tokenizer files → tokenriver's Tokenizer: llama.cpp's GGUF metadata or a Hugging Face folder.

The splitting and merging is done by the `tokenizers` library (the Rust BPE that transformers and vLLM use);
this module only assembles it from what the model ships:

- GGUF files carry no `tokenizer.json`, only llama.cpp's metadata (`tokenizer.ggml.*`): the vocabulary, the
  merges or scores, token types and special ids. `tokenizer_from_gguf_fields` rebuilds the tokenizer they describe:
  * model "gpt2": byte-level BPE. How text is cut into words before merging depends on `tokenizer.ggml.pre`
    and follows llama.cpp's table (llama-vocab.cpp), e.g. "smollm" splits every digit first, as SmolLM's own
    tokenizer.json does (`Digits(individual_digits)` then GPT-2's regex).
  * model "llama": SentencePiece-style BPE: spaces become "▁", a "▁" is put in front of the text when
    `tokenizer.ggml.add_space_prefix` (default true), characters missing from the vocabulary fall back to
    `<0xNN>` byte tokens, and merges are derived from the token scores when the file lists none.
  * model "bert": BERT's WordPiece (`_wordpiece`), which llama.cpp's converter respelled: word-initial pieces
    carry a "▁", continuations lost their "##". Every text is lowercased (llama.cpp's rule: an uncased BERT's) and
    wrapped as "[CLS] text [SEP]", a pair as "[CLS] first [SEP] second [SEP]".
  Control tokens become special added tokens (matched whole in text, skipped when decoding with
  `skip_special_tokens`); user-defined tokens are matched whole but stay visible in decoded text.
- A Hugging Face folder carries `tokenizer.json`; `tokenizer_config.json`, `special_tokens_map.json`,
  `chat_template.jinja` and `generation_config.json` add the chat template, named tokens and stop ids
  (`tokenizer_from_folder`).

The model decides whether BOS is prepended (GGUF `add_bos_token`; a folder's `tokenizer.json`
post-processor, which transformers v5 also follows).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE, WordPiece

from tokenriver.errors import ModelLoadError
from tokenriver.loader.gguf_cache import default_cache_dir, write_atomically
from tokenriver.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Word-splitting regexes of byte-level vocabularies, by `tokenizer.ggml.pre` (llama.cpp's names).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's LLAMA3 group: also takes a word that is whole in the vocabulary without merging, and adds BOS.
_LLAMA3_PRE_TYPES = frozenset(
    {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"}
)
_SPLIT_BY_PRE_TYPE = {
    **dict.fromkeys((*_LLAMA3_PRE_TYPES, "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_SPLIT),
    "tekken": _TEKKEN_SPLIT,
}
# Pre types that isolate every digit, then apply GPT-2's regex (llama.cpp: "\p{N}" before the GPT-2 regex).
_DIGITS_FIRST_PRE_TYPES = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"})

_SPM_SPACE = "\u2581"  # "▁", SentencePiece's spelling of a space


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: every byte as a printable character, so byte-level tokens are plain strings."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping = {byte: chr(byte) for byte in printable}
    shift = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + shift)
            shift += 1
    return mapping


_BYTE_ALPHABET = _bytes_to_unicode()
_BYTE_ALPHABET_CHARS = frozenset(_BYTE_ALPHABET.values())


def tokenizer_from_gguf_fields(fields: dict[str, object], cache_dir: str | None = None) -> Tokenizer:
    """Rebuild the tokenizer a GGUF file describes from its `tokenizer.*` metadata (plain Python values).

    cache_dir: where merges derived from scores are cached (`_cached_merges_from_scores`; None: $XDG_CACHE_HOME/
    tokenriver or ~/.cache/tokenriver)."""
    tokens = fields.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(token, str) for token in tokens):
        raise ModelLoadError(
            "GGUF field tokenizer.ggml.tokens is missing or not a list of strings: the file has no usable "
            "vocabulary; re-convert the model with llama.cpp's convert_hf_to_gguf.py."
        )
    model_type = fields.get("tokenizer.ggml.model")
    token_types = [int(t) for t in _optional_list(fields, "tokenizer.ggml.token_type", len(tokens))]
    if model_type == "gpt2":
        backend = _byte_level_bpe(tokens, fields)
        default_add_bos = fields.get("tokenizer.ggml.pre") in _LLAMA3_PRE_TYPES
    elif model_type == "llama":
        backend = _sentencepiece_bpe(tokens, fields, cache_dir)
        # llama.cpp and transformers add BOS to a SentencePiece vocabulary that does not say otherwise.
        default_add_bos = True
    elif model_type == "bert":
        backend = _wordpiece(tokens, token_types, fields)
        default_add_bos = True  # [CLS], the "BOS" llama.cpp's converter names
    else:
        raise ModelLoadError(
            f"GGUF field tokenizer.ggml.model={model_type!r} is not supported: tokenriver reads 'gpt2' "
            "(byte-level BPE), 'llama' (SentencePiece BPE) and 'bert' (WordPiece) vocabularies."
        )

    def token_id(key: str) -> int | None:
        value = fields.get(f"tokenizer.ggml.{key}")
        if value is None:
            return None
        if not isinstance(value, int) or not 0 <= value < len(tokens):
            raise ModelLoadError(
                f"GGUF field tokenizer.ggml.{key}={value!r} is not a token id of the vocabulary "
                f"(0..{len(tokens) - 1}); the file's tokenizer metadata is damaged."
            )
        return value

    named = {name: token_id(f"{name}_token_id") for name in ("bos", "eos", "unknown", "padding", "eot", "eom")}
    _add_gguf_tokens(backend, tokens, token_types, named, byte_level=model_type == "gpt2")

    add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", default_add_bos))
    add_eos = bool(fields.get("tokenizer.ggml.add_eos_token", False))
    bos_id, eos_id = named["bos"], named["eos"]
    if model_type == "bert":
        processor = _cls_sep_processor(backend, fields, add_bos)
    else:
        processor = _bos_eos_processor(
            (tokens[bos_id], bos_id) if add_bos and bos_id is not None else None,
            (tokens[eos_id], eos_id) if add_eos and eos_id is not None else None,
        )
    if processor is not None:
        backend.post_processor = processor

    special_names = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
    chat_template = fields.get("tokenizer.chat_template")
    return Tokenizer(
        backend,
        bos_token_id=bos_id,
        eos_token_ids=[i for i in (eos_id, named["eot"], named["eom"]) if i is not None],
        chat_template=chat_template if isinstance(chat_template, str) else None,
        special_token_strings={
            name: tokens[named[key]] for name, key in special_names.items() if named[key] is not None
        },
        vocab_size=len(tokens),
    )


def tokenizer_from_folder(path: str) -> Tokenizer:
    """Load a Hugging Face tokenizer folder: `tokenizer.json` plus the optional config files beside it."""
    folder = os.fspath(path)
    if not os.path.isdir(folder):
        raise ModelLoadError(f"tokenizer folder {folder!r} does not exist or is not a directory.", path=folder)
    tokenizer_file = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(tokenizer_file):
        raise ModelLoadError(
            f"{tokenizer_file} is missing: tokenriver needs the fast tokenizer file (tokenizer.json) "
            "in the model folder; save it with transformers' tokenizer.save_pretrained(folder).",
            path=tokenizer_file,
        )
    try:
        backend = BackendTokenizer.from_file(tokenizer_file)
    except Exception as error:  # the Rust loader raises a bare Exception on malformed JSON
        raise ModelLoadError(f"{tokenizer_file} is not a valid tokenizer.json: {error}", path=tokenizer_file) from error

    config = _read_json_object(folder, "tokenizer_config.json")
    special_map = _read_json_object(folder, "special_tokens_map.json")
    generation = _read_json_object(folder, "generation_config.json")

    special_token_strings = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        content = _token_content(config.get(name)) or _token_content(special_map.get(name))
        if content is not None:
            special_token_strings[name] = content

    def named_id(name: str) -> int | None:
        content = special_token_strings.get(name)
        return backend.token_to_id(content) if content is not None else None

    bos_id = named_id("bos_token")
    if bos_id is None and isinstance(generation.get("bos_token_id"), int):
        bos_id = generation["bos_token_id"]
    eos_ids = [named_id("eos_token")] + _int_list(generation.get("eos_token_id"), folder, "generation_config.json")
    return Tokenizer(
        backend,
        bos_token_id=bos_id,
        eos_token_ids=[i for i in eos_ids if i is not None],
        chat_template=_folder_chat_template(folder, config),
        special_token_strings=special_token_strings,
    )


# ----- GGUF assembly ----------------------------------------------------------------------------------


def _optional_list(fields: dict[str, object], key: str, length: int) -> list[Any]:
    value = fields.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or len(value) != length:
        raise ModelLoadError(f"GGUF field {key} must be a list with one entry per token ({length}).")
    return value


def _merge_pairs(fields: dict[str, object]) -> list[tuple[str, str]] | None:
    merges = fields.get("tokenizer.ggml.merges")
    if merges is None:
        return None
    pairs = []
    for merge in merges:
        left, separator, right = str(merge).partition(" ")
        if not separator:
            raise ModelLoadError(f"GGUF field tokenizer.ggml.merges holds {merge!r}, which is not 'left right'.")
        pairs.append((left, right))
    return pairs


def _byte_level_bpe(tokens: list[str], fields: dict[str, object]) -> BackendTokenizer:
    """GPT-2 style BPE over bytes spelled in `_BYTE_ALPHABET`, with the word split `tokenizer.ggml.pre` names."""
    # A token written outside the byte alphabet (rare, from old converters) is respelled byte by byte. One set of
    # the whole vocabulary's characters says whether any is, rather than a set per token.
    if set("".join(tokens)) <= _BYTE_ALPHABET_CHARS:
        vocab = dict(zip(tokens, range(len(tokens))))
    else:
        vocab = {
            token if set(token) <= _BYTE_ALPHABET_CHARS else "".join(_BYTE_ALPHABET[b] for b in token.encode()): i
            for i, token in enumerate(tokens)
        }
    merges = _merge_pairs(fields)
    if merges is None:
        raise ModelLoadError(
            "GGUF field tokenizer.ggml.merges is missing: a byte-level BPE vocabulary needs its merges."
        )
    pre_type = str(fields.get("tokenizer.ggml.pre", "default"))
    backend = BackendTokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            ignore_merges=pre_type in _LLAMA3_PRE_TYPES,
        )
    )
    split = _SPLIT_BY_PRE_TYPE.get(pre_type)
    if split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre_type in _DIGITS_FIRST_PRE_TYPES:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        # "default", "gpt2" and pre types without a table entry: GPT-2's own regex.
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return backend


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Merges a SentencePiece vocabulary implies: every split of a token into two tokens, best score first.

    SentencePiece's BPE merges the pair whose joined piece has the highest score; ranking the pairs by that
    score makes `tokenizers`' BPE do the same (the recipe of transformers' `generate_merges`). Ties go to the
    longer left piece, then the longer right one, then the token that comes first; one token's splits differ
    in their left length, so that order is complete. One sort of arrays, not of tuples: a 262k vocabulary has
    half a million splits.
    """
    ids = {token: index for index, token in enumerate(tokens)}
    pieces: list[tuple[str, str]] = []
    split_at: list[int] = []
    owner: list[int] = []
    unique = dict(zip(tokens, scores))
    for position, token in enumerate(unique):
        for i in range(1, len(token)):
            left = token[:i]
            if left in ids:
                right = token[i:]
                if right in ids:
                    pieces.append((left, right))
                    split_at.append(i)
                    owner.append(position)
    owner_array = np.array(owner, dtype=np.int64)
    left_length = np.array(split_at, dtype=np.int64)
    right_length = np.array([len(token) for token in unique], dtype=np.int64)[owner_array] - left_length
    score = np.array(list(unique.values()), dtype=np.float64)[owner_array]
    order = np.lexsort((owner_array, -right_length, -left_length, -score))
    return [pieces[index] for index in order]


def _cached_merges_from_scores(
    tokens: list[str],
    scores: list[float],
    cache_dir: str | None,
) -> list[tuple[str, str]]:
    """_merges_from_scores through an on-disk cache: the pairs' token ids, one int32 array [P, 2] per vocabulary,
    named by a SHA-256 of the tokens and scores. Why: deriving Gemma 3's 514,847 merges from its 262k-token
    vocabulary is most of its load (a second in Python); the array reads in milliseconds. A missing, unreadable or
    malformed entry is logged at INFO and the merges derived (and stored) again; never pickle."""
    digest = hashlib.sha256(np.array([len(token) for token in tokens], dtype=np.int64).tobytes())
    digest.update("".join(tokens).encode("utf-8", "surrogatepass"))
    digest.update(np.array(scores, dtype=np.float64).tobytes())
    path = os.path.join(cache_dir or default_cache_dir(), "merges", f"{digest.hexdigest()[:32]}.npy")
    try:
        pairs = np.load(path, allow_pickle=False)
        if (
            pairs.dtype != np.int32
            or pairs.ndim != 2
            or pairs.shape[1] != 2
            or (pairs.size and not 0 <= pairs.min() <= pairs.max() < len(tokens))
        ):
            raise ValueError(f"an array of {pairs.dtype} {pairs.shape} is not [pairs, 2] token ids")
        # Two flat lists, not pairs.tolist(): half a million 2-item lists are a second of allocation, and the
        # largest transient of a load.
        return [(tokens[left], tokens[right]) for left, right in zip(pairs[:, 0].tolist(), pairs[:, 1].tolist())]
    except FileNotFoundError:
        logger.info("no merges cached for this vocabulary at %s; deriving them from the scores", path)
    except (OSError, ValueError) as error:
        logger.info(
            "merges cache %s is unusable (%s: %s); deriving them from the scores", path, type(error).__name__, error
        )
    merges = _merges_from_scores(tokens, scores)
    ids = {token: index for index, token in enumerate(tokens)}
    pairs = np.array([(ids[left], ids[right]) for left, right in merges], dtype=np.int32).reshape(-1, 2)
    buffer = io.BytesIO()
    np.save(buffer, pairs, allow_pickle=False)
    try:
        write_atomically(path, buffer.getvalue())
    except OSError as error:
        logger.info("could not cache the merges at %s (%s); the next load derives them again", path, error)
    return merges


def _sentencepiece_bpe(tokens: list[str], fields: dict[str, object], cache_dir: str | None) -> BackendTokenizer:
    """SentencePiece-style BPE: "▁" for spaces, `<0xNN>` byte fallback, merges from the file or the scores."""
    merges = _merge_pairs(fields)
    if merges is None:
        scores = _optional_list(fields, "tokenizer.ggml.scores", len(tokens))
        if not scores:
            raise ModelLoadError(
                "GGUF fields tokenizer.ggml.merges and tokenizer.ggml.scores are both missing: a SentencePiece "
                "vocabulary needs one of them to know the merge order."
            )
        merges = _cached_merges_from_scores(tokens, [float(score) for score in scores], cache_dir)
    unknown_id = fields.get("tokenizer.ggml.unknown_token_id")
    unknown = tokens[unknown_id] if isinstance(unknown_id, int) and 0 <= unknown_id < len(tokens) else None
    backend = BackendTokenizer(
        BPE(
            vocab={token: index for index, token in enumerate(tokens)},
            merges=merges,
            dropout=None,
            unk_token=unknown,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    add_space_prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
    # As sentencepiece and llama.cpp: a "▁" goes in front of every stretch of text (also right after a special
    # token), even one that already starts with a space, so "  hi" keeps both spaces on the way back.
    spaces = [normalizers.Replace(" ", _SPM_SPACE)]
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend(_SPM_SPACE), *spaces] if add_space_prefix else spaces
    )
    steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        # Remove the space the encoder put in front of the text.
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _wordpiece(tokens: list[str], token_types: list[int], fields: dict[str, object]) -> BackendTokenizer:
    """BERT's WordPiece from llama.cpp's respelled vocabulary: a piece with a leading "▁" starts a word (the "▁"
    goes), any other piece but a control token continues one (it gets its "##" back). The normalizer is an uncased
    BERT's (lowercase, accents removed, Chinese characters split apart), as llama.cpp lowercases every text."""
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if index < len(token_types) and token_types[index] == _TOKEN_TYPE_CONTROL:
            piece = token
        elif token.startswith(_SPM_SPACE):
            piece = token[len(_SPM_SPACE) :]
        else:
            piece = "##" + token
        vocab.setdefault(piece, index)
    unknown_id = fields.get("tokenizer.ggml.unknown_token_id")
    unknown = tokens[unknown_id] if isinstance(unknown_id, int) and 0 <= unknown_id < len(tokens) else "[UNK]"
    backend = BackendTokenizer(WordPiece(vocab, unk_token=unknown, max_input_chars_per_word=100))
    backend.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix="##")
    return backend


def _cls_sep_processor(
    backend: BackendTokenizer, fields: dict[str, object], add_cls: bool
) -> processors.TemplateProcessing | None:
    """BERT's post-processor: "[CLS] A [SEP]", and "[CLS] A [SEP] B [SEP]" with B and its [SEP] of type 1. [CLS] is
    the file's BOS (llama.cpp's converter names it so), [SEP] its separator, else the tokens of those names."""

    def named(key: str, fallback: str) -> tuple[str, int] | None:
        token_id = fields.get(f"tokenizer.ggml.{key}")
        if isinstance(token_id, int):
            token = backend.id_to_token(token_id)
            return None if token is None else (token, token_id)
        token_id = backend.token_to_id(fallback)
        return None if token_id is None else (fallback, token_id)

    cls, sep = named("bos_token_id", "[CLS]"), named("seperator_token_id", "[SEP]")  # llama.cpp's spelling
    if sep is None:
        return None
    head = [cls[0]] if add_cls and cls is not None else []
    return processors.TemplateProcessing(
        single=[*head, "$A", sep[0]],
        pair=[*head, "$A", sep[0], "$B:1", f"{sep[0]}:1"],
        special_tokens=[token for token in (cls if head else None, sep) if token is not None],
    )


def _add_gguf_tokens(
    backend: BackendTokenizer,
    tokens: list[str],
    token_types: list[int],
    named: dict[str, int | None],
    *,
    byte_level: bool,
) -> None:
    """Mark control tokens (and the named bos/eos/unk/pad/eot/eom) special; match user-defined tokens whole.

    In a byte-level vocabulary a "control" token spelled outside the byte alphabet is a converter mislabel,
    not a real control token, and is left alone (as transformers does).
    """
    special_ids = {index for index, token_type in enumerate(token_types) if token_type == _TOKEN_TYPE_CONTROL}
    special_ids |= {token_id for token_id in named.values() if token_id is not None}
    special = [
        AddedToken(tokens[index], normalized=False, special=True)
        for index in sorted(special_ids)
        if not byte_level or set(tokens[index]) <= _BYTE_ALPHABET_CHARS
    ]
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for index, (token, token_type) in enumerate(zip(tokens, token_types))
        if token_type == _TOKEN_TYPE_USER_DEFINED and index not in special_ids
    ]
    if special:
        backend.add_special_tokens(special)
    if user_defined:
        backend.add_tokens(user_defined)


def _bos_eos_processor(
    bos: tuple[str, int] | None, eos: tuple[str, int] | None
) -> processors.TemplateProcessing | None:
    """Post-processor that wraps an encoding in BOS/EOS, or None when the model wants neither."""
    if bos is None and eos is None:
        return None
    head = [bos[0]] if bos else []
    tail = [eos[0]] if eos else []
    return processors.TemplateProcessing(
        single=[*head, "$A", *tail],
        pair=[*head, "$A", *tail, *head, "$B:1", *tail],
        special_tokens=[token for token in (bos, eos) if token is not None],
    )


# ----- folder assembly --------------------------------------------------------------------------------


def _read_json_object(folder: str, name: str) -> dict[str, Any]:
    """An optional JSON file of the folder as a dict ({} when absent); a damaged one is an error."""
    file = os.path.join(folder, name)
    if not os.path.isfile(file):
        return {}
    try:
        with open(file, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"{file} is not valid JSON: {error}", path=file) from error
    if not isinstance(data, dict):
        raise ModelLoadError(f"{file} must hold a JSON object, got {type(data).__name__}.", path=file)
    return data


def _token_content(value: object) -> str | None:
    """A named token as tokenizer_config.json writes it: a string or an AddedToken dict with "content"."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _int_list(value: object, folder: str, name: str) -> list[int]:
    """generation_config.json's eos_token_id: absent, one id, or a list of ids."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ModelLoadError(
            f"{os.path.join(folder, name)}: eos_token_id must be an int or a list of ints, got {value!r}.",
            path=os.path.join(folder, name),
        )
    return values


def _folder_chat_template(folder: str, config: dict[str, Any]) -> str | None:
    """chat_template.jinja wins over tokenizer_config.json (as in transformers); a named list picks "default"."""
    jinja_file = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        try:
            with open(jinja_file, encoding="utf-8") as handle:
                return handle.read()
        except (OSError, UnicodeDecodeError) as error:
            raise ModelLoadError(f"{jinja_file} cannot be read: {error}", path=jinja_file) from error
    template = config.get("chat_template")
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) else None
    return None
