"""HTTP ↔ engine: request models in, (prompt token ids, SamplingParams) to the engine, OpenAI responses out.

Owns the translation both ways and nothing about HTTP itself (status codes,
headers and SSE framing are app.py's). Raw JSON never reaches the engine:
prompts are tokenized and chat templates rendered here, every sampling field
is mapped onto SamplingParams (whose validation errors are renamed to the
HTTP field the user sent), and prompts that cannot fit are refused before the
engine sees them.

Streaming invariant: a choice's streamed text pieces concatenate to the text
the same request returns without streaming. Each choice keeps a cursor (chars
and tokens already sent) and a chunk carries `text[sent:]`, so coalesced or
repeated engine outputs cannot duplicate or drop text.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from tokenriver.engine.async_engine import AsyncEngine
from tokenriver.errors import EngineOverloadedError, InvalidParameterError
from tokenriver.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from tokenriver.params import SamplingParams
from tokenriver.prompts import check_prompt
from tokenriver.server import reasoning
from tokenriver.server.chat_output import ChatView, chat_message, message_delta, tool_call_deltas
from tokenriver.server.metrics import ServerMetrics
from tokenriver.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    PromptTokensDetails,
    RequestMetricsInfo,
    Response,
    SamplingFields,
    TokenizeRequest,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from tokenriver.server.structured import structured_output
from tokenriver.server.tools import conversation_messages, request_tools
from tokenriver.tool_calls import ToolCalling

# OpenAI's default for /v1/completions; chat runs until EOS or the context is full.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# Names the chat template receives from tokenriver itself; chat_template_kwargs may not override them.
_RESERVED_TEMPLATE_NAMES = frozenset(
    {"messages", "add_generation_prompt", "tokenize", "special_tokens", "template", "tools", "documents"}
)


@dataclass
class PromptInput:
    """One prompt, ready for the engine."""

    token_ids: list[int]
    # The text the ids came from (None when the client sent ids).
    text: str | None


@dataclass
class GenerationPlan:
    """Everything one completion or chat request needs to run and be formatted."""

    response_id: str
    created: int
    prompts: list[PromptInput]
    params: SamplingParams
    priority: int
    is_stream: bool
    include_usage: bool
    # Completions only: the prompt is prepended to the text (and its logprobs when asked).
    echo: bool = False
    # Chat only: how many top_logprobs each token lists.
    num_top_logprobs: int = 0
    # Chat only: the request's tools (None without any), and whether the output starts inside a thinking block
    # (None when the template has none).
    tool_calling: ToolCalling | None = None
    starts_in_reasoning: bool | None = None


@dataclass
class _Delta:
    """What one stream chunk carries for one choice."""

    # The choice's index in the response (prompt index * n + candidate index).
    index: int
    output: RequestOutput
    candidate: CompletionOutput
    text: str
    token_ids: list[int]
    # (token id, logprobs) of token_ids; empty when logprobs were not asked for.
    positions: list[tuple[int, PositionLogprobs]]
    # Completions logprobs: characters of text before the first new token.
    text_offset: int
    trace: list[dict[str, Any]] | None
    # Set on the chunk that finishes the choice.
    metrics: RequestMetricsInfo | None


@dataclass
class _Cursor:
    """What a stream already sent for one choice."""

    num_chars: int = 0
    num_tokens: int = 0
    # Characters of text before the next token (completions logprobs' text_offset).
    text_offset: int = 0
    is_finished: bool = False


class OpenAIServing:
    """The completion, chat, tokenize and engine-info handlers, free of HTTP details."""

    def __init__(self, engine: AsyncEngine, model_name: str, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        info = engine.model_info
        self.vocab_size = info.vocab_size
        self.block_size = info.block_size
        self.max_num_seqs = info.max_num_seqs

    # ----- request → engine -------------------------------------------------------------------------

    def plan_completion(self, request: CompletionRequest) -> GenerationPlan:
        explicit_max_tokens = request.max_tokens is not None
        max_tokens = request.max_tokens if explicit_max_tokens else DEFAULT_COMPLETION_MAX_TOKENS
        prompts = self._completion_prompts(request.prompt)
        for index, prompt in enumerate(prompts):
            self._check_fits(
                prompt,
                max_tokens if explicit_max_tokens else None,
                "max_tokens",
                f"prompt[{index}]" if len(prompts) > 1 else "prompt",
            )
        echo = bool(request.echo)
        params = sampling_params(
            request,
            max_tokens=max_tokens,
            max_tokens_param="max_tokens",
            logprobs=request.logprobs,
            logprobs_param="logprobs",
            prompt_logprobs=request.logprobs if echo else None,
            best_of=request.best_of,
        )
        self._check_engine_limits(params)
        self._check_structured_output(request, params)
        return GenerationPlan(
            response_id=f"cmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            prompts=prompts,
            params=params,
            priority=request.priority or 0,
            is_stream=bool(request.stream),
            include_usage=_include_usage(request),
            echo=echo,
        )

    def plan_chat(self, request: ChatCompletionRequest) -> GenerationPlan:
        max_tokens, max_tokens_param = request.max_tokens, "max_tokens"
        if request.max_completion_tokens is not None:
            if max_tokens is not None and max_tokens != request.max_completion_tokens:
                raise InvalidParameterError(
                    f"max_tokens={max_tokens} and max_completion_tokens={request.max_completion_tokens} disagree; "
                    f"send only max_completion_tokens",
                    param="max_completion_tokens",
                )
            max_tokens, max_tokens_param = request.max_completion_tokens, "max_completion_tokens"
        if request.top_logprobs is not None and not request.logprobs:
            raise InvalidParameterError(
                "top_logprobs needs logprobs: true; set both, or drop top_logprobs", param="top_logprobs"
            )
        tool_calling = request_tools(request, self.tokenizer.chat_template, self.engine.special_token_id)
        prompt = self.render_chat(
            request.messages, request.add_generation_prompt, request.chat_template_kwargs, tool_calling
        )
        self._check_fits(prompt, max_tokens, max_tokens_param, "messages")
        return self.plan_rendered_chat(request, prompt, tool_calling, max_tokens, max_tokens_param)

    def plan_rendered_chat(
        self,
        request: ChatCompletionRequest,
        prompt: PromptInput,
        tool_calling: ToolCalling,
        max_tokens: int | None,
        max_tokens_param: str,
        constraint_name: str = "response_format or structured_outputs",
    ) -> GenerationPlan:
        """The rest of plan_chat once the prompt is rendered and its length checked: for the APIs that translate
        into a chat request but decide max_tokens from the prompt (Anthropic's Messages). constraint_name: the
        output constraint's field as the client wrote it, for the error when tools also need a grammar."""
        num_top = request.top_logprobs or 0
        params = sampling_params(
            request,
            max_tokens=max_tokens,
            max_tokens_param=max_tokens_param,
            logprobs=num_top if request.logprobs else None,
            logprobs_param="top_logprobs",
            prompt_logprobs=None,
            best_of=None,
        )
        params = tool_calling.constrain(params, constraint_name)
        has_reasoning = reasoning.has_reasoning(self.tokenizer.chat_template)
        if has_reasoning and params.structured_output is not None and reasoning.thinks_before_answering(prompt.text):
            end_of_thinking = tuple(self.tokenizer.encode(reasoning.THINK_CLOSE, add_special_tokens=False))
            params = dataclasses.replace(
                params, structured_output=dataclasses.replace(params.structured_output, starts_after=end_of_thinking)
            )
        self._check_engine_limits(params)
        self._check_structured_output(request, params)
        return GenerationPlan(
            response_id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            prompts=[prompt],
            params=params,
            priority=request.priority or 0,
            is_stream=bool(request.stream),
            include_usage=_include_usage(request),
            num_top_logprobs=num_top,
            tool_calling=tool_calling if tool_calling.is_active else None,
            starts_in_reasoning=reasoning.starts_in_reasoning(prompt.text) if has_reasoning else None,
        )

    def max_tokens_within_context(self, prompt: PromptInput, max_tokens: int, where: str) -> int:
        """max_tokens read as an upper bound, as llama.cpp reads Anthropic's: what the context leaves after the
        prompt, at most max_tokens (clients such as Claude Code ask for more than most contexts hold). A prompt
        that leaves no room at all is still refused."""
        self._check_fits(prompt, None, "max_tokens", where)
        return min(max_tokens, self.engine.max_model_len - len(prompt.token_ids))

    def render_chat(
        self,
        messages: list[Any],
        add_generation_prompt: bool | None,
        template_kwargs: dict[str, Any] | None,
        tool_calling: ToolCalling | None = None,
    ) -> PromptInput:
        """Messages → the chat template's text → token ids (the template writes its own special tokens)."""
        template_kwargs = template_kwargs or {}
        reserved = sorted(_RESERVED_TEMPLATE_NAMES & set(template_kwargs))
        if reserved:
            raise InvalidParameterError(
                f"chat_template_kwargs may not set {reserved}: tokenriver passes those itself",
                param="chat_template_kwargs",
            )
        tool_calling = tool_calling or ToolCalling([], None, None, self.tokenizer.chat_template)
        conversation = tool_calling.conversation(conversation_messages(messages))
        tools = tool_calling.template_tools()
        if tools is not None:
            template_kwargs = {**template_kwargs, "tools": tools}
        text = self.tokenizer.apply_chat_template(
            conversation,
            add_generation_prompt=True if add_generation_prompt is None else add_generation_prompt,
            **template_kwargs,
        )
        return PromptInput(self.tokenizer.encode(text, add_special_tokens=False), text)

    def _completion_prompts(self, prompt: str | list[int] | list[str] | list[list[int]]) -> list[PromptInput]:
        if isinstance(prompt, str):
            items: list[str | list[int]] = [prompt]
        elif not prompt or isinstance(prompt[0], int):
            items = [prompt]
        else:
            items = list(prompt)
        return [
            PromptInput(self.tokenizer.encode(item), item) if isinstance(item, str) else PromptInput(list(item), None)
            for item in items
        ]

    def _check_fits(self, prompt: PromptInput, max_tokens: int | None, max_tokens_param: str, where: str) -> None:
        """Refuse a prompt the engine would refuse, before it is queued, naming the field (prompts.check_prompt)."""
        check_prompt(
            prompt.token_ids,
            self.vocab_size,
            self.engine.max_model_len,
            max_tokens=max_tokens,
            where=where,
            param="prompt" if where.startswith("prompt") else where,
            max_tokens_param=max_tokens_param,
        )

    def _check_structured_output(self, request: SamplingFields, params: SamplingParams) -> None:
        """Compile the request's grammar now (cached for the engine), so a schema the backend cannot enforce is
        a 400 naming the field the client sent."""
        if params.structured_output is None:
            return
        found = structured_output(request)
        try:
            self.engine.check_structured_output(params.structured_output)
        except InvalidParameterError as error:
            raise InvalidParameterError(error.message, param=found[0] if found else "tools") from None

    def _check_engine_limits(self, params: SamplingParams) -> None:
        """What only this engine can judge: token ids against its vocabulary, candidates against its batch
        (SamplingParams.validate_for_engine, which the engine runs again on admission)."""
        params.validate_for_engine(self.vocab_size, self.max_num_seqs)
        if params.num_generated > self.max_num_seqs:
            name = "best_of" if params.best_of is not None else "n"
            raise InvalidParameterError(
                f"{name}={params.num_generated} asks for more candidates than this server runs at once "
                f"(max_num_seqs={self.max_num_seqs}); lower it, or start the server with a larger --max-num-seqs",
                param=name,
            )

    # ----- running ---------------------------------------------------------------------------------------

    async def outputs(self, plan: GenerationPlan) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every prompt's outputs as they come, tagged with the prompt's index; closing it aborts them all."""
        if len(plan.prompts) == 1:
            async with aclosing(self._generate(plan, 0)) as stream:
                async for output in stream:
                    yield 0, output
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(index: int) -> None:
            try:
                async with aclosing(self._generate(plan, index)) as stream:
                    async for output in stream:
                        queue.put_nowait((index, output))
            except Exception as error:
                queue.put_nowait((index, error))
            queue.put_nowait((index, None))

        tasks = [asyncio.create_task(pump(index)) for index in range(len(plan.prompts))]
        try:
            num_running = len(tasks)
            while num_running:
                index, item = await queue.get()
                if item is None:
                    num_running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()

    async def _generate(self, plan: GenerationPlan, index: int) -> AsyncIterator[RequestOutput]:
        prompt = plan.prompts[index]
        observer = self.metrics.observer()
        finished = False
        try:
            async with aclosing(
                self.engine.generate(
                    prompt.token_ids,
                    plan.params,
                    request_id=f"{plan.response_id}-{index}",
                    prompt=prompt.text,
                    priority=plan.priority,
                )
            ) as stream:
                async for output in stream:
                    observer.on_output(output)
                    finished = output.finished
                    yield output
        except EngineOverloadedError:
            observer.on_rejected()
            raise
        finally:
            if not finished:
                observer.on_abort()

    async def open_stream(self, plan: GenerationPlan, kind: str) -> AsyncIterator[Response]:
        """Start a streaming request and wait for its first output, so an error the engine raises on admission
        still becomes an HTTP error status; returns the chunk stream ("completion" or "chat")."""
        outputs = self.outputs(plan)
        try:
            first = await anext(outputs)
        except BaseException:
            await outputs.aclose()
            raise
        chunks = self.completion_chunks if kind == "completion" else self.chat_chunks
        return chunks(plan, first, outputs)

    async def final_outputs(self, plan: GenerationPlan) -> list[RequestOutput]:
        """Run a non-streaming request to the end: the last output of each prompt."""
        finals: list[RequestOutput | None] = [None] * len(plan.prompts)
        async with aclosing(self.outputs(plan)) as stream:
            async for index, output in stream:
                finals[index] = output
        return [output for output in finals if output is not None]

    # ----- engine → response ------------------------------------------------------------------------------

    def completion_response(self, plan: GenerationPlan, finals: list[RequestOutput]) -> CompletionResponse:
        choices = []
        for prompt_index, output in enumerate(finals):
            prompt_text = self._prompt_text(plan.prompts[prompt_index]) if plan.echo else ""
            for candidate in output.outputs:
                logprobs = None
                if plan.params.logprobs is not None:
                    positions = self._echo_positions(output) if plan.echo else []
                    positions += list(zip(candidate.token_ids, candidate.logprobs or []))
                    logprobs = completion_logprobs(positions, 0, self.tokenizer.token_text)
                choices.append(
                    CompletionChoice(
                        index=prompt_index * plan.params.n + candidate.index,
                        text=prompt_text + candidate.text,
                        logprobs=logprobs,
                        finish_reason=_finish_reason(candidate),
                        stop_reason=candidate.stop_reason,
                        token_ids=list(candidate.token_ids) if plan.params.trace or plan.params.beam_trace else None,
                        trace=_trace(candidate, 0) if plan.params.trace else None,
                        beam_score=candidate.beam_score,
                    )
                )
        return CompletionResponse(
            id=plan.response_id,
            created=plan.created,
            model=self.model_name,
            choices=choices,
            usage=usage(finals),
            metrics=self._combined_metrics(finals),
            beam_steps=[_beam_steps(output) for output in finals] if plan.params.beam_trace else None,
        )

    def chat_response(self, plan: GenerationPlan, finals: list[RequestOutput]) -> ChatCompletionResponse:
        (output,) = finals
        choices = []
        for candidate in output.outputs:
            logprobs = None
            if plan.params.logprobs is not None:
                logprobs = chat_logprobs(
                    list(zip(candidate.token_ids, candidate.logprobs or [])), plan.num_top_logprobs
                )
            message = chat_message(candidate.text, plan.tool_calling, plan.starts_in_reasoning)
            finish_reason = "tool_calls" if message.tool_calls else _finish_reason(candidate)
            choices.append(
                ChatChoice(
                    index=candidate.index,
                    message=message,
                    logprobs=logprobs,
                    finish_reason=finish_reason,
                    stop_reason=candidate.stop_reason,
                    trace=_trace(candidate, 0) if plan.params.trace else None,
                    beam_score=candidate.beam_score,
                )
            )
        return ChatCompletionResponse(
            id=plan.response_id,
            created=plan.created,
            model=self.model_name,
            choices=choices,
            usage=usage(finals),
            metrics=self.request_metrics(output),
            beam_steps=_beam_steps(output) if plan.params.beam_trace else None,
        )

    async def completion_chunks(
        self, plan: GenerationPlan, first: tuple[int, RequestOutput], rest: AsyncIterator[tuple[int, RequestOutput]]
    ) -> AsyncIterator[Response]:
        """The SSE chunks of a streaming completion, from its first engine output onwards."""
        echoed: set[int] = set()
        finals: dict[str, RequestOutput] = {}
        async with aclosing(self._deltas(plan, first, rest)) as deltas:
            async for delta in deltas:
                prompt_index = delta.index // plan.params.n
                if plan.echo and prompt_index not in echoed:
                    echoed.add(prompt_index)
                    yield self._echo_chunk(plan, prompt_index, delta.output)
                logprobs = None
                if plan.params.logprobs is not None:
                    logprobs = completion_logprobs(delta.positions, delta.text_offset, self.tokenizer.token_text)
                choice = CompletionChoice(
                    index=delta.index,
                    text=delta.text,
                    logprobs=logprobs,
                    finish_reason=_finish_reason(delta.candidate),
                    stop_reason=delta.candidate.stop_reason,
                    token_ids=delta.token_ids if plan.params.trace else None,
                    trace=delta.trace,
                )
                yield CompletionResponse(
                    id=plan.response_id,
                    created=plan.created,
                    model=self.model_name,
                    choices=[choice],
                    metrics=delta.metrics,
                )
                if delta.output.finished:
                    finals[delta.output.request_id] = delta.output
        if plan.include_usage:
            yield CompletionResponse(
                id=plan.response_id,
                created=plan.created,
                model=self.model_name,
                choices=[],
                usage=usage(list(finals.values())),
            )

    def _echo_chunk(self, plan: GenerationPlan, prompt_index: int, output: RequestOutput) -> CompletionResponse:
        """The prompt's text (and logprobs) for each of its n choices, sent before their first generated text."""
        text = self._prompt_text(plan.prompts[prompt_index])
        logprobs = None
        if plan.params.logprobs is not None:
            logprobs = completion_logprobs(self._echo_positions(output), 0, self.tokenizer.token_text)
        choices = [
            CompletionChoice(index=prompt_index * plan.params.n + i, text=text, logprobs=logprobs)
            for i in range(plan.params.n)
        ]
        return CompletionResponse(id=plan.response_id, created=plan.created, model=self.model_name, choices=choices)

    async def chat_chunks(
        self, plan: GenerationPlan, first: tuple[int, RequestOutput], rest: AsyncIterator[tuple[int, RequestOutput]]
    ) -> AsyncIterator[Response]:
        """The SSE chunks of a streaming chat completion, from its first engine output onwards."""
        for index in range(plan.params.n):
            yield ChatCompletionChunk(
                id=plan.response_id,
                created=plan.created,
                model=self.model_name,
                choices=[ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))],
            )
        finals: dict[str, RequestOutput] = {}
        views: dict[int, ChatView] = {}
        is_plain = plan.tool_calling is None and plan.starts_in_reasoning is None
        async with aclosing(self._deltas(plan, first, rest)) as deltas:
            async for delta in deltas:
                logprobs = None
                if plan.params.logprobs is not None:
                    logprobs = chat_logprobs(delta.positions, plan.num_top_logprobs)
                finish_reason = _finish_reason(delta.candidate)
                if is_plain:
                    message = DeltaMessage(content=delta.text)
                else:
                    view = views.setdefault(delta.index, ChatView())
                    message, calls = message_delta(
                        view,
                        delta.candidate.text,
                        finish_reason is not None,
                        plan.tool_calling,
                        plan.starts_in_reasoning,
                    )
                    for call_delta in tool_call_deltas(calls):
                        yield ChatCompletionChunk(
                            id=plan.response_id,
                            created=plan.created,
                            model=self.model_name,
                            choices=[ChatChunkChoice(index=delta.index, delta=call_delta)],
                        )
                    finish_reason = "tool_calls" if calls else finish_reason
                choice = ChatChunkChoice(
                    index=delta.index,
                    delta=message,
                    logprobs=logprobs,
                    finish_reason=finish_reason,
                    stop_reason=delta.candidate.stop_reason,
                    token_ids=delta.token_ids if plan.params.trace else None,
                    trace=delta.trace,
                )
                yield ChatCompletionChunk(
                    id=plan.response_id,
                    created=plan.created,
                    model=self.model_name,
                    choices=[choice],
                    metrics=delta.metrics,
                )
                if delta.output.finished:
                    finals[delta.output.request_id] = delta.output
        if plan.include_usage:
            yield ChatCompletionChunk(
                id=plan.response_id,
                created=plan.created,
                model=self.model_name,
                choices=[],
                usage=usage(list(finals.values())),
            )

    async def _deltas(
        self, plan: GenerationPlan, first: tuple[int, RequestOutput], rest: AsyncIterator[tuple[int, RequestOutput]]
    ) -> AsyncIterator[_Delta]:
        """What is new per choice since the last chunk; one _Delta per choice that changed or finished."""
        cursors: dict[int, _Cursor] = {}
        async with aclosing(_chain(first, rest)) as outputs:
            async for prompt_index, output in outputs:
                for candidate in output.outputs:
                    index = prompt_index * plan.params.n + candidate.index
                    if index not in cursors:
                        echo_length = len(self._prompt_text(plan.prompts[prompt_index])) if plan.echo else 0
                        cursors[index] = _Cursor(text_offset=echo_length)
                    cursor = cursors[index]
                    if cursor.is_finished:
                        continue
                    new_text = candidate.text[cursor.num_chars :]
                    new_ids = candidate.token_ids[cursor.num_tokens :]
                    if not new_text and not new_ids and candidate.finish_reason is None:
                        continue
                    positions = list(zip(new_ids, (candidate.logprobs or [])[cursor.num_tokens :]))
                    is_finished = candidate.finish_reason is not None
                    yield _Delta(
                        index=index,
                        output=output,
                        candidate=candidate,
                        text=new_text,
                        token_ids=list(new_ids),
                        positions=positions,
                        text_offset=cursor.text_offset,
                        trace=_trace(candidate, cursor.num_tokens) if plan.params.trace else None,
                        metrics=self.request_metrics(output) if is_finished else None,
                    )
                    cursor.num_chars, cursor.num_tokens = len(candidate.text), len(candidate.token_ids)
                    cursor.text_offset += _text_length(positions)
                    cursor.is_finished = is_finished

    # ----- helpers ----------------------------------------------------------------------------------------

    def _prompt_text(self, prompt: PromptInput) -> str:
        return prompt.text if prompt.text is not None else self.tokenizer.decode(prompt.token_ids)

    def _echo_positions(self, output: RequestOutput) -> list[tuple[int, PositionLogprobs | None]]:
        """(token id, logprobs) per prompt token; the first token has no logprob (nothing precedes it)."""
        prompt_logprobs = output.prompt_logprobs or []
        return [
            (token_id, prompt_logprobs[i] if i < len(prompt_logprobs) else None)
            for i, token_id in enumerate(output.prompt_token_ids)
        ]

    def request_metrics(self, output: RequestOutput) -> RequestMetricsInfo:
        """tokenriver's per-request metrics (docs/serving.md): the engine's own counts."""
        num_prompt = len(output.prompt_token_ids)
        num_cached = output.metrics.num_cached_tokens
        longest = max((len(c.token_ids) for c in output.outputs), default=0)
        return RequestMetricsInfo(
            time_to_first_token=output.metrics.time_to_first_token,
            time_per_output_token=output.metrics.time_per_output_token(longest),
            queue_time=output.metrics.queue_time,
            num_cached_tokens=num_cached,
            num_prompt_tokens=num_prompt,
            num_generated_tokens=sum(len(c.token_ids) for c in output.outputs),
            num_forward_passes=output.metrics.num_forward_passes,
            kv_blocks=math.ceil((num_prompt + longest) / self.block_size),
            **_speculative_metrics(output),
        )

    def _combined_metrics(self, finals: list[RequestOutput]) -> RequestMetricsInfo:
        """A batch of prompts: counts add up, times are the slowest prompt's."""
        parts = [self.request_metrics(output) for output in finals]
        if len(parts) == 1:
            return parts[0]

        def slowest(name: str) -> float | None:
            values = [getattr(p, name) for p in parts if getattr(p, name) is not None]
            return max(values) if values else None

        num_drafts = sum(p.num_draft_tokens or 0 for p in parts)
        num_accepted = sum(p.num_accepted_draft_tokens or 0 for p in parts)
        speculative = (
            {
                "num_draft_tokens": num_drafts,
                "num_accepted_draft_tokens": num_accepted,
                "draft_acceptance_rate": num_accepted / num_drafts,
            }
            if num_drafts
            else {}
        )
        return RequestMetricsInfo(
            time_to_first_token=slowest("time_to_first_token"),
            time_per_output_token=slowest("time_per_output_token"),
            queue_time=slowest("queue_time"),
            **{
                name: sum(getattr(p, name) for p in parts)
                for name in (
                    "num_cached_tokens",
                    "num_prompt_tokens",
                    "num_generated_tokens",
                    "num_forward_passes",
                    "kv_blocks",
                )
            },
            **speculative,
        )

    # ----- tokenizer and engine endpoints -------------------------------------------------------------

    def tokenize(self, request: TokenizeRequest) -> dict[str, Any]:
        if (request.prompt is None) == (request.messages is None):
            raise InvalidParameterError("send either prompt or messages (exactly one of them)", param="prompt")
        if request.messages is not None:
            token_ids = self.render_chat(request.messages, request.add_generation_prompt, None).token_ids
        else:
            add_special = True if request.add_special_tokens is None else request.add_special_tokens
            token_ids = self.tokenizer.encode(request.prompt, add_special_tokens=add_special)
        return {
            "tokens": token_ids,
            "count": len(token_ids),
            "max_model_len": self.engine.max_model_len,
            "token_strs": [self.tokenizer.token_text(t) for t in token_ids],
        }

    def detokenize(self, request: DetokenizeRequest) -> dict[str, Any]:
        bad = [t for t in request.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidParameterError(
                f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})", param="tokens"
            )
        return {"prompt": self.tokenizer.decode(request.tokens, skip_special_tokens=False)}

    def engine_info(self) -> dict[str, Any]:
        """GET /v1/engine: the KV pool and the scheduler as of the engine loop's last pass, plus the
        speculative-decoding counts when the engine runs a draft."""
        model = self.engine.model_info
        snapshot = self.engine.snapshot()
        stats = snapshot.scheduler
        info: dict[str, Any] = {
            "model": self.model_name,
            "dtype": model.dtype,
            "kv_cache_dtype": model.kv_cache_dtype,
            "block_size": model.block_size,
            "num_blocks": stats.num_blocks_total,
            "num_blocks_used": stats.num_blocks_used,
            "num_blocks_free": stats.num_blocks_free,
            "kv_usage": stats.kv_usage,
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "num_preemptions": stats.num_preempted_total,
            "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
            "num_forward_passes": snapshot.num_forward_passes,
            "max_model_len": model.max_model_len,
            "max_num_batched_tokens": model.max_num_batched_tokens,
            "max_num_seqs": model.max_num_seqs,
            "max_waiting_requests": model.max_waiting_requests,
        }
        if model.speculative_draft is not None:
            info.update(
                speculative_draft=model.speculative_draft,
                num_speculative_tokens=model.num_speculative_tokens,
                num_draft_tokens=stats.num_draft_tokens_total,
                num_accepted_draft_tokens=stats.num_accepted_draft_tokens_total,
                draft_acceptance_rate=stats.draft_acceptance_rate,
                mean_accepted_length=stats.mean_accepted_length,
            )
        return info


