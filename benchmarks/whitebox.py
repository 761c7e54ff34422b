"""White-box against black-box on the dev loop: rollouts per minute, trained tokens per rollout, and the time
per turn spent outside the engine.

Set-up: ``harness-trainer dev`` run twice as real subprocesses, one after the other, with the same seed,
model, engine (the dev engine), tasks (the bundled ones) and trainer settings: **black-box** (the agent,
mini-swe-agent by default, owns its loop behind the capture proxy) and **white-box** (``--mode white-box``:
the trainer samples each turn by token ids and the built-in ReAct adapter runs the session's tools, no agent
process). Each run uses its mode's own warm model (built by the run the first time, which its wall time
then includes; the measures below are read from its training steps only) and evaluates only after its last
step, so no evaluation falls inside the measured steps.

Measured per run, from its ``metrics.jsonl`` and ``rollouts.jsonl`` (pure functions below):

- **rollouts per minute**: the rollouts the steps after the first consumed (``rollout/count``) over the time
  from the first step's end to the last step's (each line's ``time``): training, weight pushes and waiting
  on rollouts included, the first step's start-up left out;
- **trained tokens per rollout**: the sampled ids of the trace of each rollout a step took (its turns'
  completion ids: what the loss covers), the mean over those rollouts;
- **seconds per turn outside the engine**: each of those rollouts' wall time less its model calls' time
  (``llm_s``: the union of its turns' ``started_at``-``finished_at``, stamped by the capture proxy in
  black-box, by the trainer's model step in white-box), divided by its turns; the mean over rollouts. In
  black-box that is the agent's process (its start, its own loop, its tools) and the proxy; in white-box
  the trainer's rendering and parsing, the session's tools and the sandbox.

Reported: each measure per mode and the white-box / black-box ratio. No target: the issue asks to measure
honestly, not for a number.

Run: ``python benchmarks/whitebox.py [--quick] [--steps 8] [--seed 0] [--json OUT]``; ``--quick`` is the
test's configuration: the toy agent for black-box, no warm-up, 3 steps of 2 rollouts of at most 32 tokens.
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

MODES = ("black-box", "white-box")
MEASURES = ("rollouts_per_min", "trained_tokens_per_rollout", "outside_engine_s_per_turn")
QUICK_FLAGS = [
    "--harness", "toy", "--no-warmup", "--num-generations", "2", "--max-completion-length", "32",
    "--no-drop-zero-variance-groups",
]  # fmt: skip
"""The random tiny model (no warm-up) solves nothing: its equal-reward groups are kept, or no step would
come."""


def rollouts_per_minute(steps: Sequence[dict[str, Any]]) -> float | None:
    """The rollouts consumed by the steps after the first, per minute from the first step's end to the
    last's; None with fewer than two steps (or no time between them)."""
    steps = sorted((s for s in steps if s.get("step", 0) >= 1), key=lambda s: s["step"])
    if len(steps) < 2 or steps[-1]["time"] <= steps[0]["time"]:
        return None
    rollouts = sum(float(s.get("rollout/count", 0.0)) for s in steps[1:])
    return 60.0 * rollouts / (steps[-1]["time"] - steps[0]["time"])


def rollout_measures(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Per rollout a step took (a record with a step and a trace; one with zero advantage is forwarded but
    moves nothing): trained tokens and seconds per turn outside the engine, and turns and model seconds per
    turn; each the mean over those rollouts."""
    trained = [r for r in records if r.get("step") is not None and (r.get("trace") or {}).get("turns")]
    if not trained:
        return {}
    tokens, outside, turns, llm = [], [], [], []
    for record in trained:
        its = record["trace"]["turns"]
        tokens.append(sum(len(turn["completion_token_ids"]) for turn in its))
        outside.append(max(0.0, record["seconds"] - record["llm_s"]) / len(its))
        llm.append(record["llm_s"] / len(its))
        turns.append(len(its))
    return {
        "trained_tokens_per_rollout": statistics.mean(tokens),
        "outside_engine_s_per_turn": statistics.mean(outside),
        "llm_s_per_turn": statistics.mean(llm),
        "turns_per_rollout": statistics.mean(turns),
        "trained_rollouts": float(len(trained)),
    }


def read_run(output: Path) -> dict[str, Any]:
    """One dev-loop run's measures from its output folder."""
    from harness_trainer.trainer.feed.rollout_log import read_rollout_log

    steps = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s.get("step", 0) >= 1 and "rollout/count" in s]
    records = [r.model_dump(mode="json") for r in read_rollout_log(output)]
    return {
        "rollouts_per_min": rollouts_per_minute(steps),
        **rollout_measures(records),
        "steps": len(steps),
        "reward": [s.get("reward") for s in steps],
    }


def ratios(runs: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Each measure's white-box / black-box ratio (None where either is missing or the base is 0)."""
    out: dict[str, float | None] = {}
    for name in MEASURES:
        black, white = runs["black-box"].get(name), runs["white-box"].get(name)
        out[name] = white / black if black and white is not None else None
    return out


def run_flags(mode: str, steps: int, seed: int, quick: bool) -> list[str]:
    """One run's dev-loop flags: evaluation only after the last step (outside the measured steps)."""
    flags = ["--mode", mode, "--seed", str(seed), "--max-steps", str(steps), "--eval-steps", str(steps),
             "--no-eval-on-start"]  # fmt: skip
    return flags + (QUICK_FLAGS if quick else [])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="toy agent, no warm-up, 3 steps")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 8; --quick: 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    steps = args.steps or (3 if args.quick else 8)
    if steps < 2:
        parser.error("--steps must be at least 2: rollouts per minute are read after the first step")
    started = time.perf_counter()
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="whitebox-") as scratch:
        for mode in MODES:
            output = Path(scratch) / mode
            flags = run_flags(mode, steps, args.seed, args.quick)
            seconds = run_dev_loop(output, flags, Path(scratch) / f"{mode}.log", mode)
            runs[mode] = {**read_run(output), "seconds": seconds}
            print(f"{mode}: {runs[mode]}", flush=True)
    result = {
        "config": {
            "steps": steps,
            "seed": args.seed,
            "quick": args.quick,
            "black_box_agent": "toy" if args.quick else "mini-swe-agent",
        },
        "runs": runs,
        "ratios": ratios(runs),
        "verdicts": [],
        "all_pass": True,
        "elapsed_s": time.perf_counter() - started,
    }
    rows = [("measure", *MODES, "white / black")]
    for name in (*MEASURES, "llm_s_per_turn", "turns_per_rollout"):
        cells = [runs[mode].get(name) for mode in MODES]
        ratio = result["ratios"].get(name)
        rows.append((name, *(f"{c:.2f}" if c is not None else "-" for c in cells),
                     f"{ratio:.2f}x" if ratio is not None else "-"))  # fmt: skip
    print_table(rows)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
