"""Sampler: one token per row of a batch of logits, each row the way its request asked.

Owns the processing order, the random draw, the raw logprobs and the per-step
trace. Receives logits and one `SamplingState` per row; returns plain Python
results. It knows nothing about the KV cache, the scheduler or the tokenizer.

Invariants:
- The caller's logits are never modified.
- A row's token depends only on its own logits, state and random stream: a
  row with its own generator draws exactly one uniform from it per sampled
  step, so a seeded request gives the same tokens alone, in any batch, at any
  row index. Greedy rows draw nothing.
- Stages no row uses are skipped, and each stage runs only on the rows that use
  it; a batch of greedy rows without penalties costs an argmax and a logsumexp
  (one native pass per row when the runner hands the sampler its kernels), and
  such a batch (`all_plain_greedy`) can be answered from those three numbers per
  row without logits at all (`sample_reduced`; the runner asks the model for them).
- Logprobs and ranks are those of the raw distribution (log_softmax of the
  unprocessed logits), as OpenAI and vLLM report them.

Speculative decoding's verification lives in verify.py and the per-step trace in
tracer.py; both run the stages defined here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenriver.outputs import TokenLogprobs
from tokenriver.params import holds_stop_tokens, is_plain_greedy
from tokenriver.sampling import processors, verify
from tokenriver.sampling.rows import SampleResult, SamplingState, draw_rows, raw_logprobs, select_rows
from tokenriver.sampling.tracer import Tracer
from tokenriver.sampling.verify import DraftCheck, VerifyResult
from tokenriver.trace import StepTrace

__all__ = ["DraftCheck", "SampleResult", "Sampler", "SamplingState", "VerifyResult"]

# prompt_logprobs compares every row against the whole vocabulary: chunks bound the [rows, V] temporaries.
PROMPT_LOGPROBS_CHUNK = 256
# A traced draw lists this many tokens with probability on each side of the chosen one (in token-id order).
NUM_DRAW_NEIGHBORS = 4


class _Logits:
    """The batch's logits on their way through the stages.

    The caller's tensor is copied on the first update that touches only some rows; later updates write in place.
    """

    def __init__(self, raw: torch.Tensor) -> None:
        self.tensor = raw
        self._is_owned = False

    def update(self, rows: list[int], process: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace `rows` by process(their logits); every other row stays bit-for-bit as it was."""
        if len(rows) == self.tensor.shape[0]:
            self.tensor = process(self.tensor)  # processors always return a new tensor
            self._is_owned = True
            return
        if not self._is_owned:
            self.tensor = self.tensor.clone()
            self._is_owned = True
        index = torch.tensor(rows, dtype=torch.int64)  # [n]
        self.tensor[index] = process(self.tensor[index])


# Per row: argmax [N] int64, max [N] and logsumexp [N] float32.
RowReductionsResult = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
# logits [N, V] → RowReductionsResult in one pass, or None to take PyTorch's reductions instead.
RowReductions = Callable[[torch.Tensor], "RowReductionsResult | None"]


def torch_row_reductions(logits: torch.Tensor) -> RowReductionsResult:
    """RowReductions in PyTorch ops, for devices without the native kernels: a greedy batch on a GPU then takes its
    tokens from these instead of the general path's dozen small launches. torch.argmax takes the first of equal
    maxima, as the general path's argmax does. The log-sum-exp comes from log_softmax, whose rows PyTorch computes
    one at a time: torch.logsumexp splits a lone row's sum across threads, so a row's value would depend on its
    batch."""
    argmax = logits.argmax(dim=-1)  # [N]
    largest = logits.gather(-1, argmax[:, None])  # [N, 1]
    return (
        argmax,
        largest.squeeze(-1),
        (largest - torch.log_softmax(logits, dim=-1).gather(-1, argmax[:, None])).squeeze(-1),
    )


# The rows each logits-changing stage of Sampler.process_logits applies to.
def _has_repetition_penalty(state: SamplingState) -> bool:
    return state.params.repetition_penalty != 1.0


def _has_presence_or_frequency_penalty(state: SamplingState) -> bool:
    return state.params.presence_penalty != 0 or state.params.frequency_penalty != 0


def _has_logit_bias(state: SamplingState) -> bool:
    return bool(state.params.logit_bias)


