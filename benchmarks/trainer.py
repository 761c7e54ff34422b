"""Training throughput of packed micro-batches against padded batches, and the cost of building rows, on CPU.

**(a) Packing.** The tiny model (float32, CPU) trains on ``--rows`` synthetic agent rows: lengths lognormal
(median 256 tokens, σ 0.9) clipped to 64-2048, so most rows are short and a few are long; each row is a
prompt (the first third) then alternating sampled completions (targets, 20-150 tokens) and tool outputs
(context, 20-300 tokens). Rows belong to ``--rollouts`` rollouts, weighted ``1 / (N_r · R)``, with random
advantages. One *pass* trains every row once: planning and collating, forward, per-token logprobs at the
targets (``targets_only``), the loss (truncated IS, with entropies) and backward; no optimizer step. Variants:

- **packed**: ``plan_micro_batches`` at ``--token-budget`` + ``collate``, the model switched to
  ``packed_sdpa`` (``use_packed_attention``: causal sdpa row by row);
- **packed, block mask**: the same micro-batches under transformers' own sdpa, which builds a dense
  ``[T, T]`` block-diagonal mask (correct, but ``T²`` attention; shown for the record);
- **padded**: the same micro-batches (same rows, same grouping, same budget) right-padded to their longest
  row, transformers' sdpa with the padding mask: the baseline of the target;
- **padded, length-sorted**: rows sorted by length and grouped greedily so that rows × longest row stays
  within the budget: padding's best case, shown for the record.

Measured: trained (target) tokens per second of a pass; each repeat runs every variant once, in rotating
order, after one untimed warm-up pass each; the report gives the median and range over repeats, and each
variant's same-repeat ratio to **padded**. Target: packed ≥ 1.5× padded. One torch thread by default (as in
``benchmarks/engine.py``): on a small shared machine extra intra-op threads mostly measure the neighbours,
and packed attention's many small per-row kernels suffer most from their barriers.

**(b) Rows.** ``--traces`` generated append-only traces of ``--turns`` turns (a 2,000-token system prompt;
each turn samples 50-400 tokens, then a 50-800-token tool result is appended): ``build_rows`` is timed per
trace (validation and generation excluded). Reported: forwarded / unique tokens (``row_stats``; target ≤
1.05) and build time per million tokens of trace input (the sum over turns of prompt + completion lengths,
what the trace carries) and per million unique tokens.

Output: one table per part, then PASS/MISS per target; a MISS does not fail the run (exit 0) unless
``--strict``. Run: ``python benchmarks/trainer.py [--quick] [--rows 96] [--token-budget 8192] [--repeats 3]
[--traces 8] [--turns 50] [--threads 1] [--json OUT] [--strict]``; ``--quick`` is the tiny configuration the
test uses.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harness_trainer.trainer.step.rows import Row

if not __package__:  # run as a script (python benchmarks/trainer.py): its siblings import from the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import positive, print_verdicts

MIN_SPEEDUP = 1.5
MAX_FORWARD_RATIO = 1.05
TARGET_NAMES = ("packed >= 1.5x padded trained tokens/s", "rows forward <= 1.05x unique tokens")
BASELINE = "padded"
VARIANTS = ("packed", "packed, block mask", BASELINE, "padded, length-sorted")
VOCAB = 4096
LENGTHS = (64, 2048)

FULL = {"rows": 96, "rollouts": 16, "token_budget": 8192, "repeats": 3, "traces": 8, "turns": 50}
QUICK = {"rows": 12, "rollouts": 4, "token_budget": 2048, "repeats": 1, "traces": 2, "turns": 50}


# ------------------------------------------------------------------------------------------- (a) packing


def agent_rows(count: int, rollouts: int, seed: int) -> list[Row]:
    """Synthetic rows shaped like agent traces (see the module docstring); row ``i`` is rollout ``i % R``."""
    from harness_trainer.trainer.step.rows import Row

    rng = random.Random(seed)
    rows = []
    for i in range(count):
        n = int(min(LENGTHS[1], max(LENGTHS[0], rng.lognormvariate(5.545, 0.9))))  # median e^5.545 = 256
        targets = [0] * n
        position, sampled = n // 3, True
        while position < n:
            end = min(n, position + (rng.randint(20, 150) if sampled else rng.randint(20, 300)))
            targets[position:end] = [int(sampled)] * (end - position)
            position, sampled = end, not sampled
        logps = [-rng.uniform(0.05, 3.0) if bit else 0.0 for bit in targets]
        rows.append(Row(i % rollouts, [rng.randrange(VOCAB) for _ in range(n)], targets, logps))
    return rows


def length_sorted_batches(rows: Sequence[Row], token_budget: int) -> list[list[Row]]:
    """Rows by length, grouped greedily while rows × longest row stays within the budget."""
    batches: list[list[Row]] = []
    for row in sorted(rows, key=lambda r: len(r.input_ids)):
        batch = batches[-1] if batches else None
        if batch and (len(batch) + 1) * len(row.input_ids) <= token_budget:
            batch.append(row)
        else:
            batches.append([row])
    return batches


@dataclass
class Variant:
    """One way to train the rows: a model, packed or padded collation, and how rows are grouped."""

    name: str
    model: Any
    packed: bool
    batches: Callable[[Sequence[Row], int], list[list[Row]]]


def train_pass(variant: Variant, rows: Sequence[Row], step: dict[str, Any]) -> dict[str, float]:
    """Forward and backward over every row once; trained tokens, padded tensor tokens and seconds."""
    from harness_trainer.trainer.step.logprobs import token_logprobs, token_logprobs_padded
    from harness_trainer.trainer.step.loss import policy_loss
    from harness_trainer.trainer.step.packing import collate, collate_padded

    trained = tensor_tokens = 0
    start = time.perf_counter()
    batches = variant.batches(rows, step["token_budget"])
    for micro in batches:
        if variant.packed:
            batch = collate(micro, step["advantages"], step["weights"])
            logps, entropy = token_logprobs(variant.model, batch, 1.0, targets_only=True)
        else:
            batch = collate_padded(micro, step["advantages"], step["weights"])
            logps, entropy = token_logprobs_padded(variant.model, batch, 1.0, targets_only=True)
        loss, _ = policy_loss(logps, batch, step["loss"], entropy=entropy)
        loss.backward()
        trained += batch.n_targets
        tensor_tokens += batch.input_ids.numel()
    seconds = time.perf_counter() - start
    variant.model.zero_grad(set_to_none=True)
    return {
        "trained_tokens": trained,
        "tensor_tokens": tensor_tokens,
        "batches": len(batches),
        "seconds": seconds,
        "tps": trained / seconds,
    }


def run_packing(config: dict[str, Any], model_dir: str) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from harness_trainer.trainer.step.logprobs import use_packed_attention
    from harness_trainer.trainer.step.loss import LossConfig
    from harness_trainer.trainer.step.packing import plan_micro_batches

    def load() -> Any:
        sdpa = {"dtype": torch.float32, "attn_implementation": "sdpa"}
        return AutoModelForCausalLM.from_pretrained(model_dir, **sdpa)

    packed_model, sdpa_model = load().train(), load().train()
    use_packed_attention(packed_model)
    variants = [
        Variant("packed", packed_model, True, plan_micro_batches),
        Variant("packed, block mask", sdpa_model, True, plan_micro_batches),
        Variant(BASELINE, sdpa_model, False, plan_micro_batches),
        Variant("padded, length-sorted", sdpa_model, False, length_sorted_batches),
    ]
    rows = agent_rows(config["rows"], config["rollouts"], config["seed"])
    rng = random.Random(config["seed"])
    trained: dict[int, int] = defaultdict(int)
    for row in rows:
        trained[row.rollout] += row.n_targets
    step = {
        "token_budget": config["token_budget"],
        "advantages": {r: rng.gauss(0.0, 1.0) for r in trained},
        "weights": {r: 1.0 / (n * len(trained)) for r, n in trained.items()},
        "loss": LossConfig(),
    }
    for variant in variants:  # warm-up, not timed: allocator, kernels, lazy imports
        train_pass(variant, rows[: max(2, len(rows) // 8)], step)
    samples: dict[str, list[dict[str, float]]] = {v.name: [] for v in variants}
    for repeat in range(config["repeats"]):
        order = variants[repeat % len(variants) :] + variants[: repeat % len(variants)]
        this = {v.name: train_pass(v, rows, step) for v in order}
        for name, sample in this.items():
            samples[name].append(sample | {"vs_padded": sample["tps"] / this[BASELINE]["tps"]})
        line = ", ".join(f"{name} {this[name]['tps']:.0f}" for name in VARIANTS)
        print(f"repeat {repeat + 1}/{config['repeats']}: trained tok/s: {line}", flush=True)
    lengths = [len(row.input_ids) for row in rows]
    workload = {"rows": len(rows), "tokens": sum(lengths), "trained_tokens": sum(r.n_targets for r in rows)}
    workload |= {"length_median": statistics.median(lengths), "length_max": max(lengths)}
    return {"workload": workload, "variants": {name: summarize(samples[name]) for name in VARIANTS}}


def summarize(samples: list[dict[str, float]]) -> dict[str, Any]:
    def spread(values: list[float]) -> dict[str, float]:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    first = samples[0]
    return {
        "batches": first["batches"],
        "trained_tokens": first["trained_tokens"],
        "tensor_tokens": first["tensor_tokens"],
        "tps": spread([s["tps"] for s in samples]),
        "vs_padded": spread([s["vs_padded"] for s in samples]),
        "repeats": samples,
    }


# ---------------------------------------------------------------------------------------------- (b) rows


def append_only_trace(turns: int, seed: int) -> Any:
    """A validated trace whose every prompt extends the previous prompt + completion + a tool result."""
    from harness_trainer.trace import TrainingTrace

    rng = random.Random(seed)
    prompt = [rng.randrange(VOCAB) for _ in range(2000)]
    records = []
    for turn in range(turns):
        completion = [rng.randrange(VOCAB) for _ in range(rng.randint(50, 400))]
        records.append(
            {
                "node_id": f"call-{turn}",
                "prompt_token_ids": prompt,
                "completion_token_ids": completion,
                "per_token_logps": [-rng.uniform(0.0, 4.0) for _ in completion],
                "loss_mask": [0] * len(prompt) + [1] * len(completion),
            }
        )
        prompt = prompt + completion + [rng.randrange(VOCAB) for _ in range(rng.randint(50, 800))]
    return TrainingTrace.model_validate({"turns": records})


def run_rows(config: dict[str, Any]) -> dict[str, Any]:
    from harness_trainer.trainer.step.rows import build_rows, row_stats

    totals = {"rows": 0, "input_tokens": 0, "unique_tokens": 0, "forwarded_tokens": 0}
    seconds = 0.0
    for i in range(config["traces"]):
        trace = append_only_trace(config["turns"], config["seed"] + i)
        start = time.perf_counter()
        built = build_rows(trace, rollout=i)
        seconds += time.perf_counter() - start
        stats = row_stats(trace, built)
        totals["rows"] += stats.rows
        totals["input_tokens"] += sum(
            len(t.prompt_token_ids) + len(t.completion_token_ids) for t in trace.turns
        )
        totals["unique_tokens"] += stats.unique_tokens
        totals["forwarded_tokens"] += stats.forwarded_tokens
    return {"traces": config["traces"], "turns": config["turns"], **totals} | {
        "forwarded_per_unique": totals["forwarded_tokens"] / totals["unique_tokens"],
        "build_seconds": seconds,
        "ms_per_million_input": 1e3 * seconds / (totals["input_tokens"] / 1e6),
        "ms_per_million_unique": 1e3 * seconds / (totals["unique_tokens"] / 1e6),
    }


# ------------------------------------------------------------------------------------------------ report


def verdicts(packing: dict[str, Any], rows: dict[str, Any]) -> list[dict[str, Any]]:
    speedup = packing["variants"]["packed"]["vs_padded"]["median"]
    ratio = rows["forwarded_per_unique"]
    checks = [
        (speedup >= MIN_SPEEDUP, f"{speedup:.2f}x (median of same-repeat ratios)"),
        (ratio <= MAX_FORWARD_RATIO, f"{ratio:.3f} over {rows['traces']} {rows['turns']}-turn traces"),
    ]
    return [
        {"target": name, "pass": bool(ok), "measured": detail}
        for name, (ok, detail) in zip(TARGET_NAMES, checks, strict=True)
    ]


def print_report(result: dict[str, Any]) -> None:
    c, packing, rows = result["config"], result["packing"], result["rows"]
    w = packing["workload"]
    print(
        f"\n(a) {w['rows']} rows, {w['tokens']} tokens ({w['trained_tokens']} trained), length median "
        f"{w['length_median']:.0f} max {w['length_max']}; token budget {c['token_budget']}; "
        f"{c['repeats']} repeats, {c['threads']} torch threads; trained tokens/s median [min-max]"
    )
    header = f"{'variant':<24}{'batches':>8}{'tensor tokens':>15}{'trained tok/s':>24}{'vs padded':>11}"
    print(header)
    for name, v in packing["variants"].items():
        tps = v["tps"]
        spread = f"{tps['median']:.0f} [{tps['min']:.0f}-{tps['max']:.0f}]"
        print(
            f"{name:<24}{v['batches']:>8}{v['tensor_tokens']:>15}{spread:>24}{v['vs_padded']['median']:>10.2f}x"
        )
    print(
        f"\n(b) rows of {rows['traces']} append-only {rows['turns']}-turn traces: {rows['rows']} rows, "
        f"{rows['input_tokens']} trace input tokens, {rows['unique_tokens']} unique, "
        f"{rows['forwarded_tokens']} forwarded ({rows['forwarded_per_unique']:.3f}x unique)"
    )
    print(
        f"build_rows: {rows['build_seconds'] * 1e3:.1f} ms in all, {rows['ms_per_million_input']:.1f} ms per "
        f"million trace input tokens, {rows['ms_per_million_unique']:.1f} ms per million unique tokens"
    )
    print_verdicts(result, 44)


# -------------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny configuration: " + str(QUICK))
    parser.add_argument("--model", default=None, help="model directory (default: the tiny model)")
    parser.add_argument("--rows", type=positive, default=None, help=f"rows per pass ({FULL['rows']})")
    parser.add_argument("--rollouts", type=positive, default=None, help=f"rollouts ({FULL['rollouts']})")
    parser.add_argument(
        "--token-budget", type=positive, default=None, help=f"tokens per micro-batch ({FULL['token_budget']})"
    )
    parser.add_argument("--repeats", type=positive, default=None, help=f"timed passes ({FULL['repeats']})")
    parser.add_argument("--traces", type=positive, default=None, help=f"traces for rows ({FULL['traces']})")
    parser.add_argument("--turns", type=positive, default=None, help=f"turns per trace ({FULL['turns']})")
    parser.add_argument("--threads", type=positive, default=1, help="torch threads (default 1, see above)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the rows, advantages and traces")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    return parser


def resolve(args: argparse.Namespace) -> dict[str, Any]:
    """The configuration: ``--quick`` or the full defaults, with every flag given on top."""
    config = dict(QUICK if args.quick else FULL)
    config |= {key: value for key in config if (value := getattr(args, key)) is not None}
    return config | {"quick": args.quick, "seed": args.seed}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print the tables and verdicts; 0, or 1 on a missed target under ``--strict``."""
    args = build_parser().parse_args(argv)
    config = resolve(args)
    import torch

    from harness_trainer.models.tiny import ensure_tiny_model

    torch.set_num_threads(args.threads)
    config["threads"] = args.threads
    model_dir = args.model or str(ensure_tiny_model())
    config["model"] = model_dir
    started = time.perf_counter()
    result: dict[str, Any] = {"config": config, "packing": run_packing(config, model_dir)}
    result["rows"] = run_rows(config)
    result["elapsed_s"] = time.perf_counter() - started
    result["verdicts"] = verdicts(result["packing"], result["rows"])
    result["all_pass"] = all(verdict["pass"] for verdict in result["verdicts"])
    print_report(result)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if args.strict and not result["all_pass"] else 0


if __name__ == "__main__":
    sys.exit(main())
