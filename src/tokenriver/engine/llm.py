"""LLM: the offline Python API, in the shape vLLM users know.

    llm = LLM()                                   # the embedded default model
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))

`chat` renders conversations through the chat template and takes OpenAI's tools (tokenriver.tool_calls, as the
server does); `embed` and `rerank` pool instead of generating (PoolingParams). Prompts are strings (tokenized
here) or {"prompt_token_ids": [...]}. All prompts go through one EngineCore together, so they are batched
continuously.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm

from tokenriver.config import EngineConfig
from tokenriver.engine.core import EngineCore
from tokenriver.engine.rerank import RerankResult, check_top_n, ranked, rerank_inputs
from tokenriver.errors import InvalidParameterError
from tokenriver.loader.load import LoadedModel
from tokenriver.models.fast_path import release_thread_pool
from tokenriver.outputs import RequestOutput
from tokenriver.params import PoolingParams, SamplingParams
from tokenriver.tokenizer.tokenizer import Tokenizer
from tokenriver.tool_calls import ToolCalling

Prompt = str | dict[str, Any]


# Offline generation streams nothing token by token, so its default runs greedy decodes in multi-step
# scheduling (SchedulerConfig.num_scheduler_steps): the per-step Python runs once per this many passes.
OFFLINE_SCHEDULER_STEPS = 8


class LLM:
    """Load a model once, then generate for many prompts at a time.

    Any thread may call it (one at a time). The native kernels' OpenMP workers belong to the thread that runs them,
    and libgomp lets workers spin between parallel regions only while it manages no more threads than there are
    cores: a pool left in every thread that ever ran a step (a web app's worker threads) made each parallel region
    wake its workers from sleep, at a third of the decode speed. So the load and each run end their thread's pool
    (models/fast_path.py's release_thread_pool) and the next run starts one where it runs.
    """

    def __init__(self, model: str | None = None, dtype: str = "auto", **engine_options: Any) -> None:
        """engine_options: any EngineConfig setting by its flat name (max_num_seqs=8, speculative_draft="ngram"),
        as EngineConfig.from_flat takes them."""
        options = {"model": model, "dtype": dtype, **engine_options}
        config = EngineConfig.from_flat(**options)
        if "num_scheduler_steps" not in engine_options and config.multi_step_conflict() is None:
            config = EngineConfig.from_flat(**options, num_scheduler_steps=OFFLINE_SCHEDULER_STEPS)
        self._start(EngineCore(config))

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, **engine_options: Any) -> "LLM":
        """An LLM over an already loaded model: several engines (tests, benchmarks) can share one copy of weights."""
        llm = cls.__new__(cls)
        options = {
            "dtype": str(next(loaded.model.parameters()).dtype).removeprefix("torch."),
            "int8_activations": loaded.int8_activations,
            **engine_options,
        }
        llm._start(EngineCore(EngineConfig.from_flat(model=loaded.path, **options), loaded=loaded))
        return llm

    def _start(self, engine: EngineCore) -> None:
        self.engine = engine
        self._ids = itertools.count()
        release_thread_pool()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def _prompt_ids(self, prompt: Prompt, index: int) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.engine.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            # Checked with every other prompt in EngineCore.add_request (prompts.check_prompt).
            return prompt.get("prompt"), prompt["prompt_token_ids"]
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):  # vLLM's TextPrompt
            return prompt["prompt"], self.engine.tokenizer.encode(prompt["prompt"])
        raise InvalidParameterError(
            f"prompts[{index}] must be a string, or a dict with 'prompt' (a string) or 'prompt_token_ids', not "
            f"{type(prompt).__name__}" + (f" with keys {sorted(prompt)}" if isinstance(prompt, dict) else ""),
            param="prompts",
        )

    def _add(
        self,
        prompts: Sequence[Prompt],
        sampling_params: SamplingParams | PoolingParams | Sequence[SamplingParams],
        final_only: bool = False,
    ) -> list[str]:
        if isinstance(sampling_params, (SamplingParams, PoolingParams)):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise InvalidParameterError(
                    f"got {len(params_list)} SamplingParams for {len(prompts)} prompts; give one, or one per prompt",
                    param="sampling_params",
                )
        request_ids: list[str] = []
        try:
            for index, (prompt, params) in enumerate(zip(prompts, params_list)):
                text, ids = self._prompt_ids(prompt, index)
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, ids, params, prompt=text, final_only=final_only)
                request_ids.append(request_id)
        except Exception:  # one bad prompt refuses the call: the prompts before it do not stay queued
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        return request_ids

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | PoolingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order. With PoolingParams each prompt is
        embedded or scored instead (see embed)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        request_ids = self._add(list(prompts), sampling_params or SamplingParams(), final_only=True)
        finished: dict[str, RequestOutput] = {}
        # Everything alive before the run (the model, the tokenizer) outlives it: frozen, the collector does not
        # walk it again on every full collection, which a long batch run otherwise triggers many times.
        # A caller's own freeze is left alone.
        freeze = gc.get_freeze_count() == 0
        if freeze:
            gc.freeze()
        try:
            with tqdm(total=len(request_ids), desc="Generating", unit="req", disable=not use_tqdm) as progress:
                while self.engine.has_unfinished_requests():
                    for output in self.engine.step():
                        if output.finished:
                            finished[output.request_id] = output
                            progress.update(1)
        finally:
            if freeze:
                gc.unfreeze()
            for request_id in request_ids:
                if request_id not in finished and self.engine.has_request(request_id):
                    self.engine.abort_request(request_id)
            release_thread_pool()
        return [finished[request_id] for request_id in request_ids]

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Each prompt's embedding (`output.embedding`, unit length unless pooling_params say otherwise), all
        prompts batched together as generate() batches them."""
        params = pooling_params or PoolingParams()
        if params.task != "embed":
            raise InvalidParameterError("embed() takes PoolingParams with task='embed'", param="pooling_params")
        return self.generate(prompts, params, use_tqdm=use_tqdm)

    def rerank(
        self,
        query: str,
        documents: Sequence[str],
        top_n: int | None = None,
        instruction: str | None = None,
        use_tqdm: bool = True,
    ) -> list[RerankResult]:
        """The documents ranked by relevance to the query, best first (engine/rerank.py says how each kind of
        model judges a pair); `instruction` tells a causal judge what relevant means."""
        if not isinstance(query, str) or not all(isinstance(d, str) for d in documents) or not documents:
            raise InvalidParameterError("rerank takes a query string and a non-empty list of strings", param="query")
        check_top_n(top_n)
        documents = list(documents)
        inputs, params = rerank_inputs(
            self.engine.tokenizer, self.engine.model_info.is_causal, query, documents, instruction
        )
        outputs = self.generate([{"prompt_token_ids": ids} for ids in inputs], params, use_tqdm=use_tqdm)
        return ranked(documents, [output.score for output in outputs], top_n)

    def reset_prefix_cache(self) -> bool:
        """Forget the KV of every prompt prefix cached so far (vLLM's `LLM.reset_prefix_cache`): the next prompts
        are computed in full. Benchmarks call it between runs of the same prompts. Between calls of generate()
        nothing runs, so it returns True; False means a request still held blocks and nothing was forgotten."""
        return self.engine.reset_prefix_cache()

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the request's output after every step that changed it (text deltas in `delta_text`)."""
        (request_id,) = self._add([prompt], sampling_params or SamplingParams())
        done = False
        try:
            while not done and self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.request_id == request_id:
                        done = output.finished
                        yield output
        finally:
            if not done and self.engine.has_request(request_id):
                self.engine.abort_request(request_id)
            release_thread_pool()

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or several) and generate the replies.

        `tools`, `tool_choice` and `parallel_tool_calls` are OpenAI's (tool definitions as dicts; "auto", "none",
        "required" or {"type": "function", "function": {"name": ...}}) and work as in the server: the tools reach
        the model through its chat template (or the system prompt, for templates without tool support), a
        grammar enforces the choice, and each candidate carries `content` and parsed `tool_calls`.
        """
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        tool_calling = self.tool_calling(tools, tool_choice, parallel_tool_calls)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params: SamplingParams | list[SamplingParams] = tool_calling.constrain(
                sampling_params or SamplingParams(), "sampling_params.structured_output"
            )
        else:
            params = [tool_calling.constrain(p, "sampling_params.structured_output") for p in sampling_params]
        prompts = [
            self.chat_prompt(conversation, add_generation_prompt, tool_calling) for conversation in conversations
        ]
        outputs = self.generate(prompts, params, use_tqdm=use_tqdm)
        if tool_calling.is_active:
            for output in outputs:
                for candidate in output.outputs:
                    candidate.content, candidate.tool_calls = tool_calling.parse(candidate.text)
        return outputs

    def tool_calling(
        self,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
    ) -> ToolCalling:
        """A chat's tools for this model's chat template and vocabulary (validated: InvalidParameterError)."""
        return ToolCalling(
            tools, tool_choice, parallel_tool_calls, self.engine.tokenizer.chat_template, self.engine.special_token_id
        )

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tool_calling: ToolCalling | None = None,
    ) -> dict[str, Any]:
        """One conversation rendered by the chat template, with its tools: a prompt for generate() or stream()."""
        tool_calling = tool_calling or self.tool_calling()
        tools = tool_calling.template_tools()
        text = self.engine.tokenizer.apply_chat_template(
            tool_calling.conversation(messages),
            add_generation_prompt=add_generation_prompt,
            **({"tools": tools} if tools is not None else {}),
        )
        return {"prompt": text, "prompt_token_ids": self.engine.tokenizer.encode(text, add_special_tokens=False)}