def _allows(state: SamplingState, token_id: int) -> bool:
    """Whether the row's grammar (if any) allows token_id next."""
    if state.allowed_token_mask is not None:
        return processors.allows(state.allowed_token_mask, token_id)
    return state.grammar is None or state.grammar.accepts(token_id)


# A stage's work on its rows' logits [n, V] → [n, V]: a processor with the stage's per-row arguments bound.
Process = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class _StageBatch:
    """What every stage reads while process_logits runs: the rows' states, the logits so far and the tracer."""

    states: list[SamplingState]
    vocab_size: int
    device: torch.device
    dtype: torch.dtype
    work: _Logits
    tracer: Tracer | None


@dataclass(frozen=True)
class _Stage:
    """One stage of Sampler.process_logits: which rows it applies to, and its processor bound to those rows."""

    name: str  # its name in trace.STAGES
    applies: Callable[[SamplingState, int], bool]  # (state, vocab_size): whether the row needs this stage
    prepare: Callable[[list[int], _StageBatch], Process]  # the stage's arguments for these rows, bound
    # Temperature and the filters shape the distribution a sampled row draws from: greedy rows skip them, and
    # they do not count as changing a row's logits (the raw argmax still holds).
    is_sampling_only: bool = False


def _run_stage(stage: _Stage, batch: _StageBatch, modified_rows: set[int]) -> None:
    """The bookkeeping every stage shares: pick its rows, apply it to them only, trace it, note what it changed."""
    rows = [
        i
        for i, s in enumerate(batch.states)
        if not (stage.is_sampling_only and s.params.is_greedy) and stage.applies(s, batch.vocab_size)
    ]
    if not rows:
        return
    process = stage.prepare(rows, batch)
    batch.work.update(rows, process)
    if batch.tracer:
        batch.tracer.record(stage.name, batch.work.tensor, rows)
    if not stage.is_sampling_only:
        modified_rows.update(rows)


def _prepare_repetition_penalty(rows: list[int], batch: _StageBatch) -> Process:
    """Penalize every token already in the prompt or the output, as the row's repetition_penalty asks."""
    states, device = batch.states, batch.device
    history = processors.pad_token_ids(
        [states[i].prompt_token_ids + states[i].output_token_ids for i in rows], batch.vocab_size, device
    )  # [n, L]
    penalty = torch.tensor([states[i].params.repetition_penalty for i in rows], device=device)  # [n]
    return lambda x: processors.apply_repetition_penalty(x, history, penalty)


def _prepare_presence_frequency_penalties(rows: list[int], batch: _StageBatch) -> Process:
    """Subtract OpenAI's presence and frequency penalties, which count the output tokens only."""
    states, device = batch.states, batch.device
    outputs = [states[i].output_token_ids for i in rows]
    generated = processors.pad_token_ids(outputs, batch.vocab_size, device)  # [n, L]
    presence = torch.tensor([states[i].params.presence_penalty for i in rows], device=device)  # [n]
    frequency = torch.tensor([states[i].params.frequency_penalty for i in rows], device=device)  # [n]
    return lambda x: processors.apply_presence_frequency_penalties(x, generated, presence, frequency)


def _prepare_logit_bias(rows: list[int], batch: _StageBatch) -> Process:
    """Add each row's logit_bias, padded to one width so the batch adds them in one op."""
    biases = [batch.states[i].params.logit_bias or {} for i in rows]
    bias_ids = processors.pad_token_ids([list(b) for b in biases], batch.vocab_size, batch.device)  # [n, M]
    width = bias_ids.shape[1]
    bias_values = torch.tensor(
        [list(b.values()) + [0.0] * (width - len(b)) for b in biases], dtype=batch.dtype, device=batch.device
    )  # [n, M], the padding adds 0 to the dropped column
    return lambda x: processors.apply_logit_bias(x, bias_ids, bias_values)


def _prepare_min_tokens(rows: list[int], batch: _StageBatch) -> Process:
    """Block EOS and the stop tokens until the row has its min_tokens of output."""
    states, device = batch.states, batch.device
    blocked = processors.pad_token_ids(
        [states[i].eos_token_ids + states[i].params.stop_token_ids for i in rows], batch.vocab_size, device
    )  # [n, M]
    num_output = torch.tensor([len(states[i].output_token_ids) for i in rows], device=device)  # [n]
    min_tokens = torch.tensor([states[i].params.min_tokens for i in rows], device=device)  # [n]
    return lambda x: processors.apply_min_tokens(x, blocked, num_output, min_tokens)


