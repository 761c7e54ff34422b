"""A GRPO step with each group's shared prefix forwarded once, on groups the dev loop captured (issue 41).

**Capture.** ``harness-trainer dev`` (its defaults: mini-swe-agent black-box on the bundled tasks, the dev
engine serving the warm tiny model, which its first run builds) for one step of ``--groups-per-step``
groups at ``--num-generations`` G, for G in ``--members`` (4 and 8), every trace kept
(``--rollout-log-steps 1``). Each run's ``rollouts.jsonl`` gives the groups: each rollout's trace made into
training rows by ``build_rows``, as the trainer does. ``--runs DIR ...`` reads runs captured before instead
(one per G, in ``--members`` order). ``--quick`` (the test's) makes groups shaped like them instead
(:func:`synthetic_groups`): it checks the mechanics, and its numbers mean nothing.

**Measured**, per G, on the same rows:
- forwarded ids: the step's own plan by prefix (``plan_shared_micro_batches`` at ``--token-budget``, each
  micro-batch's prefix tree) against the unique ids of the exact prefix tree of all the groups' rows
  together (groups of one task share their prompt, so the groups' own trees summed would count it once per
  group: less than a step by prefix can forward, which is no bound). **Target** ≤ 1.05×.
- trained (target) tokens per second of a training pass (every row once: plan, collate, forward, the
  loss with entropies, backward; no optimizer step), three ways: **by prefix** (``micro_batch_logprobs``),
  **packed** (``plan_micro_batches`` + ``packed_sdpa``) and the baseline, **padded, length-sorted** (rows
  by length, grouped greedily while rows × longest row fits the budget: padding's best case). Each repeat
  runs every way once in rotating order after one untimed warm-up pass each; the verdict takes the median
  over repeats of the same-repeat ratio to the baseline. **Target**: by prefix ≥ 1.5×.

Both targets are judged for each G. One torch thread (as ``benchmarks/trainer.py``). Output: a table per G,
then PASS/MISS per target; a MISS does not fail the run (exit 0) unless ``--strict``. Run:
``python -m benchmarks.prefix_step [--quick] [--members 4 8] [--runs DIR ...] [--keep DIR]
[--groups-per-step 2] [--token-budget 8192] [--repeats 3] [--json OUT] [--strict]``; ``--keep`` keeps the
captured runs there (for ``--runs``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harness_trainer.trainer.step.rows import Row

if not __package__:  # run as a script: its siblings import from the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import finish, positive, print_table, print_verdicts, run_dev_loop
from benchmarks.trainer import length_sorted_batches

MAX_FORWARD_RATIO = 1.05
MIN_SPEEDUP = 1.5
BASELINE = "padded, length-sorted"
WAYS = ("by prefix", "packed", BASELINE)
FULL = {"members": [4, 8], "groups_per_step": 2, "token_budget": 8192, "repeats": 3}
QUICK = {"members": [2], "groups_per_step": 2, "token_budget": 2048, "repeats": 1}


def capture(members: int, groups: int, out: Path) -> Path:
    """One dev-loop step of ``groups`` groups of ``members``, traces kept: its run folder."""
    flags = ["--max-steps", "1", "--num-generations", str(members), "--groups-per-step", str(groups)]
    flags += ["--rollout-log-steps", "1", "--no-eval-on-start", "--save-steps", "0"]
    run = out / f"dev-g{members}"
    seconds = run_dev_loop(run, flags, out / f"dev-g{members}.log", f"capture G={members}")
    print(f"captured G={members}: {groups} groups in {seconds:.0f} s", flush=True)
    return run


def read_groups(run: Path, members: int) -> list[list[Row]]:
    """The whole groups of a run's ``rollouts.jsonl`` (``members`` rollouts with a trace: the run's stop
    cuts the last ones short), each rollout's rows (``build_rows``), by group."""
    from harness_trainer.trace import TrainingTrace
    from harness_trainer.trainer.feed.rollout_log import read_rollout_log
    from harness_trainer.trainer.step.rows import build_rows

    by_group: dict[int, list[Row]] = defaultdict(list)
    traced: dict[int, int] = defaultdict(int)
    records = [r for r in read_rollout_log(run, validate_traces=False) if r.trace is not None]
    for index, record in enumerate(records):
        trace = TrainingTrace.model_validate(record.trace)
        by_group[record.group] += build_rows(trace, index)
        traced[record.group] += 1
    whole = [by_group[group] for group in sorted(by_group) if traced[group] == members]
    if not whole:
        raise ValueError(f"{run}: no group of {members} rollouts with traces")
    return whole


def synthetic_groups(members: int, groups: int, seed: int) -> list[list[Row]]:
    """Groups shaped like the dev loop's (a 1,450-id prompt, then 50-300 ids of each member's own turns,
    sampled ids trained): for the quick test only."""
    from harness_trainer.trainer.step.rows import Row

    rng = random.Random(seed)
    out = []
    for group in range(groups):
        prompt = [rng.randrange(1, 4000) for _ in range(1450)]
        rows = []
        for member in range(members):
            rest = [rng.randrange(1, 4000) for _ in range(rng.randint(50, 300))]
            targets = [0] * len(prompt) + [1] * len(rest)
            rows.append(Row(group * members + member, prompt + rest, targets, [-1.0 * t for t in targets]))
        out.append(rows)
    return out