# ----- pure mapping functions -------------------------------------------------------------------------


def sampling_params(
    request: SamplingFields,
    *,
    max_tokens: int | None,
    max_tokens_param: str,
    logprobs: int | None,
    logprobs_param: str,
    prompt_logprobs: int | None,
    best_of: int | None,
) -> SamplingParams:
    """Map every sampling field of a request onto SamplingParams; errors name the field the client sent."""
    fields: dict[str, Any] = {
        "n": request.n,
        "best_of": best_of,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "stop": request.stop,
        "seed": request.seed,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "logit_bias": _logit_bias(request.logit_bias),
        "top_k": request.top_k,
        "min_p": request.min_p,
        "repetition_penalty": request.repetition_penalty,
        "min_tokens": request.min_tokens,
        "stop_token_ids": request.stop_token_ids,
        "ignore_eos": request.ignore_eos,
        "skip_special_tokens": request.skip_special_tokens,
        "include_stop_str_in_output": request.include_stop_str_in_output,
        "trace": request.trace,
        "trace_top": request.trace_top,
        "trace_stages": request.trace_stages,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "beam_width": request.beam_width,
        "length_penalty": request.length_penalty,
        "early_stopping": request.early_stopping,
        "beam_trace": request.beam_trace,
    }
    if request.beam_trace and request.stream:
        raise InvalidParameterError(
            "beam_trace comes with the whole response, once the search has ended: send stream: false",
            param="beam_trace",
        )
    found = structured_output(request)
    if found is not None:
        fields["structured_output"] = found[1]
    if request.structured_output_prefix_ids is not None:
        if found is None:
            raise InvalidParameterError(
                "structured_output_prefix_ids needs a constraint (response_format or "
                "structured_outputs) for the grammar to consume them",
                param="structured_output_prefix_ids",
            )
        try:
            fields["structured_output"] = dataclasses.replace(
                found[1], prefix_token_ids=tuple(request.structured_output_prefix_ids)
            )
        except InvalidParameterError as error:
            raise InvalidParameterError(error.message, param="structured_output_prefix_ids") from None
    given = {name: value for name, value in fields.items() if value is not None}
    renames = {"max_tokens": max_tokens_param, "logprobs": logprobs_param, "prompt_logprobs": logprobs_param}
    try:
        return SamplingParams(max_tokens=max_tokens, **given)
    except InvalidParameterError as error:
        name = renames.get(error.param or "", error.param)
        if name == error.param:
            raise
        message = name + error.message[len(error.param) :] if error.message.startswith(error.param) else error.message
        raise InvalidParameterError(message, param=name) from None