def _prepare_grammar(rows: list[int], batch: _StageBatch) -> Process:
    """Keep only the tokens each row's grammar allows next; the trace notes what that removes before it runs."""
    masks = torch.stack([batch.states[i].allowed_token_mask for i in rows]).to(batch.device)  # [n, W], from the host
    allowed = processors.allowed_tokens(masks, batch.vocab_size)  # [n, V]
    if batch.tracer:
        batch.tracer.note_grammar(rows, select_rows(batch.work.tensor, rows), allowed)
    return lambda x: processors.apply_allowed_tokens(x, allowed)


def _prepare_temperature(rows: list[int], batch: _StageBatch) -> Process:
    """Divide by each row's temperature, flattening or sharpening what it draws from."""
    temperature = torch.tensor([batch.states[i].params.temperature for i in rows], device=batch.device)  # [n]
    return lambda x: processors.apply_temperature(x, temperature)


def _prepare_top_k(rows: list[int], batch: _StageBatch) -> Process:
    """Keep each row's top_k most likely tokens."""
    top_k = torch.tensor([batch.states[i].params.top_k for i in rows], device=batch.device)  # [n]
    return lambda x: processors.apply_top_k(x, top_k)


def _prepare_top_p(rows: list[int], batch: _StageBatch) -> Process:
    """Keep the smallest set of tokens whose probability reaches each row's top_p."""
    top_p = torch.tensor([batch.states[i].params.top_p for i in rows], device=batch.device)  # [n]
    return lambda x: processors.apply_top_p(x, top_p)


def _prepare_min_p(rows: list[int], batch: _StageBatch) -> Process:
    """Drop the tokens less likely than min_p times the row's most likely one."""
    min_p = torch.tensor([batch.states[i].params.min_p for i in rows], device=batch.device)  # [n]
    return lambda x: processors.apply_min_p(x, min_p)


# The stages whose result is the trace's processed logits (TraceCandidate.logit_processed), in order.
_ADJUSTING_STAGES: tuple[_Stage, ...] = (
    _Stage("penalty", lambda s, _: _has_repetition_penalty(s), _prepare_repetition_penalty),
    _Stage("penalty", lambda s, _: _has_presence_or_frequency_penalty(s), _prepare_presence_frequency_penalties),
    _Stage("bias", lambda s, _: _has_logit_bias(s), _prepare_logit_bias),
)
# The stages after them, in order: a greedy row takes the argmax after the grammar, a sampled row draws after min-p.
_SELECTING_STAGES: tuple[_Stage, ...] = (
    _Stage(
        "min_tokens",
        lambda s, _: holds_stop_tokens(s.params, len(s.output_token_ids), s.eos_token_ids),
        _prepare_min_tokens,
    ),
    _Stage("grammar", lambda s, _: s.allowed_token_mask is not None, _prepare_grammar),
    _Stage("temperature", lambda s, _: s.params.temperature != 1.0, _prepare_temperature, is_sampling_only=True),
    _Stage("top_k", lambda s, vocab_size: 0 < s.params.top_k < vocab_size, _prepare_top_k, is_sampling_only=True),
    _Stage("top_p", lambda s, _: s.params.top_p < 1.0, _prepare_top_p, is_sampling_only=True),
    _Stage("min_p", lambda s, _: s.params.min_p > 0.0, _prepare_min_p, is_sampling_only=True),
)