def forward_counts(groups: Sequence[Sequence[Row]], token_budget: int) -> dict[str, int]:
    """Ids forwarded by prefix (the step's plan), by packing, and the groups' exact trees' unique ids."""
    from harness_trainer.trainer.step.prefix_tree import (
        forwarded_tokens,
        plan_shared_micro_batches,
        prefix_tree,
        unique_tokens,
    )

    rows = [row for group in groups for row in group]
    plan = plan_shared_micro_batches(rows, token_budget)
    return {
        "by_prefix": sum(forwarded_tokens(prefix_tree([r.input_ids for r in batch])) for batch in plan),
        "unique": unique_tokens([r.input_ids for r in rows]),
        "unique_per_group": sum(unique_tokens([r.input_ids for r in group]) for group in groups),
        "packed": sum(len(r.input_ids) for r in rows),
        "micro_batches": len(plan),
    }


def train_pass(way: str, model: Any, rows: Sequence[Row], step: dict[str, Any]) -> dict[str, float]:
    """Forward and backward over every row once, ``way``: trained tokens and seconds."""
    from harness_trainer.trainer.step.logprobs import token_logprobs, token_logprobs_padded
    from harness_trainer.trainer.step.loss import policy_loss
    from harness_trainer.trainer.step.packing import collate, collate_padded, plan_micro_batches
    from harness_trainer.trainer.step.prefix_tree import plan_shared_micro_batches
    from harness_trainer.trainer.step.shared_prefix import micro_batch_logprobs

    planners: dict[str, Callable[[Sequence[Row], int], list[list[Row]]]] = {
        "by prefix": plan_shared_micro_batches, "packed": plan_micro_batches, BASELINE: length_sorted_batches,
    }  # fmt: skip
    trained = 0
    start = time.perf_counter()
    for micro in planners[way](rows, step["token_budget"]):
        if way == BASELINE:
            padded = collate_padded(micro, step["advantages"], step["weights"])
            logps, entropy = token_logprobs_padded(model, padded, 1.0, targets_only=True)
            loss, _ = policy_loss(logps, padded, step["loss"], entropy=entropy)
            trained += padded.n_targets
        else:
            batch = collate(micro, step["advantages"], step["weights"])
            if way == "by prefix":
                logps, entropy, _ = micro_batch_logprobs(model, batch, micro, 1.0)
            else:
                logps, entropy = token_logprobs(model, batch, 1.0, targets_only=True)
            loss, _ = policy_loss(logps, batch, step["loss"], entropy=entropy)
            trained += batch.n_targets
        loss.backward()
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return {"trained_tokens": trained, "seconds": seconds, "tps": trained / seconds}


