"""Draft-model proposer: a cheaper model with the same tokenizer guesses k tokens, one forward pass each.

The draft is either another model file (any size, same vocabulary) or the
target itself cut short ("self:N"): its embedding, its first N decoder layers,
its final norm and its output head, sharing the target's weights. The early
layers of a model already predict the easy tokens well, so a self-draft needs
no second model on disk and no second copy in memory.

The draft keeps its own paged KV cache and block pool, sized like the
target's, and its own block table per request; the target's scheduler knows
nothing about them. Per request it remembers which tokens its cache holds, so
each step it computes only what is new (the tokens the target accepted since),
then k - 1 more single-token passes for the rest of the guess. Tokens it had
guessed that the target rejected are simply overwritten.

Drafts are drawn from the draft's own processed distribution q (the request's
temperature, top-k/p and penalties applied to the draft's logits), and q is
returned with them for the acceptance rule; greedy requests take the draft's
argmax and need no q.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import torch
from torch import nn

from tokenriver.config import EngineConfig
from tokenriver.decoding.proposer import Proposal
from tokenriver.errors import InvalidParameterError
from tokenriver.kv.block_manager import BlockManager
from tokenriver.kv.cache import KVCache
from tokenriver.loader.load import LoadedModel, load_model
from tokenriver.models.contract import CausalLM
from tokenriver.runner.inputs import prepare_inputs
from tokenriver.runner.native_stack import NativeStack
from tokenriver.sampling.sampler import Sampler, SamplingState
from tokenriver.sched.output import ScheduledRequest, SchedulerOutput
from tokenriver.sched.request import Request

# Token ids compared between the draft's and the target's vocabularies (a different tokenizer would make every
# draft a wrong guess: accepted rarely, and never correct text).
_NUM_CHECKED_TOKENS = 2048


def first_layers(model: nn.Module, num_layers: int) -> CausalLM:
    """The model with only its first num_layers decoder layers, sharing every weight (a self-speculative draft).

    Shallow copies of the model and its decoder whose layer list is cut short: forward() and compute_logits()
    are the model's own, and layer i still writes kv_cache[i], so a cache of num_layers layers serves it.
    """
    if not isinstance(model, CausalLM):
        raise InvalidParameterError(
            f"a self-draft keeps the first layers of model.model.layers, which {type(model).__name__} does not "
            f"have; give a draft model path instead",
            param="speculative_draft",
        )
    decoder = model.model
    draft_decoder = copy.copy(decoder)
    draft_decoder._modules = dict(decoder._modules)  # a copy: the target's own module table stays untouched
    draft_decoder._modules["layers"] = nn.ModuleList(list(decoder.layers)[:num_layers])
    draft = copy.copy(model)
    draft._modules = dict(model._modules)
    draft._modules["model"] = draft_decoder
    return draft


@dataclass
class _DraftState:
    """What the draft cache holds for one request."""

    # The request's blocks in the draft pool.
    block_ids: list[int]
    # The tokens whose K/V those blocks hold, position by position (known tokens, then the last guess's drafts).
    token_ids: list[int]
    # The request's preemption count when the state was made: after a preemption it starts over.
    num_preemptions: int
    # The request's own stream for drafting when it has a seed (separate from the target's stream).
    generator: torch.Generator | None


@dataclass(frozen=True)
class _Drafting:
    """One request of a propose() call that gets drafts this time."""

    # Its position in the call's requests (and proposals).
    index: int
    request: Request
    state: _DraftState
    # Drafts to guess for it: one pass each.
    num_drafts: int


class DraftModelProposer:
    """Proposes with a draft model over its own paged KV cache."""

    def __init__(
        self,
        model: nn.Module,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        config: EngineConfig,
        num_kv_blocks: int,
    ) -> None:
        self.model = model
        self.forward = NativeStack(model)  # calls like the model; its layers in one native call where they can run
        self.device = torch.device(config.device)
        self.kv_cache = KVCache(
            num_layers,
            num_kv_blocks,
            config.cache.block_size,
            num_kv_heads,
            head_dim,
            getattr(torch, config.resolved_kv_cache_dtype),
            config.device,
        )
        self.block_manager = BlockManager(num_kv_blocks, config.cache.block_size, enable_prefix_caching=False)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(config.seed + 1)
        self.sampler = Sampler(generator)
        self._states: dict[str, _DraftState] = {}
        # Forward passes of the draft model so far.
        self.num_forward_passes = 0

    @classmethod
    def from_target_layers(
        cls, target: LoadedModel, num_layers: int, config: EngineConfig, num_kv_blocks: int
    ) -> "DraftModelProposer":
        """A self-speculative draft: the target's first num_layers layers and its output head."""
        model_config = target.config
        return cls(
            first_layers(target.model, num_layers),
            num_layers,
            model_config.num_kv_heads,
            model_config.head_dim,
            config,
            num_kv_blocks,
        )

    @classmethod
    def from_path(
        cls, path: str, target: LoadedModel, config: EngineConfig, num_kv_blocks: int
    ) -> "DraftModelProposer":
        """A separate draft model; its tokenizer must be the target's.

        A draft exists to be fast, so a target kept in float (quantization "none") does not make its draft float:
        the draft is loaded with "auto", which keeps a GGUF's 4- and 8-bit weights packed (a Q4 copy of a float
        target is the classic cheap draft). With "int8"/"int4" the draft is quantized the same way as the target.
        """
        if not os.path.exists(path):
            raise InvalidParameterError(
                f"speculative_draft={path!r} is neither 'ngram', 'self:N' nor an existing model file or folder",
                param="speculative_draft",
            )
        quantization = "auto" if config.numerics.quantization == "none" else config.numerics.quantization
        draft = load_model(path, config.resolved_dtype, config.device, quantization)
        check_same_vocabulary(draft, target)
        return cls(
            draft.model,
            draft.config.num_layers,
            draft.config.num_kv_heads,
            draft.config.head_dim,
            config,
            num_kv_blocks,
        )

    def drop(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            state = self._states.pop(request_id, None)
            if state is not None:
                self.block_manager.free(state.block_ids)

    @torch.inference_mode()
    def propose(self, requests: list[Request], max_num_tokens: list[int]) -> list[Proposal | None]:
        """k passes for the whole batch: the first computes what each request's draft cache lacks and guesses
        one token; each further pass feeds the previous guess and guesses the next."""
        batch: list[_Drafting] = []
        for index, (request, limit) in enumerate(zip(requests, max_num_tokens)):
            state = self._prepare(request, limit)
            if state is not None:
                batch.append(_Drafting(index, request, state, limit))
        drafts: dict[int, list[int]] = {entry.index: [] for entry in batch}
        probs: dict[int, list[torch.Tensor]] = {entry.index: [] for entry in batch}
        # Pass 1 computes the tokens each draft cache lacks; later passes, the previous guess.
        pending = {entry.index: entry.request.all_token_ids[len(entry.state.token_ids) :] for entry in batch}
        for step in range(max((entry.num_drafts for entry in batch), default=0)):
            active = [entry for entry in batch if entry.num_drafts > step]
            scheduled = []
            for entry in active:
                request, state = entry.request, entry.state
                scheduled.append(
                    ScheduledRequest(
                        request_id=request.request_id,
                        token_ids=pending[entry.index],
                        start_position=len(state.token_ids),
                        block_ids=state.block_ids,
                        sample=True,
                        sampling_params=request.sampling_params,
                        prompt_token_ids=request.prompt_token_ids,
                        output_token_ids=request.output_token_ids,
                    )
                )
                state.token_ids.extend(pending[entry.index])
            inputs = prepare_inputs(SchedulerOutput(scheduled=scheduled), self.kv_cache.block_size, self.device)
            # [num_tokens, hidden_size]
            hidden = self.forward(inputs.input_ids, inputs.positions, self.kv_cache, inputs.metadata)
            self.num_forward_passes += 1
            rows = torch.tensor(inputs.sample_rows, dtype=torch.long, device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows))  # [num_active, vocab] float32
            states = [
                SamplingState(
                    entry.request.sampling_params,
                    entry.request.prompt_token_ids,
                    entry.request.output_token_ids + drafts[entry.index],
                    entry.state.generator,
                    [] if entry.request.sampling_params.ignore_eos else entry.request.eos_token_ids,
                )
                for entry in active
            ]
            token_ids, distributions = self.sampler.draw(logits, states)
            for row, (entry, token_id) in enumerate(zip(active, token_ids)):
                drafts[entry.index].append(token_id)
                if not entry.request.sampling_params.is_greedy:
                    probs[entry.index].append(distributions[row])
                pending[entry.index] = [token_id]
        proposals: list[Proposal | None] = [None] * len(requests)
        for entry in batch:
            q = torch.stack(probs[entry.index]) if probs[entry.index] else None  # [num_drafts, vocab]
            proposals[entry.index] = Proposal(drafts[entry.index], q)
        return proposals

    def _prepare(self, request: Request, num_drafts: int) -> _DraftState | None:
        """The request's draft state, trimmed to the tokens still valid and grown to hold this guess (None: no room)."""
        state = self._states.get(request.request_id)
        if state is not None and state.num_preemptions != request.num_preemptions:
            self.drop([request.request_id])
            state = None
        if state is None:
            generator = None
            if request.sampling_params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(draft_seed(request.sampling_params.seed))
            state = _DraftState([], [], request.num_preemptions, generator)
            self._states[request.request_id] = state
        # Keep the cached tokens that agree with the request, and always recompute its last known token
        # (its logits give the first guess).
        known = request.all_token_ids
        num_valid = 0
        limit = min(len(state.token_ids), len(known) - 1)
        while num_valid < limit and state.token_ids[num_valid] == known[num_valid]:
            num_valid += 1
        del state.token_ids[num_valid:]
        # Positions up to the last known token plus num_drafts - 1 guesses are written.
        manager = self.block_manager
        num_needed = manager.num_blocks_for(len(known) + num_drafts - 1)
        if num_needed > len(state.block_ids):
            if not manager.can_allocate(num_needed - len(state.block_ids)):
                self.drop([request.request_id])
                return None
            state.block_ids.extend(manager.allocate(num_needed - len(state.block_ids)))
        return state


def draft_seed(seed: int) -> int:
    """The seed of a request's drafting stream: derived from its seed but not equal to it, since the target
    draws its acceptance tests from a stream seeded with the seed itself, and drafts and tests must be independent."""
    return (seed * 6364136223846793005 + 1442695040888963407) % 2**63


def check_same_vocabulary(draft: LoadedModel, target: LoadedModel) -> None:
    """Refuse a draft model whose tokenizer differs from the target's: its guesses would mean other tokens."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise InvalidParameterError(
            f"the draft model {draft.path} has a vocabulary of {draft.config.vocab_size} tokens and the model "
            f"{target.config.vocab_size}: a draft must share the model's tokenizer",
            param="speculative_draft",
        )
    for token_id in range(min(_NUM_CHECKED_TOKENS, draft.config.vocab_size)):
        if draft.tokenizer.token_text(token_id) != target.tokenizer.token_text(token_id):
            raise InvalidParameterError(
                f"the draft model {draft.path} reads token {token_id} as {draft.tokenizer.token_text(token_id)!r} "
                f"but the model as {target.tokenizer.token_text(token_id)!r}: a draft must share the model's "
                f"tokenizer",
                param="speculative_draft",
            )
