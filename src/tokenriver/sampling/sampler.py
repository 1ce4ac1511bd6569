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
  such a batch (`takes_raw_argmax`) can be answered from those three numbers per
  row without logits at all (`sample_reduced`; the runner asks the model for them).
- Logprobs and ranks are those of the raw distribution (log_softmax of the
  unprocessed logits), as OpenAI and vLLM report them.

Speculative decoding (`verify`): the target scores k draft tokens in one pass,
and the rejection-sampling rule below keeps every emitted token distributed
exactly as `sample` would have drawn it. Each verified position is processed
with the token history it would have had (the drafts before it count as
generated), so penalties, min_tokens, logprobs and traces are those of a run
without speculation. Only the random stream differs: verification draws its
own uniforms, so a seeded request gives different (equally distributed)
tokens with and without speculation; greedy rows give identical tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenriver.outputs import TokenLogprobs
from tokenriver.params import SamplingParams, holds_stop_tokens, is_plain_greedy
from tokenriver.sampling import processors
from tokenriver.trace import STAGES, StepTrace, TraceCandidate

# prompt_logprobs compares every row against the whole vocabulary: chunks bound the [rows, V] temporaries.
PROMPT_LOGPROBS_CHUNK = 256


@dataclass
class SamplingState:
    """One row of the batch: the request's controls and the history the penalties read."""

    params: SamplingParams
    # Shared references are fine: the sampler only reads them.
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # The request's own generator when it has a seed; None = the sampler's default generator.
    generator: torch.Generator | None
    # Ids blocked (with params.stop_token_ids) while len(output_token_ids) < params.min_tokens.
    eos_token_ids: list[int]


@dataclass
class DraftCheck:
    """One request whose draft tokens the target model scores this step."""

    state: SamplingState
    draft_token_ids: list[int]
    # [len(draft_token_ids), V]: the distribution q each draft token was drawn from (the draft model's processed
    # distribution). None when the drafts are a deterministic function of the context (n-gram lookup): q is then
    # a point mass on each draft token.
    draft_probs: torch.Tensor | None = None


@dataclass
class SampleResult:
    """What the sampler chose for one row."""

    token_id: int
    # The chosen token's raw logprob and rank; `.top` holds params.logprobs best alternatives when logprobs is set.
    logprob: TokenLogprobs
    # Filled when params.trace is set.
    trace: StepTrace | None


@dataclass
class VerifyResult:
    """What the target made of one request's drafts."""

    # The accepted drafts, then one token of the target's own: the replacement of the first rejected draft, or a
    # bonus token when every draft was accepted. One SampleResult per emitted token.
    samples: list[SampleResult]
    num_accepted: int


