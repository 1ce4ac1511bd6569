"""A mixture-of-experts model against a dense model of the same active size, in the same run.

Both are Qwen3 decoders with random weights, built with transformers' config classes and saved as Hugging Face
folders (the embedded model's tokenizer beside them), loaded the way a user would with `LLM(folder,
quantization="int4")` and otherwise default settings:
- MoE (Qwen3-MoE): --experts experts of --expert-size intermediate features, --top-k of them per token;
- dense (Qwen3): one MLP of top_k * expert_size intermediate features, so each token passes through as many
  weights as in the MoE model (the same attention, embedding and output layer).

Measured, alternating MoE and dense for --rounds rounds: single-stream decode tokens/s (128 tokens after a
32-token prompt) and throughput of 32 requests x 128 tokens (generated tokens / wall time). Per token the two do
the same arithmetic; the MoE model's cost is reading its experts: in a batch, the rows routed to each expert
are multiplied by it together, but the more rows a step has the more distinct experts it touches.
Writes benchmarks/results/moe_vs_dense.md and moe_vs_dense.png.

    python benchmarks/moe_vs_dense.py [--experts 32] [--top-k 4] [--expert-size 256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS, machine_line, markdown_table

NOTES = """Where the difference comes from: both run their decoder stack in one native call per step (the MoE
model's layers route each token natively and multiply each chosen expert by the rows routed to it, the chosen
experts shared out among the threads). Per token both do the same arithmetic, but a decode step of one request
reads its 4 experts per layer as 4 pairs of small products instead of one pair of larger ones, and a step of 32
requests touches most of the 32 experts: it reads about 6x the dense model's weights, each expert for a few rows."""
SHAPE = dict(
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


def write_models(folder: Path, args: argparse.Namespace) -> dict[str, Path]:
    """The two random-weight models as Hugging Face folders, with the embedded model's tokenizer."""
    import torch
    import transformers

    from tokenriver import LLM

    tokenizer_json = LLM().get_tokenizer().to_json()
    vocab_size = 49152
    configs = {
        "MoE": transformers.Qwen3MoeConfig(
            **SHAPE,
            vocab_size=vocab_size,
            num_experts=args.experts,
            num_experts_per_tok=args.top_k,
            moe_intermediate_size=args.expert_size,
            intermediate_size=args.top_k * args.expert_size,
            norm_topk_prob=True,
        ),
        "dense": transformers.Qwen3Config(
            **SHAPE, vocab_size=vocab_size, intermediate_size=args.top_k * args.expert_size
        ),
    }
    paths = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        path = folder / name
        model.save_pretrained(path, safe_serialization=True)
        (path / "tokenizer.json").write_text(tokenizer_json)
        paths[name] = path
    return paths


def measure(path: Path, batch: int, max_tokens: int) -> tuple[float, float]:
    """(single-stream decode tokens/s, batch x max_tokens throughput tokens/s) of a fresh engine on path."""
    from tokenriver import LLM, SamplingParams

    llm = LLM(str(path), quantization="int4", max_num_seqs=batch)
    prompt = {"prompt_token_ids": list(range(1000, 1032))}
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)  # warm-up
    (single,) = llm.generate([prompt], params, use_tqdm=False)
    decode = (len(single.outputs[0].token_ids) - 1) / (single.metrics.last_token_time - single.metrics.first_token_time)
    prompts = [{"prompt_token_ids": list(range(1000 + 7 * i, 1032 + 7 * i))} for i in range(batch)]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    throughput = sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - started)
    return decode, throughput


def count_parameters(path: Path) -> tuple[int, int]:
    """(total, per token) parameters of the decoder layers: experts count top_k / experts per token."""
    from safetensors import safe_open

    total = active = 0
    with safe_open(str(next(path.glob("*.safetensors"))), "pt") as tensors:
        for name in tensors.keys():
            if ".layers." not in name:
                continue
            size = tensors.get_slice(name).get_shape()
            count = 1
            for dim in size:
                count *= dim
            total += count
            active += count if ".experts." not in name else 0
    return total, active


def plot(rows: dict[str, dict[str, list[float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for axis, key, title in zip(axes, ("decode", "throughput"), ("single-stream decode", "32 x 128 throughput")):
        names = list(rows)
        axis.bar(names, [statistics.median(rows[name][key]) for name in names], color=["#c0792b", "#3b75af"])
        axis.set_title(f"{title} (tokens/s)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--expert-size", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    runs: dict[str, dict[str, list[float]]] = {
        "MoE": {"decode": [], "throughput": []},
        "dense": {"decode": [], "throughput": []},
    }
    with tempfile.TemporaryDirectory() as scratch:
        paths = write_models(Path(scratch), args)
        sizes = {name: count_parameters(path) for name, path in paths.items()}
        for _ in range(args.rounds):
            for name, path in paths.items():
                decode, throughput = measure(path, args.batch, args.max_tokens)
                runs[name]["decode"].append(decode)
                runs[name]["throughput"].append(throughput)
                print(name, f"decode {decode:.1f}", f"throughput {throughput:.1f}", file=sys.stderr, flush=True)
    expert_params = sizes["MoE"][0] - sizes["MoE"][1]
    active = {"MoE": sizes["MoE"][1] + expert_params * args.top_k // args.experts, "dense": sizes["dense"][0]}
    rows = []
    for name in ("MoE", "dense"):
        decode, throughput = (statistics.median(runs[name][key]) for key in ("decode", "throughput"))
        rows.append(
            [
                name,
                f"{sizes[name][0] / 1e6:.1f}M",
                f"{active[name] / 1e6:.1f}M",
                f"{decode:.1f}",
                f"{throughput:.1f}",
                " / ".join(f"{d:.0f}, {t:.0f}" for d, t in zip(runs[name]["decode"], runs[name]["throughput"])),
            ]
        )
    ratio = [
        statistics.median(runs["MoE"][key]) / statistics.median(runs["dense"][key]) for key in ("decode", "throughput")
    ]
    table = markdown_table(
        [
            "model",
            "layer parameters",
            "active per token",
            "decode tokens/s",
            f"{args.batch} x {args.max_tokens} tokens/s",
            "rounds (decode, throughput)",
        ],
        rows,
    )
    text = (
        f"# Mixture of experts against a dense model of the same active size\n\n"
        f"`python benchmarks/moe_vs_dense.py --experts {args.experts} --top-k {args.top_k} "
        f"--expert-size {args.expert_size} --rounds {args.rounds}`\n\n{machine_line()}\n\n"
        f"Qwen3-MoE ({args.experts} experts of {args.expert_size} features, {args.top_k} per token) and Qwen3 "
        f"(one MLP of {args.top_k * args.expert_size} features), otherwise the same: hidden "
        f"{SHAPE['hidden_size']}, {SHAPE['num_hidden_layers']} layers, int4 weights, random values.\n\n"
        f"![results](moe_vs_dense.png)\n\n{table}\n\n"
        f"MoE / dense: decode {ratio[0]:.2f}x, {args.batch} x {args.max_tokens} throughput {ratio[1]:.2f}x.\n\n"
        f"{NOTES}\n"
    )
    (RESULTS / "moe_vs_dense.md").write_text(text)
    plot(runs, RESULTS / "moe_vs_dense.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
