"""The per-step trace: follows the traced rows' most likely candidates through the sampler's stages.

The sampler calls `record` after each stage and `finish` once the tokens are chosen; the result is one
`StepTrace` per traced row (plain data, see tokenriver.trace).

The candidates are the row's trace_top most likely raw tokens; on a row with a grammar, also the trace_top most
likely tokens the grammar allows, so a constrained step always shows what it could choose from. A row that asks
for trace_stages keeps its logits after each stage that ran on it; `finish` turns them into the candidates'
distributions (TraceStage), so the trace holds the step's own numbers rather than a later replay's.
"""

from __future__ import annotations

import torch

from tokenriver.sampling import processors
from tokenriver.sampling.rows import SamplingState, select_rows
from tokenriver.trace import STAGES, StepTrace, TraceCandidate, TraceStage


class Tracer:
    """Follows the traced rows' most likely raw candidates through the stages and builds their StepTraces."""

    def __init__(self, raw: torch.Tensor, rows: list[int], states: list[SamplingState]) -> None:
        self.rows = rows
        self.index = torch.tensor(rows, dtype=torch.int64, device=raw.device)  # [T]
        self.raw = select_rows(raw, rows).clone()  # [T, V]
        self.processed = self.raw  # [T, V], replaced after penalties and bias
        self.num_top = min(max(states[i].params.trace_top for i in rows), raw.shape[1])
        self.candidate_ids = self._candidate_ids(rows, states)  # [T, C], most likely first
        candidate_logits = self.raw.gather(1, self.candidate_ids)  # [T, C]
        self.is_finite = torch.isfinite(candidate_logits)  # [T, C]
        # Index into STAGES of the stage that first forced each candidate to -inf; -1 while it survives.
        self.removed_by = torch.full_like(self.candidate_ids, -1)  # [T, C]
        # Batch row → what the grammar stage did there (rows with a grammar only).
        self.grammar: dict[int, dict[str, object]] = {}
        # Batch row → (stage, its logits [V] after the stage), for the rows that asked for trace_stages.
        self.stage_logits: dict[int, list[tuple[str, torch.Tensor]]] = {
            row: [] for row in rows if states[row].params.trace_stages
        }

    def _candidate_ids(self, rows: list[int], states: list[SamplingState]) -> torch.Tensor:
        """[T, C]: the num_top most likely raw tokens, then (rows with a grammar) the num_top most likely allowed
        ones; rows without a grammar fill those columns with their next most likely tokens, which finish drops."""
        has_grammar = any(states[row].allowed_token_mask is not None for row in rows)
        width = min(2 * self.num_top if has_grammar else self.num_top, self.raw.shape[1])
        ids = self.raw.topk(width, dim=1).indices  # [T, width]
        for j, row in enumerate(rows):
            mask = states[row].allowed_token_mask
            if mask is None or width == self.num_top:
                continue
            allowed = processors.allowed_tokens(mask.unsqueeze(0).to(self.raw.device), self.raw.shape[1])[0]  # [V]
            top_allowed = processors.apply_allowed_tokens(self.raw[j : j + 1], allowed.unsqueeze(0))[0]  # [V]
            best = top_allowed.topk(width - self.num_top)
            # Fewer allowed tokens than columns: the rest repeat the top candidate, which finish keeps once.
            ids[j, self.num_top :] = torch.where(torch.isinf(best.values), ids[j, 0], best.indices)
        return ids

    def record(self, stage: str, logits: torch.Tensor, rows: list[int]) -> None:
        """After `stage` ran on the batch rows `rows`: note which candidates it forced to -inf (a removed token stays
        -inf in later stages), and keep the stage-traced rows' logits. Two penalty stages in a row count as one."""
        values = logits[self.index.unsqueeze(1), self.candidate_ids]  # [T, C]
        is_removed_now = (values == float("-inf")) & self.is_finite & (self.removed_by < 0)
        self.removed_by[is_removed_now] = STAGES.index(stage)
        for row in rows:
            kept = self.stage_logits.get(row)
            if kept is None:
                continue
            if kept and kept[-1][0] == stage:
                kept.pop()
            kept.append((stage, logits[row].clone()))  # [V]

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
        top_logits = self.raw.gather(1, self.candidate_ids[:, : self.num_top])  # [T, num_top]
        # Every token above a top candidate is itself one, so their ranks can be counted among them.
        top_ranks = ((top_logits.unsqueeze(1) > top_logits.unsqueeze(2)).sum(dim=2) + 1).tolist()

        traces: dict[int, StepTrace] = {}
        for j, row in enumerate(self.rows):
            params = states[row].params
            chosen_id = int(chosen[j])
            row_ids, row_removed = self.candidate_ids[j].tolist(), self.removed_by[j].tolist()
            columns = self._columns(row_ids, row in self.grammar, params.trace_top, chosen_id)
            ids = [row_ids[k] if k >= 0 else chosen_id for k in columns]
            removed = [STAGES[row_removed[k]] if k >= 0 and row_removed[k] >= 0 else None for k in columns]
            ranks = [
                top_ranks[j][k] if 0 <= k < self.num_top else int((self.raw[j] > self.raw[j, token_id]).sum()) + 1
                for k, token_id in zip(columns, ids)
            ]
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
                stages=self._stages(row, ids),
            )
            if row in self.grammar:
                traces[row].extra["grammar"] = self.grammar[row]
        return traces

    def _columns(self, row_ids: list[int], has_grammar: bool, trace_top: int, chosen_id: int) -> list[int]:
        """Which of a row's candidate columns (row_ids) it keeps, in order: its trace_top most likely, the allowed
        ones its grammar added (each token once), and -1 for the chosen token when it is none of them."""
        columns = list(range(trace_top))
        seen = set(row_ids[:trace_top])
        if has_grammar:
            for k in range(self.num_top, min(self.num_top + trace_top, len(row_ids))):
                if row_ids[k] not in seen:
                    seen.add(row_ids[k])
                    columns.append(k)
        if chosen_id not in seen:
            columns.append(-1)  # a chosen token has a non-zero final probability: nothing removed it
        return columns

    def _stages(self, row: int, ids: list[int]) -> list[TraceStage] | None:
        """The candidates' distribution after each stage that ran on the row (None unless it asked for them).
        Each softmax is of one [1, V] row, as `finish` computes a lone row's final distribution."""
        kept = self.stage_logits.get(row)
        if kept is None:
            return None
        stages = []
        for name, logits in kept:
            probs = logits.unsqueeze(0).softmax(dim=1)[0]  # [V]
            values = logits[ids].tolist()
            stages.append(
                TraceStage(
                    name=name,
                    logits=[v if v != float("-inf") else None for v in values],
                    probs=probs[ids].tolist(),
                    num_kept=int(torch.isfinite(logits).sum()),
                )
            )
        return stages
