"""tokenriver's command line: generate, chat, embed, rerank, serve, visualize.

Engine flags are generated from the fields of EngineConfig and its parts, and
sampling flags from SamplingParams' fields, each with the help in its field's
metadata (flags.py), so a new option appears here without a second list to keep
in sync; only the command line's own sampling defaults live in this file.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import sys
import time
from typing import Any

from tokenriver.config import EngineConfig
from tokenriver.errors import InvalidParameterError, TokenriverError
from tokenriver.flags import add_flags, collect
from tokenriver.outputs import CompletionOutput, RequestOutput
from tokenriver.params import PoolingParams, SamplingParams, StructuredOutput
from tokenriver.server.cli_serve import add_serve_command
from tokenriver.tool_calls import CHOICES, ToolCalling
from tokenriver.trace import StepTrace

# The command line's own defaults, where they differ from SamplingParams': a short greedy completion.
SAMPLING_DEFAULTS = {"max_tokens": 128, "temperature": 0.0}
# How errors name the user's own constraint (it cannot be combined with enforced tools).
_STRUCTURED_OUTPUT_FLAGS = "--json-schema, --json-object, --regex, --choice or --grammar"


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """EngineConfig's fields as flags, one group per part (help from each field's metadata)."""
    add_flags(parser, EngineConfig, "engine_", "engine options")
    for name, part in EngineConfig.parts().items():
        add_flags(parser, part, "engine_", f"engine options: {name}")


def engine_options_from(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags, by field name, as LLM(...) and EngineConfig.from_flat take them."""
    return collect(args, "engine_")


