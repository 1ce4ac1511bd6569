"""SamplingParams: how one request turns logits into tokens and when it stops.

Validated on construction: a bad value raises `InvalidParameterError` naming
the field, the value and the allowed range, so no entry point (CLI, Python,
HTTP) can hand the engine something it would have to guess about. A field the
command line offers carries its flag's help in its metadata (flags.option), so
`tokenriver generate` and `chat` build their sampling flags from these fields.
Stdlib only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

from tokenriver.errors import InvalidParameterError
from tokenriver.flags import list_option, option

MAX_LOGPROBS = 20
DEFAULT_TRACE_TOP = 10
# Temperatures below this act as greedy (as in vLLM): dividing float32 logits by less overflows.
GREEDY_TEMPERATURE = 1e-5
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
# early_stopping's values (transformers' meanings); the command line types the booleans as text.
EARLY_STOPPING_VALUES: tuple[bool | str, ...] = (True, False, "never")
_EARLY_STOPPING_TEXT = {"true": True, "false": False, "never": "never"}
# Controls that reshape the distribution; beam search ranks beams by raw log-probabilities, so it refuses them.
_NOT_WITH_BEAM_SEARCH = {
    "best_of": None,
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "logit_bias": None,
    "prompt_logprobs": None,
    "trace": False,
    "trace_stages": False,
}


# How JSON constraints are written (llguidance's options; a schema's "x-guidance"): compactly, one space after ','
# and ':'. With free whitespace a small model can spend its whole token budget on newlines inside a valid document.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# StructuredOutput.kind values: what the text of a StructuredOutput holds.
STRUCTURED_OUTPUT_KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the generated text, enforced token by token by a grammar (sampling/grammar.py).

    Kept as text so that equal constraints compile once: the engine caches compiled grammars by (kind, text).
    Only the shape is checked here; whether the schema, regex or grammar compiles is checked when the request
    is submitted, where the tokenizer is known.
    """

    # One of STRUCTURED_OUTPUT_KINDS.
    kind: str
    # json_schema: the schema as JSON text; regex: the pattern; choice: a JSON list of the allowed strings;
    # grammar: a Lark grammar, or a GBNF one (converted); json_object: "" (any JSON object).
    text: str = ""
    # The constraint applies only after these tokens appear in the output (a reasoning model's end of thinking,
    # e.g. the tokens of "</think>"); empty = from the first generated token.
    starts_after: tuple[int, ...] = ()
    # Output the constraint has already covered: a generation continued from a prompt that ends with its own
    # earlier output (a branch or replay in the visualizer). The grammar consumes these tokens before the output.
    prefix_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_OUTPUT_KINDS:
            _fail("structured_output", self.kind, f"the kind must be one of {', '.join(STRUCTURED_OUTPUT_KINDS)}")
        if not isinstance(self.text, str):
            _fail("structured_output", self.text, "the constraint must be given as text")
        if not all(_is_int(token_id) and token_id >= 0 for token_id in self.starts_after):
            _fail("structured_output", self.starts_after, "starts_after must hold token ids (integers >= 0)")
        if not all(_is_int(token_id) and token_id >= 0 for token_id in self.prefix_token_ids):
            _fail("structured_output", self.prefix_token_ids, "prefix_token_ids must hold token ids (integers >= 0)")
        if self.kind in ("regex", "grammar") and not self.text:
            _fail("structured_output", self.text, f"a {self.kind} constraint needs a non-empty {self.kind}")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.text)
            except ValueError as error:
                _fail("structured_output", self.text, f"the JSON schema is not valid JSON ({error})")
            if not isinstance(schema, (dict, bool)):
                _fail("structured_output", self.text, "a JSON schema must be a JSON object")
        if self.kind == "choice":
            try:
                choices = json.loads(self.text)
            except ValueError:
                choices = None
            if (
                not isinstance(choices, list)
                or not choices
                or not all(isinstance(choice, str) and choice for choice in choices)
            ):
                _fail("structured_output", self.text, "choice must be a non-empty list of non-empty strings")

    @classmethod
    def json(cls, schema: dict | str | bool) -> StructuredOutput:
        """Output that validates against a JSON schema (a dict, or its JSON text)."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> StructuredOutput:
        """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        """Output that the whole regex matches."""
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: list[str]) -> StructuredOutput:
        """Exactly one of the given strings."""
        if not isinstance(choices, (list, tuple)):
            _fail("structured_output", choices, "choice must be a non-empty list of non-empty strings")
        return cls("choice", json.dumps(list(choices)))

    @classmethod
    def grammar(cls, text: str) -> StructuredOutput:
        """Output in the language of a Lark grammar (llguidance's dialect) or of a GBNF grammar."""
        return cls("grammar", text)