def measure(groups: list[list[Row]], config: dict[str, Any], model_dir: str) -> dict[str, Any]:
    """Both measurements (module docstring) on one G's groups."""
    import torch
    from transformers import AutoModelForCausalLM

    from harness_trainer.trainer.step.logprobs import use_packed_attention
    from harness_trainer.trainer.step.loss import LossConfig

    sdpa = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    packed = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    use_packed_attention(packed)
    models = {"by prefix": packed, "packed": packed, BASELINE: sdpa.train()}
    rows = [row for group in groups for row in group]
    rng = random.Random(0)
    tokens: dict[int, int] = defaultdict(int)
    for row in rows:
        tokens[row.rollout] += row.n_targets
    step = {
        "token_budget": config["token_budget"], "loss": LossConfig(),
        "advantages": {r: rng.gauss(0.0, 1.0) for r in tokens},
        "weights": {r: 1.0 / (n * len(tokens)) for r, n in tokens.items()},
    }  # fmt: skip
    for way in WAYS:  # warm-up, not timed
        train_pass(way, models[way], rows[: max(2, len(rows) // 4)], step)
    samples: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    for repeat in range(config["repeats"]):
        order = WAYS[repeat % len(WAYS) :] + WAYS[: repeat % len(WAYS)]
        this = {way: train_pass(way, models[way], rows, step) for way in order}
        for way, sample in this.items():
            samples[way].append(sample | {"vs_baseline": sample["tps"] / this[BASELINE]["tps"]})
        print(
            f"repeat {repeat + 1}: " + ", ".join(f"{w} {this[w]['tps']:.0f} tok/s" for w in WAYS), flush=True
        )
    lengths = [len(r.input_ids) for r in rows]
    return {
        "groups": len(groups),
        "rows": len(rows),
        "members": [len({r.rollout for r in group}) for group in groups],
        "length_median": statistics.median(lengths),
        "trained_tokens": sum(r.n_targets for r in rows),
        "forward": forward_counts(groups, config["token_budget"]),
        "ways": {way: _spread(samples[way]) for way in WAYS},
    }


def _spread(samples: list[dict[str, float]]) -> dict[str, Any]:
    def stats(key: str) -> dict[str, float]:
        values = [s[key] for s in samples]
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    return {"tps": stats("tps"), "vs_baseline": stats("vs_baseline"), "repeats": samples}


def verdicts(by_members: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each G's two targets (module docstring)."""
    out = []
    for members, measured in by_members.items():
        forward = measured["forward"]
        ratio = forward["by_prefix"] / forward["unique"]
        speedup = measured["ways"]["by prefix"]["vs_baseline"]["median"]
        out.append({
            "target": f"G={members}: forwarded <= {MAX_FORWARD_RATIO}x the groups' unique tokens",
            "pass": ratio <= MAX_FORWARD_RATIO,
            "measured": f"{ratio:.3f}x ({forward['by_prefix']} of {forward['unique']} ids; packed: "
                        f"{forward['packed']})",
        })  # fmt: skip
        out.append({
            "target": f"G={members}: by prefix >= {MIN_SPEEDUP}x padded, length-sorted trained tokens/s",
            "pass": speedup >= MIN_SPEEDUP,
            "measured": f"{speedup:.2f}x (median of {len(measured['ways'][BASELINE]['repeats'])})",
        })  # fmt: skip
    return out


def run(config: dict[str, Any]) -> dict[str, Any]:
    import torch

    from harness_trainer.models.tiny import ensure_tiny_model

    torch.set_num_threads(config["threads"])
    started = time.perf_counter()
    # The tiny model trains on the captured ids: the warm model the dev loop sampled from has its shapes,
    # and a step's cost does not depend on the weights.
    model_dir = str(ensure_tiny_model())
    by_members: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="ht-prefix-step-") as scratch:
        captures = Path(config["keep"]) if config["keep"] else Path(scratch)
        captures.mkdir(parents=True, exist_ok=True)
        for index, members in enumerate(config["members"]):
            if config["quick"]:
                groups, source = synthetic_groups(members, config["groups_per_step"], index), "synthetic"
            else:
                run_dir = Path(config["runs"][index]) if config["runs"] else None
                run_dir = run_dir or capture(members, config["groups_per_step"], captures)
                groups, source = read_groups(run_dir, members), str(run_dir)
            by_members[str(members)] = measure(groups, config, model_dir) | {"source": source}
    result = {"config": config, "members": by_members, "verdicts": verdicts(by_members)}
    result["all_pass"] = all(v["pass"] for v in result["verdicts"])
    result["elapsed_s"] = time.perf_counter() - started
    return result


def print_report(result: dict[str, Any]) -> None:
    for members, measured in result["members"].items():
        forward = measured["forward"]
        print(f"\nG={members}: {measured['groups']} groups, {measured['rows']} rows ({measured['source']}), "
              f"median length {measured['length_median']:.0f}, {measured['trained_tokens']} trained tokens; "
              f"forwarded: by prefix {forward['by_prefix']}, packed {forward['packed']}, "
              f"unique {forward['unique']}")  # fmt: skip
        rows = [("way", "trained tok/s (median)", "range", "vs baseline (median)")]
        for way in WAYS:
            tps, vs = measured["ways"][way]["tps"], measured["ways"][way]["vs_baseline"]
            rows.append(
                (way, f"{tps['median']:.0f}", f"{tps['min']:.0f}-{tps['max']:.0f}", f"{vs['median']:.2f}x")
            )
        print_table(rows)
    print_verdicts(result, max(len(v["target"]) for v in result["verdicts"]) + 1)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="synthetic groups, one small G (the test's)")
    parser.add_argument("--members", type=positive, nargs="+", help="group sizes G (default 4 8)")
    parser.add_argument("--runs", type=Path, nargs="+", help="dev-loop runs captured before, one per G")
    parser.add_argument("--keep", type=Path, help="keep the captured runs in this folder")
    parser.add_argument("--groups-per-step", type=positive)
    parser.add_argument("--token-budget", type=positive)
    parser.add_argument("--repeats", type=positive)
    parser.add_argument("--threads", type=positive, default=1)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--strict", action="store_true", help="exit 1 on a missed target")
    args = parser.parse_args(argv)
    config = dict(QUICK if args.quick else FULL)
    for key in ("members", "groups_per_step", "token_budget", "repeats"):
        if getattr(args, key) is not None:
            config[key] = getattr(args, key)
    if args.runs and len(args.runs) != len(config["members"]):
        parser.error(f"--runs needs one run per G ({len(config['members'])}), got {len(args.runs)}")
    config |= {"quick": args.quick, "runs": [str(r) for r in args.runs or []], "threads": args.threads}
    config["keep"] = str(args.keep) if args.keep else None
    return finish(run(config), args, print_report, leftovers_key=None)


if __name__ == "__main__":
    sys.exit(main())
