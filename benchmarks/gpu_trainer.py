"""Trainer-side GPU check: training-step throughput and MFU of a Qwen3-1.7B-shaped model, packed against
padded, with and without gradient checkpointing and under FSDP2, and the time to gather the engine's weights.

For a GPU host with PyTorch and transformers (no vLLM, no network): the model is random-initialised from a
``Qwen3Config`` built here (Qwen3-1.7B's shape: 28 layers, hidden 2048, MLP 6144, 16 query and 8 key/value
heads of 128, vocabulary 151,936, tied embeddings; 1.72B parameters, 1.41B outside the embedding), directly
on ``--device`` in ``--dtype`` (default ``cuda``, ``bfloat16``); nothing is downloaded.

**Workload.** ``--rows`` synthetic agent rows from ``benchmarks/trainer.py`` (``agent_rows``: lognormal
lengths, median 256, 64-2048 tokens, alternating sampled completions and tool outputs) in ``--rollouts``
rollouts, with random advantages and weights ``1 / (N_r · R)``; every ``--members`` consecutive rows are a
GRPO group (:func:`grouped`): they share the first row's prompt (its first third, untrained), as a group's
members share their system prompt and task. One *step* is what the trainer's
``OptimizerStep`` (``harness_trainer/trainer/optimize.py``) does on one rank: plan the rows into
micro-batches of at most ``--token-budget`` tokens (``plan_micro_batches``), then per micro-batch
collate, copy to the device, per-token logprobs at the targets (``token_logprobs``), the loss
(``policy_loss``: truncated IS, with entropies) and backward; then clip the gradient norm (1.0), an
AdamW step and ``zero_grad``. Each variant builds its model afresh (same
seed, same weights), runs one untimed warm-up step and ``--steps`` timed steps (the device synchronised
before the clock stops), and is freed before the next; an out-of-memory in one variant is reported as such
and the others still run. Variants:

- **packed**: ``collate`` into one padding-free sequence per micro-batch, the model switched to packed
  attention (``use_packed_attention``: causal sdpa row by row);
- **padded**: the same micro-batches right-padded to their longest row (``collate_padded``) with the
  padding mask; the same model, whose packed attention hands masked batches to transformers' sdpa;
- each of those with gradient checkpointing (``gradient_checkpointing_enable``, non-reentrant, as
  ``load_policy`` does);
- **packed, by prefix**: packed micro-batches planned and forwarded as their rows' prefix trees, each
  group's shared prompt once (``plan_shared_micro_batches``, ``micro_batch_logprobs``: the trainer's
  ``shared_prefix``, its default); its model FLOPs are its trees' (:func:`prefix_flops`), not the rows';
- **packed, FSDP2**: packed, no checkpointing, the model sharded with torch's ``fully_shard`` (each decoder
  layer, then the root) on a one-process group initialised in this process (nccl on CUDA, gloo on CPU;
  an in-process ``HashStore``, no ports); gradient sync only at the step's last backward, as the trainer's
  ``no_sync`` does.

Reported per variant: trained (target) tokens/s (median [min-max] over the timed steps), all row tokens/s,
its ratio to **padded**, peak device memory (CUDA only) and the model FLOPs utilisation: the step's model
FLOPs (:func:`benchmarks.model_flops.train_flops`: 6 × non-embedding parameters × row tokens, + 6 × layers
× heads·head_dim × Σ row length² for causal attention, + 6 × hidden × vocabulary × projected positions for
the output head, which sees only the targets) over the median step time and ``--peak-tflops`` (default
989: H100/H200 SXM dense bf16). Every row token counts, not just the trained ones: training a target needs
its whole context forwarded and backpropagated. Padding and checkpointing's recomputation are not model
FLOPs, so they show as a lower MFU.

**Gathers.** The weights the engine would receive, timed (one warm-up, then ``--steps`` times, median) after
a variant's steps: **engine_weights**, ``engine_weights(model)`` of the packed model (the path without FSDP:
views of the weights, left on the device) and **FSDP2 full state dict**, the sharded model's full state dict
on rank 0 as accelerate's ``get_state_dict`` gathers it for ``engine_state`` (``get_model_state_dict``,
full, offloaded to CPU). Reported: seconds, GB (every name counted, so tied embeddings count twice) and
whether the names are ``engine_weights``' names.

Targets: packed ≥ 1.5× padded trained tokens/s (the project's target, as in ``benchmarks/trainer.py``),
and the MFU of the packed step by prefix ≥ 18 % (issue 41, fixed before any GPU run: twice the 6.4-9.0 %
TRL's AsyncGRPO reaches at 1.7B on one GPU); on a CPU the second is a MISS by construction. The rest is
reported. A MISS does not fail the run (exit 0) unless ``--strict``; a variant failing otherwise
than by running out of memory prints its traceback and makes the exit status 1 once the others have run.

Run on a GPU host: ``python -m benchmarks.gpu_trainer [--rows 192] [--token-budget 8192] [--steps 3]
[--peak-tflops 989] [--json OUT] [--strict]``. ``--quick`` is a tiny shape (2 layers, hidden 64) and a few
rows; the test runs it on CPU: ``--quick --device cpu --dtype float32``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harness_trainer.trainer.step.rows import Row

if not __package__:  # run as a script: its siblings import from the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import positive, print_table, print_verdicts
from benchmarks.gpu_step import (
    QWEN3_1_7B,
    TINY,
    Setup,
    build_model,
    full_state_dict,
    shard,
    spread,
    step_inputs,
    timed,
    train_step,
)
from benchmarks.model_flops import Shape, mfu, shape_of, train_flops, tree_train_flops
from benchmarks.trainer import MIN_SPEEDUP, agent_rows

TARGET_NAME = "packed >= 1.5x padded trained tokens/s"
MIN_PREFIX_MFU = 0.18
PREFIX = "packed, by prefix"
PREFIX_TARGET = f"{PREFIX} MFU >= {MIN_PREFIX_MFU:.0%}"
BASELINE = "padded"
PEAK_TFLOPS = 989.0  # H100/H200 SXM, dense bf16

FULL = {"rows": 192, "rollouts": 32, "members": 8, "token_budget": 8192, "steps": 3}
QUICK = {"rows": 4, "rollouts": 2, "members": 2, "token_budget": 1024, "steps": 2}

SETUPS = (
    Setup("packed", packed=True, gather="engine_weights"),
    Setup(PREFIX, packed=True, by_prefix=True),
    Setup("packed, checkpointing", packed=True, checkpointing=True),
    Setup(BASELINE, packed=False),
    Setup("padded, checkpointing", packed=False, checkpointing=True),
    Setup("packed, FSDP2", packed=True, fsdp=True, gather="FSDP2 full state dict"),
)
VARIANTS = tuple(setup.name for setup in SETUPS)
GATHERS = tuple(setup.gather for setup in SETUPS if setup.gather is not None)


class NotRun(Exception):
    """A variant this host cannot run (not a failure of the code measured)."""


# --------------------------------------------------------------------------------------------- variants


def measure(
    setup: Setup, config: dict[str, Any], rows: Sequence[Row], inputs: dict[str, Any], flops: float
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Build ``setup``'s model, train a warm-up step and the timed steps, then time its gather: the
    variant's measurements and the gather's (None without one).

    Raises:
        NotRun: FSDP2 without ``torch.distributed`` in this build.
    """
    import torch

    from harness_trainer.trainer.policy import engine_weights
    from harness_trainer.trainer.step.logprobs import use_packed_attention

    device = config["device"]
    if setup.fsdp and not torch.distributed.is_available():
        raise NotRun("torch.distributed is not available in this torch build")
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    model = build_model(config)
    use_packed_attention(model)
    if setup.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine_names = set(engine_weights(model))
    try:
        if setup.fsdp:
            shard(model, device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
        steps = [
            train_step(model, optimizer, setup, rows, inputs, config) for _ in range(config["steps"] + 1)
        ]
        samples = steps[1:]  # the first is the warm-up
        seconds = [s["seconds"] for s in samples]
        median = statistics.median(seconds)
        first = samples[0]
        cuda = device.startswith("cuda")
        variant = {
            "status": "ok",
            "batches": first["batches"],
            "trained_tokens": first["trained_tokens"],
            "tensor_tokens": first["tensor_tokens"],
            "seconds": spread(seconds),
            "tps": spread([first["trained_tokens"] / s for s in seconds]),
            "row_tps": first["row_tokens"] / median,
            "mfu": mfu(flops, median, config["peak_tflops"]),
            "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9 if cuda else None,
            "steps": samples,
        }
        gather = None
        if setup.gather is not None:
            gather_of = (lambda: full_state_dict(model)) if setup.fsdp else (lambda: engine_weights(model))
            gather_seconds, weights = timed(gather_of, device, config["steps"])
            gather = {
                "status": "ok",
                "seconds": spread(gather_seconds),
                "tensors": len(weights),
                "gb": sum(t.numel() * t.element_size() for t in weights.values()) / 1e9,
                "lands_on": str(next(iter(weights.values())).device),
                "engine_names": set(weights) == engine_names,
            }
        return variant, gather
    finally:
        if setup.fsdp and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_variants(
    config: dict[str, Any], rows: Sequence[Row], flops: float, prefix_flops: float | None = None
) -> tuple[dict, dict, bool]:
    """Every :data:`SETUPS` variant, each freed before the next: variants and gathers by name, and whether
    one failed (otherwise than by running out of memory or not being runnable here). ``flops``: a step's
    model FLOPs; ``prefix_flops``: the step's by prefix (default ``flops``)."""
    import torch

    inputs = step_inputs(rows, config["seed"])
    variants: dict[str, Any] = {}
    gathers: dict[str, Any] = {}
    failed = False
    for setup in SETUPS:
        print(f"{setup.name}: {config['steps']} timed steps after a warm-up", flush=True)
        try:
            own = flops if prefix_flops is None or not setup.by_prefix else prefix_flops
            variant, gather = measure(setup, config, rows, inputs, own)
        except torch.cuda.OutOfMemoryError:
            variant, gather = {"status": "out of memory"}, None
        except NotRun as exc:
            variant, gather = {"status": f"not run: {exc}"}, None
        except Exception as exc:  # one broken variant must not cost the others their run
            traceback.print_exc()
            variant, gather, failed = {"status": f"failed: {type(exc).__name__}: {exc}"}, None, True
        # Out of the except clause, the traceback's frames (and the model they hold) are gone: free it all.
        gc.collect()
        if config["device"].startswith("cuda"):
            torch.cuda.empty_cache()
        variants[setup.name] = variant
        if setup.gather is not None:
            gathers[setup.gather] = gather or {"status": f"not measured: {setup.name} {variant['status']}"}
    baseline = variants[BASELINE]
    for variant in variants.values():
        if variant["status"] == "ok" and baseline["status"] == "ok":
            variant["vs_padded"] = variant["tps"]["median"] / baseline["tps"]["median"]
    return variants, gathers, failed


# ------------------------------------------------------------------------------------------------ report


def verdicts(variants: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets' verdicts: failed (not measured) when a variant they need did not run."""
    packed, padded = variants["packed"], variants[BASELINE]
    if packed["status"] != "ok" or padded["status"] != "ok":
        detail = f"not measured: packed {packed['status']}, padded {padded['status']}"
        out = [{"target": TARGET_NAME, "pass": False, "measured": detail}]
    else:
        speedup = packed["vs_padded"]
        detail = f"{speedup:.2f}x (ratio of median steps, no checkpointing)"
        out = [{"target": TARGET_NAME, "pass": speedup >= MIN_SPEEDUP, "measured": detail}]
    by_prefix = variants.get(PREFIX, {"status": "not run"})
    if by_prefix["status"] != "ok":
        detail = f"not measured: {by_prefix['status']}"
        out.append({"target": PREFIX_TARGET, "pass": False, "measured": detail})
    else:
        mfu_of = by_prefix["mfu"]
        detail = f"{percent(mfu_of)} (its trees' model FLOPs over its median step)"
        out.append({"target": PREFIX_TARGET, "pass": mfu_of >= MIN_PREFIX_MFU, "measured": detail})
    return out


def grouped(rows: Sequence[Row], members: int) -> list[Row]:
    """``rows`` as GRPO groups of ``members`` consecutive rows: each member keeps its own rest after its
    first third and takes its group's first row's first third as its prompt (untrained)."""
    from harness_trainer.trainer.step.rows import Row

    out = []
    for start in range(0, len(rows), members):
        group = rows[start : start + members]
        prompt = group[0].input_ids[: len(group[0].input_ids) // 3]
        for row in group:
            cut = len(row.input_ids) // 3
            out.append(Row(
                row.rollout, prompt + row.input_ids[cut:], [0] * len(prompt) + row.targets[cut:],
                [0.0] * len(prompt) + row.behaviour_logps[cut:],
            ))  # fmt: skip
    return out


def prefix_flops(shape: Shape, rows: Sequence[Row], token_budget: int) -> tuple[float, int]:
    """The model FLOPs of a step by prefix (its plan's trees: :func:`tree_train_flops`) and the ids it
    forwards."""
    from harness_trainer.trainer.step.prefix_tree import node_targets, plan_shared_micro_batches, prefix_tree

    nodes: list[tuple[int, int]] = []
    projected = 0
    for batch in plan_shared_micro_batches(rows, token_budget):
        targets = [[t for t, is_target in enumerate(row.targets) if is_target] for row in batch]
        for node in prefix_tree([row.input_ids for row in batch]).walk():
            if node.span:
                nodes.append((node.start, node.span))
            # A position is projected once however many rows train the token after it.
            projected += len({t - 1 for found in node_targets(node, targets).values() for t in found})
    return tree_train_flops(shape, nodes, projected), sum(span for _, span in nodes)


def percent(fraction: float) -> str:
    """``fraction`` as a percentage, three significant digits (MFU on CPU is tiny)."""
    return f"{100 * fraction:.3g}%"


def print_report(result: dict[str, Any]) -> None:
    """The workload, a table of variants, a table of gathers, the verdict."""
    c, m, w = result["config"], result["model"], result["workload"]
    print(
        f"\nmodel {m['name']}: {m['parameters'] / 1e6:.1f}M parameters ({m['body'] / 1e6:.1f}M "
        f"non-embedding), {c['dtype']} on {c['device']}\n{w['rows']} rows, {w['tokens']} tokens "
        f"({w['trained_tokens']} trained), length median {w['length_median']:.0f} max {w['length_max']}; "
        f"token budget {c['token_budget']}; {w['tflops_per_step']:.4g} model TFLOPs per step "
        f"({w.get('prefix_tflops_per_step', 0):.4g} by prefix, forwarding {w.get('prefix_forwarded', '-')} "
        f"ids)\n"
        f"MFU against a peak of {c['peak_tflops']:g} TFLOP/s (--peak-tflops); trained tokens/s median "
        f"[min-max] over {c['steps']} timed steps after a warm-up"
    )
    table = [
        ("variant", "batches", "tensor tokens", "trained tok/s", "row tok/s", "MFU", "vs padded", "peak GB")
    ]
    for name, v in result["variants"].items():
        if v["status"] != "ok":
            table.append((name, v["status"], *["-"] * 6))
            continue
        tps = v["tps"]
        peak = "-" if v["peak_memory_gb"] is None else f"{v['peak_memory_gb']:.1f}"
        ratio = f"{v['vs_padded']:.2f}x" if "vs_padded" in v else "-"
        table.append((
            name, str(v["batches"]), str(v["tensor_tokens"]),
            f"{tps['median']:.0f} [{tps['min']:.0f}-{tps['max']:.0f}]", f"{v['row_tps']:.0f}",
            percent(v["mfu"]), ratio, peak,
        ))  # fmt: skip
    print_table(table)
    print()
    table = [("gather", "tensors", "GB", "lands on", "seconds (median)", "engine's names")]
    for name, g in result["gathers"].items():
        if g["status"] != "ok":
            table.append((name, g["status"], *["-"] * 4))
            continue
        table.append((
            name, str(g["tensors"]), f"{g['gb']:.3f}", g["lands_on"], f"{g['seconds']['median']:.4f}",
            "yes" if g["engine_names"] else "NO",
        ))  # fmt: skip
    print_table(table)
    print_verdicts(result, max(len(TARGET_NAME), len(PREFIX_TARGET)))


# -------------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shape and rows: " + str(QUICK))
    parser.add_argument("--rows", type=positive, default=None, help=f"rows per step ({FULL['rows']})")
    parser.add_argument("--rollouts", type=positive, default=None, help=f"rollouts ({FULL['rollouts']})")
    parser.add_argument("--members", type=positive, default=None, help=f"rows per group ({FULL['members']})")
    parser.add_argument(
        "--token-budget", type=positive, default=None, help=f"tokens per micro-batch ({FULL['token_budget']})"
    )
    parser.add_argument("--steps", type=positive, default=None, help=f"timed steps ({FULL['steps']})")
    parser.add_argument("--device", default="cuda", help="torch device (default cuda)")
    parser.add_argument(
        "--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"), help="default bfloat16"
    )
    parser.add_argument(
        "--peak-tflops", type=float, default=PEAK_TFLOPS, help="the device's peak TFLOP/s for MFU (989)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, rows and advantages")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    parser.add_argument("--strict", action="store_true", help="exit 1 when the target is missed")
    return parser


def resolve(args: argparse.Namespace) -> dict[str, Any]:
    """The configuration: ``--quick`` or the full defaults, with every flag given on top."""
    config = dict(QUICK if args.quick else FULL)
    config |= {key: value for key in config if (value := getattr(args, key)) is not None}
    return config | {
        "quick": args.quick,
        "seed": args.seed,
        "device": args.device,
        "dtype": args.dtype,
        "peak_tflops": args.peak_tflops,
        "shape": TINY if args.quick else QWEN3_1_7B,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print the tables and verdict; 0, or 1 on a failed variant or, under ``--strict``,
    a missed target."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.peak_tflops > 0:
        parser.error("--peak-tflops must be positive")
    config = resolve(args)
    import torch

    if config["device"].startswith("cuda") and not torch.cuda.is_available():
        parser.error("CUDA is not available here: pass --device cpu (with --dtype float32) to run on CPU")
    started = time.perf_counter()
    rows = grouped(agent_rows(config["rows"], config["rollouts"], config["seed"]), config["members"])
    lengths = [len(row.input_ids) for row in rows]
    trained = sum(row.n_targets for row in rows)
    shape = shape_of(build_model(config, "meta"))  # its shape only: no memory, no initialisation
    # targets_only: the head projects exactly the trained tokens (a row's first token is never one).
    flops = train_flops(shape, lengths, trained)
    by_prefix, forwarded = prefix_flops(shape, rows, config["token_budget"])
    result: dict[str, Any] = {
        "config": config,
        "model": {"name": "tiny qwen3" if args.quick else "qwen3-1.7b-shaped"} | dataclasses.asdict(shape),
        "workload": {
            "rows": len(rows),
            "tokens": sum(lengths),
            "trained_tokens": trained,
            "length_median": statistics.median(lengths),
            "length_max": max(lengths),
            "tflops_per_step": flops / 1e12,
            "prefix_forwarded": forwarded,
            "prefix_tflops_per_step": by_prefix / 1e12,
        },
    }
    variants, gathers, failed = run_variants(config, rows, flops, by_prefix)
    result |= {"variants": variants, "gathers": gathers, "elapsed_s": time.perf_counter() - started}
    result["verdicts"] = verdicts(variants)
    result["all_pass"] = all(verdict["pass"] for verdict in result["verdicts"])
    print_report(result)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if failed:
        return 1
    return 1 if args.strict and not result["all_pass"] else 0


if __name__ == "__main__":
    sys.exit(main())