def _fail(name: str, value: object, rule: str) -> None:
    raise InvalidParameterError(f"{name}={value!r} is invalid: {rule}", param=name)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SamplingParams:
    """Sampling and stopping controls of one request (vLLM's names and meanings)."""

    # Candidates returned per prompt.
    n: int = option(1, "candidates returned per prompt")
    # Candidates generated; the `n` with the highest cumulative log-probability are returned. None = n.
    best_of: int | None = option(
        None, "candidates generated; the n with the highest cumulative log-probability are returned"
    )
    # 0 means greedy (argmax), and so does anything below 1e-5; otherwise logits are divided by it.
    temperature: float = option(1.0, "0 = greedy; higher flattens the distribution")
    # Keep the k most likely tokens; 0 or -1 turns it off.
    top_k: int = option(0, "keep the k most likely tokens (0 = off)")
    # Keep the smallest set of tokens whose probability adds up to at least top_p.
    top_p: float = option(1.0, "keep the smallest set of tokens whose probability reaches top-p")
    # Drop tokens whose probability is below min_p times the top token's.
    min_p: float = option(0.0, "drop tokens below min-p times the top token's probability")
    # transformers' multiplicative penalty on tokens seen in prompt or output (>1 discourages).
    repetition_penalty: float = option(1.0, "transformers' repetition penalty (>1 discourages repeats)")
    # OpenAI's additive penalty on tokens already generated (once per token).
    presence_penalty: float = option(0.0, "OpenAI presence penalty, -2..2")
    # OpenAI's additive penalty proportional to how often a token was generated.
    frequency_penalty: float = option(0.0, "OpenAI frequency penalty, -2..2")
    # Added to the logits of the given token ids before sampling.
    logit_bias: dict[int, float] | None = option(None, "TOKEN_ID:BIAS added to that token's logit (repeatable)")
    # Per-request random seed: the request's tokens then do not depend on its neighbours in the batch.
    seed: int | None = option(None, "random seed of this request")
    # Maximum number of generated tokens; None = until EOS or the context is full.
    max_tokens: int | None = option(16, "most tokens to generate")
    # EOS, stop tokens and stop strings are ignored until this many tokens were generated.
    min_tokens: int = option(0, "EOS and stops are ignored until this many tokens were generated")
    # Strings that end generation; cut from the text unless include_stop_str_in_output.
    stop: list[str] = list_option("stop string (repeatable)")
    # Token ids that end generation (kept in token_ids, and in text unless special).
    stop_token_ids: list[int] = list_option("token ids that end generation")
    # Keep generating past the model's end-of-sequence tokens.
    ignore_eos: bool = option(False, "keep generating past end-of-sequence tokens")
    # Number of top alternatives returned per generated token (None = no logprobs).
    logprobs: int | None = option(None, "print the top-N alternatives of every generated token")
    # Number of top alternatives returned per prompt token (None = none).
    prompt_logprobs: int | None = option(None, "top-N alternatives of every prompt token")
    # Drop special tokens (such as <|im_end|>) from the text.
    skip_special_tokens: bool = option(True, "drop special tokens from the text")
    # Keep the matched stop string at the end of the text.
    include_stop_str_in_output: bool = option(False, "keep the matched stop string in the text")
    # Record a StepTrace per generated token (the "why this token" data).
    trace: bool = option(False, "print why each token was chosen: a compact table per step")
    # How many candidates each StepTrace keeps.
    trace_top: int = option(DEFAULT_TRACE_TOP, "candidates shown per step with --trace")
    # With trace: also record each sampling stage's distribution over the traced candidates (StepTrace.stages).
    trace_stages: bool = False
    # Beam search with this many beams (None = off): the n best finished beams are returned, ranked by
    # cumulative log-probability / (generated length ** length_penalty), as transformers' generate(num_beams=...).
    beam_width: int | None = option(
        None, "beam search with this many beams (transformers' num_beams); the n best beams are returned"
    )
    # Beam search: exponent of the length normalization (> 0 favours longer beams, < 0 shorter, 0 = none).
    length_penalty: float = option(
        1.0, "beam search: beams score sum(logprobs) / length ** length-penalty (>0 favours longer)"
    )
    # Beam search: True stops once beam_width beams finished; False (transformers' default) also stops when
    # the best running beam, scored at its current length, cannot beat the worst finished one; "never" stops
    # only when no running beam can possibly do so.
    early_stopping: bool | str = option(False, "beam search: true, false or never (transformers' meanings)")
    # Beam search: record every step's beams, their ranked continuations and which survived
    # (RequestOutput.beam_steps), so a reader sees why the final beams won.
    beam_trace: bool = False
    # Constrain the output to a JSON schema, regex, choice or grammar (None = free text).
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.early_stopping, str) and self.early_stopping.lower() in _EARLY_STOPPING_TEXT:
            self.early_stopping = _EARLY_STOPPING_TEXT[self.early_stopping.lower()]
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.logit_bias is not None:
            self.logit_bias = dict(self.logit_bias)
        self._validate()

    @property
    def num_generated(self) -> int:
        """How many candidates the engine runs for this request (best_of or n)."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def use_beam_search(self) -> bool:
        return self.beam_width is not None

    def _validate(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            _fail("n", self.n, "must be an integer >= 1")
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of < self.n):
            _fail("best_of", self.best_of, f"must be an integer >= n ({self.n})")
        if not _is_number(self.temperature) or self.temperature < 0:
            _fail("temperature", self.temperature, "must be a number >= 0 (0 = greedy)")
        if self.num_generated > 1 and self.is_greedy and not self.use_beam_search:
            _fail(
                "temperature",
                self.temperature,
                "greedy sampling gives the same candidate every time; use temperature > 0 with n or best_of > 1",
            )
        if not _is_int(self.top_k) or self.top_k < -1:
            _fail("top_k", self.top_k, "must be an integer >= 1, or 0 / -1 to turn it off")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            _fail("top_p", self.top_p, "must be in (0, 1]")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            _fail("min_p", self.min_p, "must be in [0, 1]")
        if (
            not _is_number(self.repetition_penalty)
            or not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY
        ):
            _fail(
                "repetition_penalty",
                self.repetition_penalty,
                f"must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}] (1 = off, > 1 discourages repeats)",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                _fail(name, value, "must be in [-2, 2]")
        if self.logit_bias is not None:
            for token_id, bias in self.logit_bias.items():
                if not _is_int(token_id) or token_id < 0:
                    _fail("logit_bias", self.logit_bias, f"key {token_id!r} must be a token id (integer >= 0)")
                if not _is_number(bias) or not -100 <= bias <= 100:
                    _fail("logit_bias", self.logit_bias, f"bias {bias!r} for token {token_id} must be in [-100, 100]")
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**63):
            _fail("seed", self.seed, "must be a 64-bit integer (-2**63 .. 2**63-1) or None")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            _fail("max_tokens", self.max_tokens, "must be an integer >= 1, or None to run until EOS")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            _fail("min_tokens", self.min_tokens, "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", self.min_tokens, f"must be <= max_tokens ({self.max_tokens})")
        for text in self.stop:
            if not isinstance(text, str) or not text:
                _fail("stop", self.stop, "must be a list of non-empty strings")
        for token_id in self.stop_token_ids:
            if not _is_int(token_id) or token_id < 0:
                _fail("stop_token_ids", self.stop_token_ids, "must be a list of token ids (integers >= 0)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                _fail(name, value, f"must be an integer in [0, {MAX_LOGPROBS}] or None")
        for name in (
            "ignore_eos",
            "skip_special_tokens",
            "include_stop_str_in_output",
            "trace",
            "trace_stages",
            "beam_trace",
        ):
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "must be true or false")
        if not _is_int(self.trace_top) or not 1 <= self.trace_top <= 100:
            _fail("trace_top", self.trace_top, "must be an integer in [1, 100]")
        if self.trace_stages and not self.trace:
            _fail("trace_stages", self.trace_stages, "records the stages into the trace: set trace as well")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            _fail("structured_output", self.structured_output, "must be a StructuredOutput or None")
        if self.structured_output is not None and self.min_tokens:
            _fail(
                "min_tokens",
                self.min_tokens,
                "cannot be combined with structured output: the grammar decides where the output ends",
            )
        self._validate_beam_search()

    def _validate_beam_search(self) -> None:
        if not _is_number(self.length_penalty):
            _fail("length_penalty", self.length_penalty, "must be a finite number (1 = transformers' default)")
        if not any(self.early_stopping is value for value in EARLY_STOPPING_VALUES):
            _fail("early_stopping", self.early_stopping, 'must be true, false or "never"')
        if self.beam_width is None:
            if self.beam_trace:
                _fail("beam_trace", self.beam_trace, "records a beam search's steps: set beam_width as well")
            return
        if not _is_int(self.beam_width) or self.beam_width < 1:
            _fail("beam_width", self.beam_width, "must be an integer >= 1, or None to turn beam search off")
        if self.n > self.beam_width:
            _fail("n", self.n, f"must be <= beam_width ({self.beam_width}): beam search returns its n best beams")
        if self.temperature not in (0, 1):
            _fail(
                "temperature",
                self.temperature,
                "beam search ranks beams by raw log-probabilities: leave temperature at 0 or 1 with beam_width",
            )
        for name, off in _NOT_WITH_BEAM_SEARCH.items():
            if getattr(self, name) != off:
                _fail(name, getattr(self, name), f"is not supported with beam search (beam_width); leave it at {off}")

    def validate_for_engine(self, vocab_size: int, max_num_seqs: int) -> None:
        """What only a running engine can judge: token ids against its vocabulary, beams against its batch. The engine
        checks every request with it; the server calls it too, to refuse a request before it is queued."""
        self.validate_for_vocab(vocab_size)
        if self.beam_width is not None and self.beam_width > max_num_seqs:
            _fail(
                "beam_width",
                self.beam_width,
                f"a beam search runs that many requests at once, more than the engine does (max_num_seqs="
                f"{max_num_seqs}); lower beam_width, or start the engine with a larger max_num_seqs (--max-num-seqs)",
            )

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Token ids can only be checked once the model is known."""
        for token_id in self.logit_bias or {}:
            if token_id >= vocab_size:
                _fail(
                    "logit_bias", self.logit_bias, f"token id {token_id} is outside the vocabulary (size {vocab_size})"
                )
        for token_id in self.stop_token_ids:
            if token_id >= vocab_size:
                _fail(
                    "stop_token_ids",
                    self.stop_token_ids,
                    f"token id {token_id} is outside the vocabulary (size {vocab_size})",
                )
        for token_id in self.structured_output.prefix_token_ids if self.structured_output else ():
            if token_id >= vocab_size:
                _fail(
                    "structured_output_prefix_ids",
                    list(self.structured_output.prefix_token_ids),
                    f"token id {token_id} is outside the vocabulary (size {vocab_size})",
                )