def _speculative_metrics(output: RequestOutput) -> dict[str, Any]:
    """The request's speculative-decoding counts, when it had drafts (RequestMetricsInfo's optional fields)."""
    metrics = output.metrics
    if not metrics.num_draft_tokens:
        return {}
    return {
        "num_draft_tokens": metrics.num_draft_tokens,
        "num_accepted_draft_tokens": metrics.num_accepted_draft_tokens,
        "draft_acceptance_rate": metrics.draft_acceptance_rate,
    }


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if bias is None:
        return None
    converted = {}
    for key, value in bias.items():
        if not key.strip().lstrip("-").isdigit():
            raise InvalidParameterError(
                f'logit_bias key {key!r} is not a token id: use token ids as keys, e.g. {{"1234": -100}}',
                param="logit_bias",
            )
        converted[int(key)] = value
    return converted


def _include_usage(request: SamplingFields) -> bool:
    if request.stream_options is not None and not request.stream:
        raise InvalidParameterError("stream_options is only allowed with stream: true", param="stream_options")
    return bool(request.stream_options and request.stream_options.include_usage)


def usage(finals: list[RequestOutput]) -> Usage:
    prompt_tokens = sum(len(output.prompt_token_ids) for output in finals)
    completion_tokens = sum(len(c.token_ids) for output in finals for c in output.outputs)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=sum(output.metrics.num_cached_tokens for output in finals)
        ),
    )