class Sampler:
    """Turns a step's logits into tokens, logprobs and traces."""

    def __init__(self, default_generator: torch.Generator, row_reductions: RowReductions | None = None) -> None:
        # Rows without a seed draw from this one stream, in batch order.
        self.default_generator = default_generator
        # A faster argmax + logsumexp of raw logits rows (the native kernels'), same argmax, logsumexp within
        # float rounding; the runner passes it where the kernels are built.
        self.row_reductions = row_reductions

    def log_normalizers(self, logits: torch.Tensor) -> torch.Tensor:
        """logsumexp of each row of logits [N, V] → [N], from the row reductions: one arithmetic per row, so a
        logprob does not depend on the rows it was computed with (a batch, a verification, a prompt chunk)."""
        reduced = self.row_reductions(logits) if self.row_reductions is not None else None
        return (reduced if reduced is not None else torch_row_reductions(logits))[2]

    @staticmethod
    def all_plain_greedy(states: list[SamplingState]) -> bool:
        """Whether every row is plain greedy (params.is_plain_greedy): it takes its raw argmax and reports nothing
        but that token's logprob (greedy, no logprobs, no trace, no stage that would change its logits). Such a
        batch needs, per row, only the argmax, the largest logit and the log-sum-exp (`sample_reduced`), which a
        model can compute without writing its logits."""
        return all(is_plain_greedy(state.params, len(state.output_token_ids), state.eos_token_ids) for state in states)

    @staticmethod
    def sample_reduced(reduced: RowReductionsResult, states: list[SamplingState]) -> list[SampleResult | None]:
        """The rows of a batch that is `all_plain_greedy`, from (argmax [N], max [N], logsumexp [N]): each takes its
        argmax, whose logprob is the row's max minus its log-normalizer.

        A row whose grammar does not allow its argmax gets None: its token is the argmax of the masked logits,
        which the reductions cannot tell (the caller samples that row from its logits). An allowed raw argmax is
        the masked argmax too, first index among equal maxima included."""
        argmax, max_logits, log_normalizer = reduced
        if argmax.shape[0] != len(states):
            raise ValueError(f"reductions must have len(states)={len(states)} rows, got {argmax.shape[0]}")
        chosen = argmax.tolist()
        chosen_logprobs = (max_logits - log_normalizer).tolist()
        return [
            SampleResult(token_id, TokenLogprobs(token_id, logprob, 1), None) if _allows(state, token_id) else None
            for token_id, logprob, state in zip(chosen, chosen_logprobs, states)
        ]

    def sample(self, logits: torch.Tensor, states: list[SamplingState]) -> list[SampleResult]:
        """logits [N, V] float32, one row per state (the last position of each sampled request)."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits must be [len(states)={len(states)}, vocab_size], got {tuple(logits.shape)}")
        num_rows = len(states)
        if num_rows == 0:
            return []
        reduced = self.row_reductions(logits) if self.row_reductions is not None else None
        if reduced is None or not self.all_plain_greedy(states):
            return self._sample_processed(logits, states, reduced)
        # The common decode step: skips the general path's dozen small tensor ops, which show in single-stream
        # decode. Only rows whose grammar refuses their argmax go through it.
        results = self.sample_reduced(reduced, states)
        refused = [i for i, result in enumerate(results) if result is None]
        if refused:
            index = torch.tensor(refused, dtype=torch.int64)  # [r]
            subset = tuple(values[index] for values in reduced)
            for i, result in zip(refused, self._sample_processed(logits[index], [states[i] for i in refused], subset)):
                results[i] = result
        return results

    def _sample_processed(
        self, logits: torch.Tensor, states: list[SamplingState], reduced: RowReductionsResult | None
    ) -> list[SampleResult]:
        """Every stage on the logits, then the draw (sample's general path)."""
        num_rows = len(states)
        for state in states:
            if state.grammar is not None and state.allowed_token_mask is None:
                state.allowed_token_mask = state.grammar.mask()
        raw_argmax, raw_max, log_normalizer = reduced if reduced is not None else (None, None, None)
        traced_rows = [i for i, state in enumerate(states) if state.params.trace]
        tracer = Tracer(logits, traced_rows, states) if traced_rows else None
        processed, modified_rows = self.process_logits(logits, states, tracer)

        token_ids = torch.empty(num_rows, dtype=torch.int64, device=logits.device)  # [N]
        greedy_rows = [i for i, state in enumerate(states) if state.params.is_greedy]
        sampled_rows = [i for i, state in enumerate(states) if not state.params.is_greedy]
        # A greedy row no stage changed takes the raw argmax when the reductions gave it; the rest take processed's.
        argmax_rows = greedy_rows
        if raw_argmax is not None:
            known = [i for i in greedy_rows if i not in modified_rows]
            argmax_rows = [i for i in greedy_rows if i in modified_rows]
            if known:
                token_ids[known] = raw_argmax[known]
        if argmax_rows:
            token_ids[argmax_rows] = select_rows(processed, argmax_rows).argmax(dim=1)
        if sampled_rows:
            uniforms = self.uniforms([states[i] for i in sampled_rows])  # [n]
            token_ids[sampled_rows] = draw_rows(select_rows(processed, sampled_rows).softmax(dim=1), uniforms)

        # Untouched greedy rows picked the raw argmax: nothing ranks above it, no need to count.
        is_rank_one = [state.params.is_greedy and i not in modified_rows for i, state in enumerate(states)]
        num_top = [state.params.logprobs or 0 for state in states]
        if log_normalizer is None:
            log_normalizer = torch_row_reductions(logits)[2]
        logprobs = raw_logprobs(logits, token_ids, num_top, is_rank_one, log_normalizer)
        traces = tracer.finish(processed, token_ids, states) if tracer else {}
        if sampled_rows and traces:
            _note_draws(traces, processed, token_ids, sampled_rows, uniforms)

        chosen = token_ids.tolist()
        return [SampleResult(chosen[i], logprobs[i], traces.get(i)) for i in range(num_rows)]

    def verify(self, logits: torch.Tensor, checks: list[DraftCheck]) -> list[VerifyResult]:
        """Accept or reject each request's draft tokens (see tokenriver.sampling.verify)."""
        return verify.verify(logits, checks, self.process_logits, self.uniforms, self.log_normalizers)

    def top_logprobs(
        self, logits: torch.Tensor, num_top: list[int], allowed_token_masks: list[torch.Tensor | None] | None = None
    ) -> list[list[TokenLogprobs]]:
        """The num_top[i] most likely tokens of row i under log_softmax of the raw logits, best first (beam search).

        logits [N, V]. Ranks are positions in that order (tied logits get consecutive ranks). A row with an
        allowed-token mask ([W] int32, its grammar's) ranks only the tokens its grammar allows, keeping their raw
        logprobs; fewer than num_top[i] come back when the grammar allows fewer.
        """
        if logits.dim() != 2 or logits.shape[0] != len(num_top):
            raise ValueError(f"logits must be [len(num_top)={len(num_top)}, vocab_size], got {tuple(logits.shape)}")
        if not num_top:
            return []
        log_normalizer = self.log_normalizers(logits).unsqueeze(1)  # [N, 1]
        masked_rows = [i for i, mask in enumerate(allowed_token_masks or []) if mask is not None]
        if masked_rows:
            # Grammars fill their masks on the host; they meet the logits where those are.
            masks = torch.stack([allowed_token_masks[i] for i in masked_rows]).to(logits.device)  # [m, W]
            logits = logits.clone()
            index = torch.tensor(masked_rows, dtype=torch.int64)  # [m]
            allowed = processors.allowed_tokens(masks, logits.shape[1])  # [m, V]
            logits[index] = processors.apply_allowed_tokens(logits[index], allowed)
        best = logits.topk(min(max(num_top), logits.shape[1]), dim=1)  # [N, k] values and indices
        logprobs = (best.values - log_normalizer).tolist()  # [N, k]
        token_ids = best.indices.tolist()
        return [
            [
                TokenLogprobs(token_ids[i][j], logprobs[i][j], j + 1)
                for j in range(min(count, logits.shape[1]))
                if logprobs[i][j] != float("-inf")
            ]
            for i, count in enumerate(num_top)
        ]

    def draw(self, logits: torch.Tensor, states: list[SamplingState]) -> tuple[list[int], torch.Tensor]:
        """One token per row, plus the processed distribution it was drawn from ([N, V], one-hot for greedy rows).

        What a draft model proposes with: the distribution is the q of the acceptance rule in `verify`.
        """
        processed, _ = self.process_logits(logits, states, None)
        probs = processed.softmax(dim=1)  # [N, V]
        token_ids = processed.argmax(dim=1)  # [N]
        sampled_rows = [i for i, state in enumerate(states) if not state.params.is_greedy]
        if sampled_rows:
            index = torch.tensor(sampled_rows, dtype=torch.int64)  # [n]
            token_ids[index] = draw_rows(probs[index], self.uniforms([states[i] for i in sampled_rows]))
        greedy_rows = [i for i, state in enumerate(states) if state.params.is_greedy]
        if greedy_rows:
            index = torch.tensor(greedy_rows, dtype=torch.int64)  # [g]
            probs[index] = torch.nn.functional.one_hot(token_ids[index], probs.shape[1]).to(probs.dtype)
        return token_ids.tolist(), probs

    def prompt_logprobs(self, logits: torch.Tensor, next_token_ids: list[int], num_top: int) -> list[TokenLogprobs]:
        """Raw logprob/rank of each actual next prompt token, plus top num_top alternatives.

        logits [T, V]: row t is the model's prediction after prompt position t, scored against next_token_ids[t].
        """
        if logits.dim() != 2 or logits.shape[0] != len(next_token_ids):
            raise ValueError(
                f"logits must be [len(next_token_ids)={len(next_token_ids)}, vocab_size], got {tuple(logits.shape)}"
            )
        if num_top < 0:
            raise ValueError(f"num_top={num_top} must be >= 0")
        results: list[TokenLogprobs] = []
        for start in range(0, len(next_token_ids), PROMPT_LOGPROBS_CHUNK):
            chunk_ids = next_token_ids[start : start + PROMPT_LOGPROBS_CHUNK]
            token_ids = torch.tensor(chunk_ids, dtype=torch.int64)  # [t]
            chunk = logits[start : start + len(chunk_ids)]  # [t, V]
            results += raw_logprobs(
                chunk, token_ids, [num_top] * len(chunk_ids), [False] * len(chunk_ids), self.log_normalizers(chunk)
            )
        return results

    def process_logits(
        self, logits: torch.Tensor, states: list[SamplingState], tracer: Tracer | None
    ) -> tuple[torch.Tensor, set[int]]:
        """Run the stages; returns the logits to pick from and the rows penalties, bias or min_tokens changed."""
        work = _Logits(logits)
        batch = _StageBatch(states, logits.shape[1], logits.device, logits.dtype, work, tracer)
        modified_rows: set[int] = set()
        # The processing order (trace.STAGES):
        #   penalties → logit bias → min_tokens blocking → grammar → temperature → top-k → top-p → min-p → draw.
        # Greedy rows (temperature 0) skip temperature and the filters: they take the argmax after the grammar.
        for stage in _ADJUSTING_STAGES:
            _run_stage(stage, batch, modified_rows)
        if tracer:
            tracer.keep_processed(work.tensor)
        for stage in _SELECTING_STAGES:
            _run_stage(stage, batch, modified_rows)
        return work.tensor, modified_rows

    def uniforms(self, states: list[SamplingState]) -> torch.Tensor:
        """One uniform in [0, 1) per row: from the row's own generator if it has one, else the default stream."""
        device = self.default_generator.device  # the runner's: where the logits are
        uniforms = torch.empty(len(states), device=device)  # [n]
        default_rows = [j for j, state in enumerate(states) if state.generator is None]
        if default_rows:
            uniforms[default_rows] = torch.rand(len(default_rows), generator=self.default_generator, device=device)
        for j, state in enumerate(states):
            if state.generator is not None:
                uniforms[j] = torch.rand(1, generator=state.generator, device=device)[0]
        return uniforms


def _note_draws(
    traces: dict[int, StepTrace],
    processed: torch.Tensor,
    token_ids: torch.Tensor,
    rows: list[int],
    uniforms: torch.Tensor,
) -> None:
    """StepTrace.extra["draw"] of each traced sampled row: its uniform and the span of the cumulative distribution
    (in token-id order, the order draw_rows walks) its token covers, so a reader can see where the draw landed;
    "neighbors": the spans of the NUM_DRAW_NEIGHBORS tokens with probability on each side of it, the chosen one
    included, laid end to end from the chosen span's edges (the tokens between them have probability 0; text
    filled in by the engine)."""
    for j, row in enumerate(rows):
        trace = traces.get(row)
        if trace is None:
            continue
        probs = processed[row].softmax(dim=0)  # [V]
        chosen = int(token_ids[row])
        start = float(probs[:chosen].sum())
        end = start + float(probs[chosen])
        kept = torch.nonzero(probs > 0).squeeze(1)  # [num_kept] token ids, ascending
        at = int(torch.searchsorted(kept, torch.tensor(chosen, device=kept.device)))
        before = kept[max(0, at - NUM_DRAW_NEIGHBORS) : at].tolist()
        after = kept[at + 1 : at + 1 + NUM_DRAW_NEIGHBORS].tolist()
        spans = [(chosen, start, end)]
        for token_id in reversed(before):
            spans.insert(0, (token_id, spans[0][1] - float(probs[token_id]), spans[0][1]))
        for token_id in after:
            spans.append((token_id, spans[-1][2], spans[-1][2] + float(probs[token_id])))
        neighbors = [{"token_id": t, "text": "", "cdf_start": a, "cdf_end": b} for t, a, b in spans]
        trace.extra["draw"] = {
            "uniform": float(uniforms[j]),
            "cdf_start": start,
            "cdf_end": end,
            "neighbors": neighbors,
        }