def holds_stop_tokens(params: SamplingParams, num_output_tokens: int, eos_token_ids: Sequence[int]) -> bool:
    """min_tokens not reached yet, with EOS or stop tokens for the sampler to hold back."""
    return num_output_tokens < params.min_tokens and bool(eos_token_ids or params.stop_token_ids)


def is_plain_greedy(params: SamplingParams, num_output_tokens: int, eos_token_ids: Sequence[int]) -> bool:
    """Whether the next token is the raw logits' argmax and nothing but its logprob is reported: greedy, with no
    logprobs, trace, penalty or bias, and no min_tokens hold at this length. A grammar only narrows the argmax to
    the tokens it allows: the raw argmax stands when allowed, and the sampler takes the masked logits only when it
    is not. The one definition both users share: the sampler answers such rows from per-row reductions, and the
    scheduler may decode them several passes a step (the runner then fills a constrained request's mask before
    each pass's sampling).

    eos_token_ids: the ids the sampler holds back before min_tokens ([] when the request ignores EOS)."""
    reads_only_the_argmax = (
        params.is_greedy
        and not params.logprobs
        and not params.trace
        and params.repetition_penalty == 1.0
        and params.presence_penalty == 0
        and params.frequency_penalty == 0
        and not params.logit_bias
    )
    return reads_only_the_argmax and not holds_stop_tokens(params, num_output_tokens, eos_token_ids)