def _finish_reason(candidate: CompletionOutput) -> str | None:
    return candidate.finish_reason.value if candidate.finish_reason is not None else None


def _trace(candidate: CompletionOutput, start: int) -> list[dict[str, Any]]:
    return [step.to_dict() for step in (candidate.trace or [])[start:]]


def _beam_steps(output: RequestOutput) -> list[dict[str, Any]]:
    return [step.to_dict() for step in output.beam_steps or []]


def _text_length(positions: list[tuple[int, PositionLogprobs | None]]) -> int:
    return sum(
        len(logprobs[token_id].decoded_token)
        for token_id, logprobs in positions
        if logprobs is not None and token_id in logprobs
    )


def completion_logprobs(
    positions: list[tuple[int, PositionLogprobs | None]], text_offset: int, token_text: Callable[[int], str]
) -> CompletionLogprobs:
    """The legacy completions format; top_logprobs holds the asked-for alternatives plus the chosen token.

    A position without logprobs (the first prompt token, with echo) still lists its token, with null logprobs.
    """
    result = CompletionLogprobs()
    for token_id, logprobs in positions:
        chosen = logprobs.get(token_id) if logprobs is not None else None
        token = chosen.decoded_token if chosen is not None else token_text(token_id)
        result.tokens.append(token)
        result.token_logprobs.append(chosen.logprob if chosen is not None else None)
        result.top_logprobs.append(
            None
            if logprobs is None
            else {lp.decoded_token: lp.logprob for lp in sorted(logprobs.values(), key=lambda lp: lp.rank)}
        )
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


def chat_logprobs(positions: list[tuple[int, PositionLogprobs]], num_top: int) -> ChatLogprobs:
    """OpenAI's chat format: the chosen token, then exactly the num_top most likely tokens."""
    content = []
    for token_id, logprobs in positions:
        chosen = logprobs[token_id]
        top = sorted((lp for lp in logprobs.values() if lp.rank <= num_top), key=lambda lp: lp.rank)
        content.append(
            TokenLogprob(
                token=chosen.decoded_token,
                logprob=chosen.logprob,
                bytes=list(chosen.decoded_token.encode()),
                top_logprobs=[
                    TopLogprob(token=lp.decoded_token, logprob=lp.logprob, bytes=list(lp.decoded_token.encode()))
                    for lp in top
                ],
            )
        )
    return ChatLogprobs(content=content)


async def _chain(
    first: tuple[int, RequestOutput], rest: AsyncIterator[tuple[int, RequestOutput]]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The first output (already awaited by open_stream) and the rest; closing it closes (aborts) the rest."""
    async with aclosing(rest):
        yield first
        async for item in rest:
            yield item
