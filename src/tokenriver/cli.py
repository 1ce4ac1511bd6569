"""tokenriver's command line: generate, chat, serve, visualize.

Engine flags are generated from EngineConfig's fields and sampling flags from
SamplingParams' fields, so a new option appears here without a second list
to keep in sync; only help texts and a few renames live in this file.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any

from tokenriver.config import EngineConfig
from tokenriver.errors import TokenriverError
from tokenriver.outputs import RequestOutput
from tokenriver.params import SamplingParams
from tokenriver.server.cli_serve import add_serve_command
from tokenriver.trace import StepTrace

ENGINE_HELP = {
    "model": "GGUF file or Hugging Face model folder (default: the embedded SmolLM2-135M-Instruct Q4_1)",
    "dtype": "compute dtype: float32 or bfloat16",
    "device": "torch device, e.g. cpu or cuda",
    "kv_cache_memory": "KV pool size, e.g. 2GiB or 512MiB (default 2GiB, capped at what max-num-seqs contexts need)",
    "max_num_kv_tokens": "KV pool size in tokens (instead of --kv-cache-memory)",
    "kv_cache_dtype": "what the KV pool stores: auto (= --dtype), float32, bfloat16, float16 (half the memory "
                      "per token of float32) or int8 (about a quarter: one scale per token and kv head); keys and "
                      "values rounded once when stored",
    "block_size": "tokens per KV block",
    "max_num_seqs": "most requests running at once",
    "max_num_batched_tokens": "most tokens computed in one step (prompt chunks + decode tokens)",
    "max_model_len": "longest sequence, prompt + output (default: the model's context length)",
    "enable_prefix_caching": "reuse the KV blocks of identical prompt prefixes",
    "quantization": "weights: auto keeps a GGUF's Q4_0/Q4_1/Q8_0 packed, none dequantizes to --dtype, "
                    "int8/int4 quantize float weights at load",
    "int8_activations": "quantized weights multiply activations rounded to int8 in decode steps, as llama.cpp "
                        "does, and in larger products too where the CPU has AVX512-VNNI: faster decode, "
                        "prefill and batches, logits within ~1%% of the exact ones",
    "use_kv_cache": "keep K/V between steps (--no-kv-cache recomputes everything each step, to show the cost)",
    "num_threads": "CPU threads (default: the cores available)",
    "seed": "seed for requests that have none",
    "speculative_draft": "speculative decoding: ngram (drafts from the request's own earlier text), self:N (the "
                         "model's first N layers), or a draft model path with the same tokenizer (default: off)",
    "num_speculative_tokens": "draft tokens proposed per step and verified in one forward pass",
    "num_scheduler_steps": "forward passes per step while every request is a plain greedy decode (multi-step "
                           "scheduling: less per-token overhead, tokens streamed in bursts)",
    "ngram_max": "n-gram drafts: longest suffix looked up in the request's earlier tokens",
    "ngram_min": "n-gram drafts: shortest suffix looked up",
    "tensor_parallel_size": "split the model across this many processes (tensor parallelism: attention heads and "
                            "MLP features; gloo on CPU, NCCL on CUDA); see docs/scaling.md",
    "distributed_init_addr": "host:port where tensor-parallel ranks meet; unset: a free local port, or env:// "
                             "under torchrun",
    "nnodes": "machines the tensor-parallel ranks span",
    "node_rank": "this machine's index among --nnodes (0 runs the engine; others run only their ranks)",
}
ENGINE_FLAG_NAMES = {"num_threads": "threads", "seed": "engine-seed", "use_kv_cache": "kv-cache",
                     "enable_prefix_caching": "prefix-caching"}

SAMPLING_HELP = {
    "n": "candidates returned per prompt",
    "best_of": "candidates generated; the n with the highest cumulative log-probability are returned",
    "temperature": "0 = greedy; higher flattens the distribution",
    "top_k": "keep the k most likely tokens (0 = off)",
    "top_p": "keep the smallest set of tokens whose probability reaches top-p",
    "min_p": "drop tokens below min-p times the top token's probability",
    "repetition_penalty": "transformers' repetition penalty (>1 discourages repeats)",
    "presence_penalty": "OpenAI presence penalty, -2..2",
    "frequency_penalty": "OpenAI frequency penalty, -2..2",
    "logit_bias": "TOKEN_ID:BIAS added to that token's logit (repeatable)",
    "seed": "random seed of this request",
    "max_tokens": "most tokens to generate",
    "min_tokens": "EOS and stops are ignored until this many tokens were generated",
    "stop": "stop string (repeatable)",
    "stop_token_ids": "token ids that end generation",
    "ignore_eos": "keep generating past end-of-sequence tokens",
    "logprobs": "print the top-N alternatives of every generated token",
    "prompt_logprobs": "top-N alternatives of every prompt token",
    "skip_special_tokens": "drop special tokens from the text",
    "include_stop_str_in_output": "keep the matched stop string in the text",
    "trace": "print why each token was chosen: a compact table per step",
    "trace_top": "candidates shown per step with --trace",
    "beam_width": "beam search with this many beams (transformers' num_beams); the n best beams are returned",
    "length_penalty": "beam search: beams score sum(logprobs) / length ** length-penalty (>0 favours longer)",
    "early_stopping": "beam search: true, false or never (transformers' meanings)",
}
SAMPLING_DEFAULTS = {"max_tokens": 128, "temperature": 0.0}


def _logit_bias(text: str) -> tuple[int, float]:
    try:
        token_id, bias = text.split(":")
        return int(token_id), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not TOKEN_ID:BIAS, e.g. 1234:-100") from None


def _add_field_flags(parser: argparse.ArgumentParser, cls: type, help_texts: dict[str, str],
                     renames: dict[str, str], defaults: dict[str, Any], dest_prefix: str) -> None:
    """One flag per dataclass field, typed from its annotation."""
    group = parser.add_argument_group(dest_prefix.rstrip("_") + " options")
    for f in dataclasses.fields(cls):
        if f.name not in help_texts:
            continue
        flag = "--" + renames.get(f.name, f.name.replace("_", "-"))
        dest = dest_prefix + f.name
        default = defaults.get(f.name, f.default if f.default is not dataclasses.MISSING else f.default_factory())
        annotation = str(f.type)
        help_text = f"{help_texts[f.name]} (default: {default})"
        if annotation == "bool":
            group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        elif annotation.startswith("list[str]"):
            group.add_argument(flag, dest=dest, action="append", default=None, help=help_text)
        elif annotation.startswith("list[int]"):
            group.add_argument(flag, dest=dest, type=int, nargs="+", default=None, help=help_text)
        elif annotation.startswith("dict[int, float]"):
            group.add_argument(flag, dest=dest, type=_logit_bias, action="append", default=None, help=help_text)
        else:
            kind = int if annotation.startswith("int") else float if annotation.startswith("float") else str
            group.add_argument(flag, dest=dest, type=kind, default=default, help=help_text)


def _collect(args: argparse.Namespace, prefix: str) -> dict[str, Any]:
    values = {k[len(prefix):]: v for k, v in vars(args).items() if k.startswith(prefix) and v is not None}
    if isinstance(values.get("logit_bias"), list):
        values["logit_bias"] = dict(values["logit_bias"])
    return values


def engine_config_from(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**_collect(args, "engine_"))


def sampling_params_from(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(**_collect(args, "sampling_"))


def format_trace(trace: StepTrace) -> str:
    """A compact table of one step: the candidates, their probabilities, and what removed them."""
    lines = [f"step {trace.index}: rank {trace.chosen_rank}, p_raw {trace.chosen_prob_raw:.3f}, "
             f"p_final {trace.chosen_prob_final:.3f}, entropy {trace.entropy_raw:.2f} nats, "
             f"{trace.num_candidates_kept} kept, {trace.method}"]
    for c in trace.candidates:
        marker = "→" if c.token_id == trace.chosen_token_id else " "
        removed = f"removed by {c.removed_by}" if c.removed_by else ""
        lines.append(f"  {marker} {c.rank:>5} {c.text!r:<18.18} id {c.token_id:<6} logit {c.logit:8.3f} "
                     f"p_raw {c.prob_raw:6.3f} p_final {c.prob_final:6.3f} {removed}")
    return "\n".join(lines)


def _print_summary(output: RequestOutput, elapsed: float) -> None:
    completion = output.outputs[0]
    metrics = output.metrics
    ttft = metrics.time_to_first_token
    tpot = metrics.time_per_output_token(len(completion.token_ids))
    decode_rate = f"{1 / tpot:.1f} tokens/s" if tpot else "n/a"
    print(f"\n\n[prompt tokens: {len(output.prompt_token_ids)} | generated tokens: {len(completion.token_ids)} | "
          f"finish: {completion.finish_reason.value if completion.finish_reason else None} | "
          f"time to first token: {ttft:.3f} s | decode: {decode_rate} | total: {elapsed:.2f} s]", file=sys.stderr)


def _stream_to_terminal(llm: Any, prompt: Any, params: SamplingParams) -> RequestOutput:
    started = time.perf_counter()
    final = None
    for output in llm.stream(prompt, params):
        sys.stdout.write(output.outputs[0].delta_text)
        sys.stdout.flush()
        final = output
    if params.trace and final.outputs[0].trace:
        print("\n", file=sys.stderr)
        for trace in final.outputs[0].trace:
            print(format_trace(trace), file=sys.stderr)
    if params.logprobs is not None and final.outputs[0].logprobs:
        print("\n", file=sys.stderr)
        for token_id, position in zip(final.outputs[0].token_ids, final.outputs[0].logprobs):
            alternatives = ", ".join(f"{lp.decoded_token!r} {lp.logprob:.3f}" for tid, lp in
                                     sorted(position.items(), key=lambda item: item[1].rank))
            print(f"  {position[token_id].decoded_token!r}: {alternatives}", file=sys.stderr)
    _print_summary(final, time.perf_counter() - started)
    return final


def cmd_generate(args: argparse.Namespace) -> int:
    from tokenriver.engine.llm import LLM

    params = sampling_params_from(args)
    llm = LLM(**dataclasses.asdict(engine_config_from(args)))
    prompt: Any = args.prompt
    if args.chat_template:
        text = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": args.prompt}])
        prompt = {"prompt": text, "prompt_token_ids": llm.get_tokenizer().encode(text, add_special_tokens=False)}
    if params.num_generated == 1:
        _stream_to_terminal(llm, prompt, params)
        return 0
    started = time.perf_counter()
    (output,) = llm.generate([prompt], params, use_tqdm=False)
    for completion in output.outputs:
        print(f"--- candidate {completion.index} (cumulative logprob {completion.cumulative_logprob:.3f}) ---")
        print(completion.text)
    _print_summary(output, time.perf_counter() - started)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from tokenriver.engine.llm import LLM

    params = sampling_params_from(args)
    llm = LLM(**dataclasses.asdict(engine_config_from(args)))
    tokenizer = llm.get_tokenizer()
    messages: list[dict[str, str]] = []
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
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        print("assistant> ", end="", flush=True)
        final = _stream_to_terminal(
            llm, {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}, params)
        messages.append({"role": "assistant", "content": final.outputs[0].text})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenriver",
        description="A readable LLM inference engine that shows how generation happens.",
        epilog="Examples:\n  tokenriver generate \"The capital of France is\" --max-tokens 32\n"
               "  tokenriver generate \"Once upon a time\" --temperature 0.8 --top-p 0.9 --seed 1 --trace\n"
               "  tokenriver chat --model path/to/model.gguf\n"
               "  tokenriver serve --port 8000      (OpenAI-compatible API; the visualizer at /)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    generate = commands.add_parser("generate", help="stream a completion of one prompt to the terminal",
                                   description="Stream a completion of PROMPT, then print timings.")
    generate.add_argument("prompt", help="the text to continue")
    generate.add_argument("--chat-template", action="store_true",
                          help="wrap the prompt as one user message in the model's chat template")
    chat = commands.add_parser("chat", help="multi-turn conversation through the model's chat template",
                               description="An interactive chat; each reply streams as it is generated.")
    chat.add_argument("--system", default=None, help="a system message that opens the conversation")
    for sub in (generate, chat):
        _add_field_flags(sub, EngineConfig, ENGINE_HELP, ENGINE_FLAG_NAMES, {}, "engine_")
        _add_field_flags(sub, SamplingParams, SAMPLING_HELP, {}, SAMPLING_DEFAULTS, "sampling_")
    generate.set_defaults(handler=cmd_generate)
    chat.set_defaults(handler=cmd_chat)
    add_serve_command(commands,
                      add_engine_flags=lambda sub: _add_field_flags(sub, EngineConfig, ENGINE_HELP, ENGINE_FLAG_NAMES,
                                                                    {}, "engine_"),
                      engine_config_from=engine_config_from)
    _add_scale_out_flags(commands.choices["serve"])
    return parser


def _add_scale_out_flags(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("scale-out options (docs/scaling.md)")
    group.add_argument("--data-parallel-size", type=int, default=1,
                       help="engine replicas behind one endpoint, on Ray Serve (needs the ray extra: "
                            "pip install 'tokenriver[ray]'); RAY_ADDRESS joins an existing cluster (default: 1)")
    group.add_argument("--router", choices=["prefix", "round_robin"], default="prefix",
                       help="how requests are spread over replicas: longest cached prefix within load "
                            "limits, or round robin (default: %(default)s)")


def cmd_serve_data_parallel(args: argparse.Namespace) -> int:
    """`serve --data-parallel-size N` (N > 1): the same API from N replicas on Ray Serve."""
    from tokenriver.server.cli_serve import server_config_from

    try:
        from tokenriver.serve_ray.app import run_data_parallel
    except ImportError as error:
        raise TokenriverError(f"--data-parallel-size needs Ray Serve ({error}): pip install 'tokenriver[ray]'",
                              param="data_parallel_size") from None
    return run_data_parallel(engine_config_from(args), server_config_from(args), args.data_parallel_size,
                             args.router)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if getattr(args, "engine_tensor_parallel_size", 1) > 1:
            from tokenriver.engine.tensor_parallel import run_worker_node

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