# PoolingParams.pooling values: which positions' final hidden states make a request's one vector.
POOLING_TYPES: tuple[str, ...] = ("last", "mean", "cls")
# PoolingParams.task values: a vector per input, or one relevance score per (query, document) input.
POOLING_TASKS: tuple[str, ...] = ("embed", "score")


@dataclass(frozen=True)
class PoolingParams:
    """How one request turns its prompt's final hidden states into a vector or a score instead of tokens.

    A pooling request runs its whole prompt in one forward pass and finishes there: no token is generated and
    no KV block outlives the step (engine/core.py, sched/scheduler.py).
    """

    # "embed": the pooled hidden state (an embedding). "score": a relevance score of a (query, document) prompt,
    # from the model's classification head (a cross-encoder) or from the yes/no logits of `score_token_ids`.
    task: str = "embed"
    # "last" (the last token: causal models), "mean" (every token), "cls" (the first token: encoders);
    # None = what the model file asks for, else "last" for causal models and "cls" for encoders.
    pooling: str | None = None
    # Scale the embedding to unit length (cosine similarity becomes a dot product).
    normalize: bool = True
    # Keep only the first `dimensions` values before normalizing (Matryoshka embeddings); None = all.
    dimensions: int | None = None
    # task "score" on a causal model: (no, yes) token ids; the score is P(yes) / (P(yes) + P(no)) at the last
    # position (Qwen3-Reranker's rule).
    score_token_ids: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            _fail("task", self.task, f"use one of {', '.join(POOLING_TASKS)}")
        if self.pooling is not None and self.pooling not in POOLING_TYPES:
            _fail("pooling", self.pooling, f"use one of {', '.join(POOLING_TYPES)}")
        if self.dimensions is not None and (not _is_int(self.dimensions) or self.dimensions < 1):
            _fail("dimensions", self.dimensions, "must be an integer >= 1")
        if self.score_token_ids is not None and (
            len(self.score_token_ids) != 2 or not all(_is_int(t) and t >= 0 for t in self.score_token_ids)
        ):
            _fail("score_token_ids", self.score_token_ids, "must be two token ids: (no, yes)")

    def validate_for_model(self, *, model_name: str, is_causal: bool, num_labels: int, hidden_size: int) -> None:
        """What only the model can judge: whether it can score, and how wide its embeddings are. The engine checks
        every pooling request with it; the server calls it too, to refuse a request before its inputs are queued."""
        if self.task == "score":
            if is_causal and self.score_token_ids is None:
                raise InvalidParameterError(
                    "scoring with a causal model reads the logits of its (no, yes) tokens: give score_token_ids",
                    param="score_token_ids",
                )
            if not is_causal and num_labels not in (1, 2):
                raise InvalidParameterError(
                    f"this model ({model_name}) is an embedding model without a reranking head: serve a cross-encoder "
                    f"(a sequence-classification model such as a BERT reranker) or a causal model to rerank",
                    param="model",
                )
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise InvalidParameterError(
                f"dimensions={self.dimensions} but this model's embeddings have {hidden_size}", param="dimensions"
            )
