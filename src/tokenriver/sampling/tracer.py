"""The per-step trace: follows the traced rows' most likely candidates through the sampler's stages.

The sampler calls `record` after each stage and `finish` once the tokens are chosen; the result is one
`StepTrace` per traced row (plain data, see tokenriver.trace).
"""

from __future__ import annotations

import torch

from tokenriver.sampling.rows import SamplingState, select_rows
from tokenriver.trace import STAGES, StepTrace, TraceCandidate


class Tracer:
    """Follows the traced rows' most likely raw candidates through the stages and builds their StepTraces."""

    def __init__(self, raw: torch.Tensor, rows: list[int], states: list[SamplingState]) -> None:
        self.rows = rows
        self.index = torch.tensor(rows, dtype=torch.int64, device=raw.device)  # [T]
        self.raw = select_rows(raw, rows).clone()  # [T, V]
        self.processed = self.raw  # [T, V], replaced after penalties and bias
        num_candidates = min(max(states[i].params.trace_top for i in rows), raw.shape[1])
        self.candidate_ids = self.raw.topk(num_candidates, dim=1).indices  # [T, C], most likely first
        candidate_logits = self.raw.gather(1, self.candidate_ids)  # [T, C]
        self.is_finite = torch.isfinite(candidate_logits)  # [T, C]
        # Index into STAGES of the stage that first forced each candidate to -inf; -1 while it survives.
        self.removed_by = torch.full_like(self.candidate_ids, -1)  # [T, C]
        # Batch row → what the grammar stage did there (rows with a grammar only).
        self.grammar: dict[int, dict[str, object]] = {}

    def record(self, stage: str, logits: torch.Tensor) -> None:
        """Note which candidates this stage forced to -inf (a removed token stays -inf in later stages)."""
        values = logits[self.index.unsqueeze(1), self.candidate_ids]  # [T, C]
        is_removed_now = (values == float("-inf")) & self.is_finite & (self.removed_by < 0)
        self.removed_by[is_removed_now] = STAGES.index(stage)

    def note_grammar(self, rows: list[int], logits: torch.Tensor, allowed: torch.Tensor) -> None:
        """What the grammar stage does to the traced ones among `rows` (batch rows; logits before the stage and
        allowed tokens: [len(rows), V] each): StepTrace.extra["grammar"]."""
        for j, row in enumerate(rows):
            if row not in self.rows:
                continue
            probs = logits[j].softmax(dim=0)  # [V]
            num_allowed = int(allowed[j].sum())
            self.grammar[row] = {
                # How many tokens the grammar allowed at this step.
                "num_allowed": num_allowed,
                # The probability (after penalties and bias) of every token it removed.
                "mass_removed": float(probs[~allowed[j]].sum()),
                # True when the grammar allowed a single token: the model had no choice.
                "forced": num_allowed == 1,
            }

    def keep_processed(self, logits: torch.Tensor) -> None:
        """Remember the logits after penalties and bias (TraceCandidate.logit_processed)."""
        self.processed = select_rows(logits, self.rows).clone()  # [T, V]

    def finish(self, final: torch.Tensor, token_ids: torch.Tensor, states: list[SamplingState]) -> dict[int, StepTrace]:
        """Build one StepTrace per traced row, keyed by row. `final` is what each row picked from (greedy rows:
        their logits after min_tokens blocking; sampled rows: after min-p)."""
        final_rows = select_rows(final, self.rows)  # [T, V]
        prob_raw = self.raw.softmax(dim=1)  # [T, V]
        prob_final = final_rows.softmax(dim=1)  # [T, V]
        # A row at a time: PyTorch sums one row of a [T, V] tensor in another order when T is 1, and a row's trace
        # must not depend on how many rows were traced beside it.
        entropy_raw = [float(torch.special.entr(row).sum()) for row in prob_raw]
        entropy_final = [float(torch.special.entr(row).sum()) for row in prob_final]
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
            if row in self.grammar:
                traces[row].extra["grammar"] = self.grammar[row]
        return traces