def residual_distribution(target: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """Where to draw from after a rejection: max(0, p - q), normalized (target p, draft q: [V] each).

    Accepting x with probability min(1, p(x)/q(x)) emits x with probability min(p(x), q(x)); drawing the
    rejections from the normalized residual adds exactly the missing mass p(x) - min(p(x), q(x)). When p == q
    nothing is ever rejected, except by rounding: then the residual is empty and p itself is right.
    """
    residual = (target - draft).clamp_(min=0)  # [V]
    total = float(residual.sum())
    return target if total <= 0 else residual / total


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


# The rows each logits-changing stage of Sampler._process applies to.
def _has_repetition_penalty(state: SamplingState) -> bool:
    return state.params.repetition_penalty != 1.0


def _has_presence_or_frequency_penalty(state: SamplingState) -> bool:
    return state.params.presence_penalty != 0 or state.params.frequency_penalty != 0


def _has_logit_bias(state: SamplingState) -> bool:
    return bool(state.params.logit_bias)


def _blocks_stop_tokens(state: SamplingState) -> bool:
    """min_tokens not reached yet, with EOS or stop tokens to hold back."""
    return holds_stop_tokens(state.params, len(state.output_token_ids), state.eos_token_ids)


class Sampler:
    """Turns a step's logits into tokens, logprobs and traces."""

    def __init__(self, default_generator: torch.Generator, row_reductions: RowReductions | None = None) -> None:
        # Rows without a seed draw from this one stream, in batch order.
        self.default_generator = default_generator
        # A faster argmax + logsumexp of raw logits rows (the native kernels'), same argmax, logsumexp within
        # float rounding; the runner passes it where the kernels are built.
        self.row_reductions = row_reductions

    @staticmethod
    def takes_raw_argmax(states: list[SamplingState]) -> bool:
        """Whether every row takes its raw argmax and reports nothing but that token's logprob: greedy, no
        logprobs, no trace, and no stage that would change its logits. Such a batch needs, per row, only the
        argmax, the largest logit and the log-sum-exp (`sample_reduced`), which a model can compute without
        writing its logits."""
        return all(is_plain_greedy(state.params, len(state.output_token_ids), state.eos_token_ids)
                   for state in states)

    @staticmethod
    def sample_reduced(reduced: RowReductionsResult, states: list[SamplingState]) -> list[SampleResult]:
        """The rows of a batch that `takes_raw_argmax`, from (argmax [N], max [N], logsumexp [N]): each takes its
        argmax, whose logprob is the row's max minus its log-normalizer."""
        argmax, max_logits, log_normalizer = reduced
        if argmax.shape[0] != len(states):
            raise ValueError(f"reductions must have len(states)={len(states)} rows, got {argmax.shape[0]}")
        chosen = argmax.tolist()
        chosen_logprobs = (max_logits - log_normalizer).tolist()
        return [SampleResult(token_id, TokenLogprobs(token_id, logprob, 1), None)
                for token_id, logprob in zip(chosen, chosen_logprobs)]

    def sample(self, logits: torch.Tensor, states: list[SamplingState]) -> list[SampleResult]:
        """logits [N, V] float32, one row per state (the last position of each sampled request)."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits must be [len(states)={len(states)}, vocab_size], got {tuple(logits.shape)}")
        num_rows = len(states)
        if num_rows == 0:
            return []
        reduced = self.row_reductions(logits) if self.row_reductions is not None else None
        if reduced is not None and self.takes_raw_argmax(states):
            # The common decode step: skips the general path's dozen small tensor ops, which show in
            # single-stream decode.
            return self.sample_reduced(reduced, states)
        raw_argmax, raw_max, log_normalizer = reduced if reduced is not None else (None, None, None)
        traced_rows = [i for i, state in enumerate(states) if state.params.trace]
        tracer = _Tracer(logits, traced_rows, states) if traced_rows else None
        processed, modified_rows = self._process(logits, states, tracer)

        token_ids = torch.empty(num_rows, dtype=torch.int64)  # [N]
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
            token_ids[argmax_rows] = _rows(processed, argmax_rows).argmax(dim=1)
        if sampled_rows:
            uniforms = self._uniforms([states[i] for i in sampled_rows])  # [n]
            token_ids[sampled_rows] = _draw(_rows(processed, sampled_rows).softmax(dim=1), uniforms)

        # Untouched greedy rows picked the raw argmax: nothing ranks above it, no need to count.
        is_rank_one = [state.params.is_greedy and i not in modified_rows for i, state in enumerate(states)]
        num_top = [state.params.logprobs or 0 for state in states]
        logprobs = _raw_logprobs(logits, token_ids, num_top, is_rank_one, log_normalizer)
        traces = tracer.finish(processed, token_ids, states) if tracer else {}
        if sampled_rows and traces:
            _note_draws(traces, processed, token_ids, sampled_rows, uniforms)

        chosen = token_ids.tolist()
        return [SampleResult(chosen[i], logprobs[i], traces.get(i)) for i in range(num_rows)]

    def verify(self, logits: torch.Tensor, checks: list[DraftCheck]) -> list[VerifyResult]:
        """Accept or reject each request's draft tokens; logits [R, V] hold 1 + len(drafts) rows per check, in order.

        Row j of a check is the target's prediction after its j-th draft (row 0: after the last known token).
        """
        row_states = [
            SamplingState(check.state.params, check.state.prompt_token_ids,
                          check.state.output_token_ids + check.draft_token_ids[:j], check.state.generator,
                          check.state.eos_token_ids)
            for check in checks for j in range(len(check.draft_token_ids) + 1)
        ]
        if logits.dim() != 2 or logits.shape[0] != len(row_states):
            raise ValueError(f"logits must be [{len(row_states)} rows (1 + drafts per check), vocab_size], "
                             f"got {tuple(logits.shape)}")
        traced_rows = [i for i, state in enumerate(row_states) if state.params.trace]
        tracer = _Tracer(logits, traced_rows, row_states) if traced_rows else None
        processed, modified_rows = self._process(logits, row_states, tracer)

        token_ids = processed.argmax(dim=1)  # [R]: greedy verdicts; rows past a rejection keep this placeholder
        greedy_ids = token_ids.tolist()
        # [R, V] target distributions, one softmax for the whole batch (greedy rows do not need it).
        probs = processed.softmax(dim=1) if any(not state.params.is_greedy for state in row_states) else None
        emitted: list[tuple[int, int]] = []  # (check index, row) of every emitted token
        num_accepted: list[int] = []
        first = 0
        for index, check in enumerate(checks):
            num_rows = len(check.draft_token_ids) + 1
            if check.state.params.is_greedy:
                chosen = _accept_greedy(greedy_ids[first:first + num_rows], check.draft_token_ids)
            else:
                chosen = self._accept_sampled(probs[first:first + num_rows], check)
            token_ids[first:first + len(chosen)] = torch.tensor(chosen, dtype=torch.int64)
            emitted += [(index, row) for row in range(first, first + len(chosen))]
            num_accepted.append(len(chosen) - 1)
            first += num_rows

        rows = [row for _, row in emitted]
        is_rank_one = [row_states[row].params.is_greedy and row not in modified_rows for row in rows]
        num_top = [row_states[row].params.logprobs or 0 for row in rows]
        index = torch.tensor(rows, dtype=torch.int64)  # [E]
        logprobs = _raw_logprobs(logits[index], token_ids[index], num_top, is_rank_one)
        traces = tracer.finish(processed, token_ids, row_states) if tracer else {}
        results = [VerifyResult(samples=[], num_accepted=count) for count in num_accepted]
        chosen_ids = token_ids.tolist()
        row_of_first = 0
        for (check_index, row), logprob in zip(emitted, logprobs):
            check, result = checks[check_index], results[check_index]
            if not result.samples:
                row_of_first = row
            trace = traces.get(row)
            if trace is not None:
                trace.extra["speculative"] = _verdict(check.draft_token_ids, row - row_of_first, result.num_accepted)
            result.samples.append(SampleResult(chosen_ids[row], logprob, trace))
        return results

    def top_logprobs(self, logits: torch.Tensor, num_top: list[int]) -> list[list[TokenLogprobs]]:
        """The num_top[i] most likely tokens of row i under log_softmax of the raw logits, best first (beam search).

        logits [N, V]. Ranks are positions in that order (tied logits get consecutive ranks).
        """
        if logits.dim() != 2 or logits.shape[0] != len(num_top):
            raise ValueError(f"logits must be [len(num_top)={len(num_top)}, vocab_size], got {tuple(logits.shape)}")
        if not num_top:
            return []
        best = logits.topk(min(max(num_top), logits.shape[1]), dim=1)  # [N, k] values and indices
        logprobs = (best.values - torch.logsumexp(logits, dim=1, keepdim=True)).tolist()  # [N, k]
        token_ids = best.indices.tolist()
        return [[TokenLogprobs(token_ids[i][j], logprobs[i][j], j + 1) for j in range(min(count, logits.shape[1]))]
                for i, count in enumerate(num_top)]

    def draw(self, logits: torch.Tensor, states: list[SamplingState]) -> tuple[list[int], torch.Tensor]:
        """One token per row, plus the processed distribution it was drawn from ([N, V], one-hot for greedy rows).

        What a draft model proposes with: the distribution is the q of the acceptance rule in `verify`.
        """
        processed, _ = self._process(logits, states, None)
        probs = processed.softmax(dim=1)  # [N, V]
        token_ids = processed.argmax(dim=1)  # [N]
        sampled_rows = [i for i, state in enumerate(states) if not state.params.is_greedy]
        if sampled_rows:
            index = torch.tensor(sampled_rows, dtype=torch.int64)  # [n]
            token_ids[index] = _draw(probs[index], self._uniforms([states[i] for i in sampled_rows]))
        greedy_rows = [i for i, state in enumerate(states) if state.params.is_greedy]
        if greedy_rows:
            index = torch.tensor(greedy_rows, dtype=torch.int64)  # [g]
            probs[index] = torch.nn.functional.one_hot(token_ids[index], probs.shape[1]).to(probs.dtype)
        return token_ids.tolist(), probs

    def _accept_sampled(self, probs: torch.Tensor, check: DraftCheck) -> list[int]:
        """The rejection-sampling rule (Leviathan et al. 2023; Chen et al. 2023), probs [1 + k, V] of the target.

        Draft x_j, drawn from q_j, is accepted with probability min(1, p_j(x_j) / q_j(x_j)); the first rejected
        one is replaced by a draw from the residual max(0, p_j - q_j) (normalized) and the rest are dropped; when
        all k are accepted, a bonus token is drawn from p_k. Every emitted token is then distributed exactly as p.
        """
        for j, token_id in enumerate(check.draft_token_ids):
            target = probs[j]  # [V]
            if check.draft_probs is None:
                draft = torch.zeros_like(target)  # [V]: the point mass of a deterministic proposer
                draft[token_id] = 1.0
            else:
                draft = check.draft_probs[j].to(target.dtype)  # [V]
            uniform = float(self._uniforms([check.state])[0])
            if uniform * float(draft[token_id]) < float(target[token_id]):
                continue  # accepted: u < p(x) / q(x)
            replacement = _draw(residual_distribution(target, draft).unsqueeze(0), self._uniforms([check.state]))
            return check.draft_token_ids[:j] + [int(replacement[0])]
        bonus = _draw(probs[-1:], self._uniforms([check.state]))
        return list(check.draft_token_ids) + [int(bonus[0])]

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
            results += _raw_logprobs(chunk, token_ids, [num_top] * len(chunk_ids), [False] * len(chunk_ids))
        return results

    def _process(
        self, logits: torch.Tensor, states: list[SamplingState], tracer: _Tracer | None
    ) -> tuple[torch.Tensor, set[int]]:
        """Run the stages; returns the logits to pick from and the rows penalties, bias or min_tokens changed."""
        vocab_size = logits.shape[1]
        work = _Logits(logits)
        modified_rows: set[int] = set()

        def run(stage: str, rows: list[int], process: Callable[[torch.Tensor], torch.Tensor]) -> None:
            work.update(rows, process)
            if tracer:
                tracer.record(stage, work.tensor)

        # The processing order (trace.STAGES):
        #   penalties → logit bias → min_tokens blocking → temperature → top-k → top-p → min-p → draw.
        # Greedy rows (temperature 0) skip temperature and the filters: they take the argmax after min_tokens.

        rows = [i for i, s in enumerate(states) if _has_repetition_penalty(s)]
        if rows:
            history = processors.pad_token_ids(
                [states[i].prompt_token_ids + states[i].output_token_ids for i in rows], vocab_size
            )  # [n, L]
            penalty = torch.tensor([states[i].params.repetition_penalty for i in rows])  # [n]
            run("penalty", rows, lambda x: processors.apply_repetition_penalty(x, history, penalty))
            modified_rows.update(rows)

        rows = [i for i, s in enumerate(states) if _has_presence_or_frequency_penalty(s)]
        if rows:
            generated = processors.pad_token_ids([states[i].output_token_ids for i in rows], vocab_size)  # [n, L]
            presence = torch.tensor([states[i].params.presence_penalty for i in rows])  # [n]
            frequency = torch.tensor([states[i].params.frequency_penalty for i in rows])  # [n]
            run("penalty", rows,
                lambda x: processors.apply_presence_frequency_penalties(x, generated, presence, frequency))
            modified_rows.update(rows)

        rows = [i for i, s in enumerate(states) if _has_logit_bias(s)]
        if rows:
            biases = [states[i].params.logit_bias or {} for i in rows]
            bias_ids = processors.pad_token_ids([list(b) for b in biases], vocab_size)  # [n, M]
            width = bias_ids.shape[1]
            bias_values = torch.tensor(
                [list(b.values()) + [0.0] * (width - len(b)) for b in biases], dtype=logits.dtype
            )  # [n, M], the padding adds 0 to the dropped column
            run("bias", rows, lambda x: processors.apply_logit_bias(x, bias_ids, bias_values))
            modified_rows.update(rows)

        if tracer:
            tracer.keep_processed(work.tensor)

        rows = [i for i, s in enumerate(states) if _blocks_stop_tokens(s)]
        if rows:
            blocked = processors.pad_token_ids(
                [states[i].eos_token_ids + states[i].params.stop_token_ids for i in rows], vocab_size
            )  # [n, M]
            num_output = torch.tensor([len(states[i].output_token_ids) for i in rows])  # [n]
            min_tokens = torch.tensor([states[i].params.min_tokens for i in rows])  # [n]
            run("min_tokens", rows, lambda x: processors.apply_min_tokens(x, blocked, num_output, min_tokens))
            modified_rows.update(rows)

        sampled = [(i, s.params) for i, s in enumerate(states) if not s.params.is_greedy]

        rows = [i for i, p in sampled if p.temperature != 1.0]
        if rows:
            temperature = torch.tensor([states[i].params.temperature for i in rows])  # [n]
            run("temperature", rows, lambda x: processors.apply_temperature(x, temperature))

        rows = [i for i, p in sampled if 0 < p.top_k < vocab_size]
        if rows:
            top_k = torch.tensor([states[i].params.top_k for i in rows])  # [n]
            run("top_k", rows, lambda x: processors.apply_top_k(x, top_k))

        rows = [i for i, p in sampled if p.top_p < 1.0]
        if rows:
            top_p = torch.tensor([states[i].params.top_p for i in rows])  # [n]
            run("top_p", rows, lambda x: processors.apply_top_p(x, top_p))

        rows = [i for i, p in sampled if p.min_p > 0.0]
        if rows:
            min_p = torch.tensor([states[i].params.min_p for i in rows])  # [n]
            run("min_p", rows, lambda x: processors.apply_min_p(x, min_p))

        return work.tensor, modified_rows

    def _uniforms(self, states: list[SamplingState]) -> torch.Tensor:
        """One uniform in [0, 1) per row: from the row's own generator if it has one, else the default stream."""
        uniforms = torch.empty(len(states))  # [n]
        default_rows = [j for j, state in enumerate(states) if state.generator is None]
        if default_rows:
            uniforms[default_rows] = torch.rand(len(default_rows), generator=self.default_generator)
        for j, state in enumerate(states):
            if state.generator is not None:
                uniforms[j] = torch.rand(1, generator=state.generator)[0]
        return uniforms


def _accept_greedy(target_ids: list[int], draft_token_ids: list[int]) -> list[int]:
    """Greedy verification: drafts are accepted while each equals the target's argmax; the first mismatch is
    replaced by the argmax (after k matches, the argmax of the last row is the bonus token)."""
    num_accepted = 0
    while num_accepted < len(draft_token_ids) and draft_token_ids[num_accepted] == target_ids[num_accepted]:
        num_accepted += 1
    return target_ids[:num_accepted + 1]


def _verdict(draft_token_ids: list[int], position: int, num_accepted: int) -> dict[str, object]:
    """StepTrace.extra["speculative"] of the token emitted at `position` of a verification."""
    return {
        # Every draft token of this verification, and how many of them the target accepted.
        "draft_token_ids": list(draft_token_ids),
        "num_accepted": num_accepted,
        # Which of the emitted tokens this one is (0 = right after the last known token).
        "position": position,
        # The draft proposed for this position (None for the bonus token after k accepted drafts).
        "draft_token_id": draft_token_ids[position] if position < len(draft_token_ids) else None,
        # True when this token is that draft, accepted; False when the target replaced it (or added a bonus).
        "accepted": position < num_accepted,
    }


def _note_draws(traces: dict[int, StepTrace], processed: torch.Tensor, token_ids: torch.Tensor, rows: list[int],
                uniforms: torch.Tensor) -> None:
    """StepTrace.extra["draw"] of each traced sampled row: its uniform and the span of the cumulative distribution
    (in token-id order, the order _draw walks) its token covers, so a reader can see where the draw landed."""
    for j, row in enumerate(rows):
        trace = traces.get(row)
        if trace is None:
            continue
        probs = processed[row].softmax(dim=0)  # [V]
        chosen = int(token_ids[row])
        start = float(probs[:chosen].sum())
        end = start + float(probs[chosen])
        trace.extra["draw"] = {"uniform": float(uniforms[j]), "cdf_start": start, "cdf_end": end}


def _rows(tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """tensor[rows] without a copy when rows is every row in order."""
    return tensor if len(rows) == tensor.shape[0] else tensor[torch.tensor(rows, dtype=torch.int64)]


def _draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: per row, the first token whose cumulative probability exceeds u * total.

    probs [n, V], uniforms [n] in [0, 1). One uniform per row keeps each row's draw a function of its own
    random stream. A token of probability 0 adds nothing to the cumulative sum, so it can never be the first to
    exceed the target; the target is kept strictly below the total so rounding cannot run past the last token.
    """
    cdf = probs.cumsum(dim=1)  # [n, V], accumulated in float64 by PyTorch's CPU kernel
    total = cdf[:, -1:]  # [n, 1]
    target = torch.minimum(uniforms.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))  # [n, 1]
    return torch.searchsorted(cdf, target, right=True).squeeze(1)  # [n]


def _raw_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int], is_rank_one: list[bool],
    log_normalizer: torch.Tensor | None = None,
) -> list[TokenLogprobs]:
    """Logprob and rank of token_ids[i] under log_softmax(logits[i]), plus the num_top[i] best alternatives.

    rank = 1 + the number of tokens with a strictly larger logit (ties share a rank; the argmax is always 1).
    Rows flagged in is_rank_one are known to hold an argmax, which saves a pass over their vocabulary.
    log_normalizer: logsumexp of each row when the caller has it already.
    """
    num_rows = logits.shape[0]
    if log_normalizer is None:
        log_normalizer = torch.logsumexp(logits, dim=1)  # [N]
    chosen_logits = logits.gather(1, token_ids.unsqueeze(1))  # [N, 1]
    chosen_logprobs = (chosen_logits.squeeze(1) - log_normalizer).tolist()
    ranks = [1] * num_rows
    rank_rows = [i for i in range(num_rows) if not is_rank_one[i]]
    if rank_rows:
        index = torch.tensor(rank_rows, dtype=torch.int64)  # [n]
        num_above = (_rows(logits, rank_rows) > chosen_logits[index]).sum(dim=1, dtype=torch.int32)  # [n]
        for i, count in zip(rank_rows, num_above.tolist()):
            ranks[i] = count + 1
    tops: list[list[tuple[int, float]]] = [[] for _ in range(num_rows)]
    top_rows = [i for i in range(num_rows) if num_top[i] > 0]
    if top_rows:
        index = torch.tensor(top_rows, dtype=torch.int64)  # [n]
        best = _rows(logits, top_rows).topk(min(max(num_top), logits.shape[1]), dim=1)  # [n, k] each
        best_logprobs = (best.values - log_normalizer[index].unsqueeze(1)).tolist()
        best_ids = best.indices.tolist()
        for j, i in enumerate(top_rows):
            tops[i] = list(zip(best_ids[j][: num_top[i]], best_logprobs[j][: num_top[i]]))
    ids = token_ids.tolist()
    return [TokenLogprobs(ids[i], chosen_logprobs[i], ranks[i], tops[i]) for i in range(num_rows)]


class _Tracer:
    """Follows the traced rows' most likely raw candidates through the stages and builds their StepTraces."""

    def __init__(self, raw: torch.Tensor, rows: list[int], states: list[SamplingState]) -> None:
        self.rows = rows
        self.index = torch.tensor(rows, dtype=torch.int64)  # [T]
        self.raw = _rows(raw, rows).clone()  # [T, V]
        self.processed = self.raw  # [T, V], replaced after penalties and bias
        num_candidates = min(max(states[i].params.trace_top for i in rows), raw.shape[1])
        self.candidate_ids = self.raw.topk(num_candidates, dim=1).indices  # [T, C], most likely first
        candidate_logits = self.raw.gather(1, self.candidate_ids)  # [T, C]
        self.is_finite = torch.isfinite(candidate_logits)  # [T, C]
        # Index into STAGES of the stage that first forced each candidate to -inf; -1 while it survives.
        self.removed_by = torch.full_like(self.candidate_ids, -1)  # [T, C]

    def record(self, stage: str, logits: torch.Tensor) -> None:
        """Note which candidates this stage forced to -inf (a removed token stays -inf in later stages)."""
        values = logits[self.index.unsqueeze(1), self.candidate_ids]  # [T, C]
        is_removed_now = (values == float("-inf")) & self.is_finite & (self.removed_by < 0)
        self.removed_by[is_removed_now] = STAGES.index(stage)

    def keep_processed(self, logits: torch.Tensor) -> None:
        """Remember the logits after penalties and bias (TraceCandidate.logit_processed)."""
        self.processed = _rows(logits, self.rows).clone()  # [T, V]

    def finish(self, final: torch.Tensor, token_ids: torch.Tensor, states: list[SamplingState]) -> dict[int, StepTrace]:
        """Build one StepTrace per traced row, keyed by row. `final` is what each row picked from (greedy rows:
        their logits after min_tokens blocking; sampled rows: after min-p)."""
        final_rows = _rows(final, self.rows)  # [T, V]
        prob_raw = self.raw.softmax(dim=1)  # [T, V]
        prob_final = final_rows.softmax(dim=1)  # [T, V]
        entropy_raw = torch.special.entr(prob_raw).sum(dim=1).tolist()
        entropy_final = torch.special.entr(prob_final).sum(dim=1).tolist()
        num_kept = torch.isfinite(final_rows).sum(dim=1).tolist()
        chosen = token_ids[self.index]  # [T]
        chosen_logits = self.raw.gather(1, chosen.unsqueeze(1))  # [T, 1]
        chosen_ranks = ((self.raw > chosen_logits).sum(dim=1, dtype=torch.int32) + 1).tolist()
        candidate_logits = self.raw.gather(1, self.candidate_ids)  # [T, C]
        # Every token above a candidate is itself a candidate, so ranks can be counted within the candidates.
        candidate_ranks = ((candidate_logits.unsqueeze(1) > candidate_logits.unsqueeze(2)).sum(dim=2) + 1).tolist()

        traces: dict[int, StepTrace] = {}
        for j, row in enumerate(self.rows):
            params = states[row].params
            chosen_id = int(chosen[j])
            ids = self.candidate_ids[j, : params.trace_top].tolist()
            ranks = candidate_ranks[j][: params.trace_top]
            removed = [STAGES[k] if k >= 0 else None for k in self.removed_by[j, : params.trace_top].tolist()]
            if chosen_id not in ids:
                ids.append(chosen_id)
                ranks.append(chosen_ranks[j])
                removed.append(None)  # a chosen token has a non-zero final probability
            candidates = [
                TraceCandidate(
                    token_id=token_id,
                    text="",
                    logit=float(self.raw[j, token_id]),
                    prob_raw=float(prob_raw[j, token_id]),
                    prob_final=float(prob_final[j, token_id]),
                    rank=rank,
                    removed_by=removed_by,
                    logit_processed=float(self.processed[j, token_id]),
                )
                for token_id, rank, removed_by in zip(ids, ranks, removed)
            ]
            traces[row] = StepTrace(
                index=len(states[row].output_token_ids),
                candidates=candidates,
                chosen_token_id=chosen_id,
                chosen_rank=chosen_ranks[j],
                chosen_prob_raw=float(prob_raw[j, chosen_id]),
                chosen_prob_final=float(prob_final[j, chosen_id]),
                entropy_raw=entropy_raw[j],
                entropy_final=entropy_final[j],
                num_candidates_kept=num_kept[j],
                temperature=params.temperature,
                method="greedy" if params.is_greedy else "sample",
            )
        return traces