def engine_config_from(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig.from_flat(**engine_options_from(args))


def sampling_params_from(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(**collect(args, "sampling_"), structured_output=structured_output_from(args))


def _add_structured_output_flags(parser: argparse.ArgumentParser) -> None:
    """At most one constraint on the output (SamplingParams.structured_output)."""
    group = parser.add_argument_group("structured output (one of)").add_mutually_exclusive_group()
    group.add_argument("--json-schema", metavar="FILE|JSON", help="the output validates against this JSON schema")
    group.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    group.add_argument("--regex", help="the whole output matches this regular expression")
    group.add_argument("--choice", action="append", help="the output is one of these strings (repeatable)")
    group.add_argument("--grammar", metavar="FILE|TEXT", help="the output follows this Lark or GBNF grammar")


def _add_tool_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("tool calling (docs/structured_output.md)")
    group.add_argument(
        "--tools",
        metavar="FILE|JSON",
        help="OpenAI tool definitions (a JSON list) the model may call; its calls are printed as "
        "JSON lines (generate: the prompt becomes a chat message)",
    )
    group.add_argument(
        "--tool-choice",
        metavar="auto|none|required|NAME",
        help="whether the model must call a tool, and which (a function's name); default: auto",
    )


def tools_from(args: argparse.Namespace) -> tuple[list[dict[str, Any]] | None, str | dict[str, Any] | None]:
    """(tools, tool_choice) as LLM.chat takes them, from --tools and --tool-choice; checked before the model loads."""
    tools = None
    if getattr(args, "tools", None) is not None:
        try:
            tools = json.loads(_file_or_text(args.tools))
        except ValueError as error:
            raise InvalidParameterError(
                f"--tools is neither a file nor valid JSON ({error}): give a JSON list of "
                f"tool definitions, or a file that holds one",
                param="tools",
            ) from None
    choice = getattr(args, "tool_choice", None)
    if choice is not None and choice not in CHOICES:
        choice = {"type": "function", "function": {"name": choice}}
    ToolCalling(tools, choice, None, None)  # the same checks LLM.chat makes, before the model loads
    return tools, choice


def _file_or_text(value: str) -> str:
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as file:
            return file.read()
    return value


def structured_output_from(args: argparse.Namespace) -> StructuredOutput | None:
    """The constraint the structured-output flags ask for, or None."""
    if getattr(args, "json_schema", None) is not None:
        return StructuredOutput("json_schema", _file_or_text(args.json_schema))
    if getattr(args, "json_object", False):
        return StructuredOutput.json_object()
    if getattr(args, "regex", None) is not None:
        return StructuredOutput.regex(args.regex)
    if getattr(args, "choice", None):
        return StructuredOutput.choice(args.choice)
    if getattr(args, "grammar", None) is not None:
        return StructuredOutput.grammar(_file_or_text(args.grammar))
    return None


def format_trace(trace: StepTrace) -> str:
    """A compact table of one step: the candidates, their probabilities, and what removed them."""
    lines = [
        f"step {trace.index}: rank {trace.chosen_rank}, p_raw {trace.chosen_prob_raw:.3f}, "
        f"p_final {trace.chosen_prob_final:.3f}, entropy {trace.entropy_raw:.2f} nats, "
        f"{trace.num_candidates_kept} kept, {trace.method}"
    ]
    for c in trace.candidates:
        marker = "→" if c.token_id == trace.chosen_token_id else " "
        removed = f"removed by {c.removed_by}" if c.removed_by else ""
        lines.append(
            f"  {marker} {c.rank:>5} {c.text!r:<18.18} id {c.token_id:<6} logit {c.logit:8.3f} "
            f"p_raw {c.prob_raw:6.3f} p_final {c.prob_final:6.3f} {removed}"
        )
    return "\n".join(lines)


def _print_summary(output: RequestOutput, elapsed: float) -> None:
    completion = output.outputs[0]
    metrics = output.metrics
    ttft = metrics.time_to_first_token
    tpot = metrics.time_per_output_token(len(completion.token_ids))
    decode_rate = f"{1 / tpot:.1f} tokens/s" if tpot else "n/a"
    print(
        f"\n\n[prompt tokens: {len(output.prompt_token_ids)} | generated tokens: {len(completion.token_ids)} | "
        f"finish: {completion.finish_reason.value if completion.finish_reason else None} | "
        f"time to first token: {ttft:.3f} s | decode: {decode_rate} | total: {elapsed:.2f} s]",
        file=sys.stderr,
    )


def _stream_to_terminal(
    llm: Any, prompt: Any, params: SamplingParams, tool_calling: ToolCalling | None = None
) -> RequestOutput:
    """Stream the reply; with tools, only the text that is surely content, then the parsed calls as JSON lines."""
    started = time.perf_counter()
    final = None
    shown = ""
    for output in llm.stream(prompt, params):
        if tool_calling is None:
            sys.stdout.write(output.outputs[0].delta_text)
        else:
            visible = tool_calling.visible_content(output.outputs[0].text)
            if visible.startswith(shown):  # content only grows; what was shown stays shown
                sys.stdout.write(visible[len(shown) :])
                shown = visible
        sys.stdout.flush()
        final = output
    if tool_calling is not None:
        _print_tool_reply(final.outputs[0], tool_calling, shown)
    if params.trace and final.outputs[0].trace:
        print("\n", file=sys.stderr)
        for trace in final.outputs[0].trace:
            print(format_trace(trace), file=sys.stderr)
    if params.logprobs is not None and final.outputs[0].logprobs:
        print("\n", file=sys.stderr)
        for token_id, position in zip(final.outputs[0].token_ids, final.outputs[0].logprobs):
            alternatives = ", ".join(
                f"{lp.decoded_token!r} {lp.logprob:.3f}"
                for tid, lp in sorted(position.items(), key=lambda item: item[1].rank)
            )
            print(f"  {position[token_id].decoded_token!r}: {alternatives}", file=sys.stderr)
    _print_summary(final, time.perf_counter() - started)
    return final


def _print_tool_reply(completion: CompletionOutput, tool_calling: ToolCalling, shown: str) -> None:
    """Parse a finished reply into completion.content / tool_calls; print the content not yet shown, then one
    JSON line per call, in OpenAI's shape (ready to go back into a conversation)."""
    completion.content, completion.tool_calls = tool_calling.parse(completion.text)
    content = completion.content or ""
    sys.stdout.write(content[len(shown) :] if content.startswith(shown) else "\n" + content)
    if completion.tool_calls and content:
        sys.stdout.write("\n")
    for call in completion.tool_calls:
        print(json.dumps(_openai_call(call), ensure_ascii=False))
    sys.stdout.flush()


def _openai_call(call: Any) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def cmd_generate(args: argparse.Namespace) -> int:
    from tokenriver.engine.llm import LLM

    params = sampling_params_from(args)
    tools, tool_choice = tools_from(args)
    llm = LLM(**engine_options_from(args))
    prompt: Any = args.prompt
    tool_calling = None
    if args.chat_template or tools is not None:
        tool_calling = llm.tool_calling(tools, tool_choice)
        params = tool_calling.constrain(params, _STRUCTURED_OUTPUT_FLAGS)
        prompt = llm.chat_prompt([{"role": "user", "content": args.prompt}], tool_calling=tool_calling)
    tool_calling = tool_calling if tool_calling is not None and tool_calling.is_active else None
    if params.num_generated == 1:
        _stream_to_terminal(llm, prompt, params, tool_calling)
        return 0
    started = time.perf_counter()
    (output,) = llm.generate([prompt], params, use_tqdm=False)
    for completion in output.outputs:
        print(f"--- candidate {completion.index} (cumulative logprob {completion.cumulative_logprob:.3f}) ---")
        if tool_calling is None:
            print(completion.text)
        else:
            _print_tool_reply(completion, tool_calling, "")
            print()
    _print_summary(output, time.perf_counter() - started)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from tokenriver.engine.llm import LLM

    params = sampling_params_from(args)
    tools, tool_choice = tools_from(args)
    llm = LLM(**engine_options_from(args))
    tool_calling = llm.tool_calling(tools, tool_choice)
    params = tool_calling.constrain(params, _STRUCTURED_OUTPUT_FLAGS)
    messages: list[dict[str, Any]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("tokenriver chat: type a message; /reset clears the conversation, /exit or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        print("assistant> ", end="", flush=True)
        final = _stream_to_terminal(
            llm,
            llm.chat_prompt(messages, tool_calling=tool_calling),
            params,
            tool_calling if tool_calling.is_active else None,
        )
        reply = final.outputs[0]
        if reply.tool_calls:
            messages.append(
                {
                    "role": "assistant",
                    "content": reply.content,
                    "tool_calls": [_openai_call(call) for call in reply.tool_calls],
                }
            )
        else:
            messages.append(
                {"role": "assistant", "content": reply.content if reply.content is not None else reply.text}
            )


def cmd_embed(args: argparse.Namespace) -> int:
    """One JSON line per text: its index and its embedding."""
    from tokenriver.engine.llm import LLM

    params = PoolingParams(normalize=not args.no_normalize, dimensions=args.dimensions)  # pooling: --pooling
    llm = LLM(**engine_options_from(args))
    for index, output in enumerate(llm.embed(args.texts, params, use_tqdm=False)):
        print(json.dumps({"index": index, "embedding": output.embedding}))
    return 0


def cmd_rerank(args: argparse.Namespace) -> int:
    """The documents best first, one line each: score, index, text."""
    from tokenriver.engine.llm import LLM

    llm = LLM(**engine_options_from(args))
    for result in llm.rerank(args.query, args.documents, args.top_n, args.instruction, use_tqdm=False):
        print(f"{result.relevance_score:.4f}  [{result.index}]  {result.document}")
    return 0


def _add_pooling_commands(commands: Any) -> None:
    embed = commands.add_parser(
        "embed",
        help="print the embedding of each text (one JSON line per text)",
        description="Embed each TEXT with the model and print one JSON line per text: its index and its vector.",
    )
    embed.add_argument("texts", nargs="+", metavar="TEXT", help="a text to embed")
    embed.add_argument("--dimensions", type=int, default=None, help="keep the first N values (Matryoshka models)")
    embed.add_argument("--no-normalize", action="store_true", help="leave the vectors at their own length")
    rerank = commands.add_parser(
        "rerank",
        help="rank documents by relevance to a query",
        description="Score each DOCUMENT against QUERY (a cross-encoder's head, or a causal model's yes/no) and "
        "print them best first.",
    )
    rerank.add_argument("query", help="what the documents should answer")
    rerank.add_argument("documents", nargs="+", metavar="DOCUMENT", help="a text to rank")
    rerank.add_argument("--top-n", type=int, default=None, help="print only the best N")
    rerank.add_argument("--instruction", default=None, help="a causal judge's instruction: what relevant means")
    for sub in (embed, rerank):
        add_engine_flags(sub)
    embed.set_defaults(handler=cmd_embed)
    rerank.set_defaults(handler=cmd_rerank)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenriver",
        description="A readable LLM inference engine that shows how generation happens.",
        epilog='Examples:\n  tokenriver generate "The capital of France is" --max-tokens 32\n'
        '  tokenriver generate "Once upon a time" --temperature 0.8 --top-p 0.9 --seed 1 --trace\n'
        "  tokenriver chat --model path/to/model.gguf\n"
        '  tokenriver embed "first text" "second text"\n'
        "  tokenriver serve --port 8000      (OpenAI-compatible API; the visualizer at /)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    generate = commands.add_parser(
        "generate",
        help="stream a completion of one prompt to the terminal",
        description="Stream a completion of PROMPT, then print timings.",
    )
    generate.add_argument("prompt", help="the text to continue")
    generate.add_argument(
        "--chat-template", action="store_true", help="wrap the prompt as one user message in the model's chat template"
    )
    chat = commands.add_parser(
        "chat",
        help="multi-turn conversation through the model's chat template",
        description="An interactive chat; each reply streams as it is generated.",
    )
    chat.add_argument("--system", default=None, help="a system message that opens the conversation")
    for sub in (generate, chat):
        add_engine_flags(sub)
        add_flags(sub, SamplingParams, "sampling_", "sampling options", defaults=SAMPLING_DEFAULTS)
        _add_structured_output_flags(sub)
        _add_tool_flags(sub)
    generate.set_defaults(handler=cmd_generate)
    chat.set_defaults(handler=cmd_chat)
    _add_pooling_commands(commands)
    add_serve_command(commands, add_engine_flags=add_engine_flags, engine_config_from=engine_config_from)
    _add_scale_out_flags(commands.choices["serve"])
    return parser


def _import_engine() -> None:
    """Import torch and the engine with the cycle collector paused.

    The imports create a few hundred thousand objects that live as long as the process (modules, classes,
    functions); the collector would traverse them again and again while they are created, freeing nothing.
    freeze() + unfreeze() then moves them straight to the oldest generation (not exempt from collection, only
    not traversed by the young generations' passes). A process tuning its own collector is left alone: this runs
    for the command line only.
    """
    collecting = gc.isenabled()
    gc.disable()
    try:
        importlib.import_module("tokenriver.engine.llm")
        importlib.import_module("tokenriver.engine.async_engine")
    finally:
        gc.freeze()
        gc.unfreeze()
        if collecting:
            gc.enable()


def _add_scale_out_flags(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("scale-out options (docs/scaling.md)")
    group.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine replicas behind one endpoint, on Ray Serve (needs the ray extra: "
        "pip install 'tokenriver[ray]'); RAY_ADDRESS joins an existing cluster (default: 1)",
    )
    group.add_argument(
        "--router",
        choices=["prefix", "round_robin"],
        default="prefix",
        help="how requests are spread over replicas: longest cached prefix within load "
        "limits, or round robin (default: %(default)s)",
    )


def cmd_serve_data_parallel(args: argparse.Namespace) -> int:
    """`serve --data-parallel-size N` (N > 1): the same API from N replicas on Ray Serve."""
    from tokenriver.server.cli_serve import server_config_from

    try:
        from tokenriver.serve_ray.app import run_data_parallel
    except ImportError as error:
        raise TokenriverError(
            f"--data-parallel-size needs Ray Serve ({error}): pip install 'tokenriver[ray]'", param="data_parallel_size"
        ) from None
    return run_data_parallel(engine_config_from(args), server_config_from(args), args.data_parallel_size, args.router)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _import_engine()
        if getattr(args, "engine_tensor_parallel_size", 1) > 1:
            from tokenriver.distributed.launch import run_worker_node

            code = run_worker_node(engine_config_from(args))  # None where this process runs the engine
            if code is not None:
                return code
        if getattr(args, "data_parallel_size", 1) > 1:
            return cmd_serve_data_parallel(args)
        return args.handler(args)
    except TokenriverError as error:
        print(f"error: {error.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
