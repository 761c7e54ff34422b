"""Cold preparation of N distinct environments on the Docker backend, against the slowest of them alone.

``serve --prepare SPLIT --prepare-sandbox docker`` builds the image of every task of a split before serving
(``RolloutRuntime.prepare``: ``at_once`` builds at a time, its default, as ``serve`` uses it). Here:
``--environments`` tasks (8), each its own Dockerfile ``FROM debian:bookworm-slim`` (stood in for by the
local base) whose one ``RUN`` step waits its build time (spread evenly from ``--min-build`` to
``--max-build`` seconds, 10-30 s: what a layer of downloads costs, without competing for the 2 cores), made
cold by a fresh salt in each run. Baseline: the slowest of them built alone, cold, through the same
``prepare``. Measured: the wall time of preparing all of them at once, ``--repeats`` times (3), each with
new salts (so every build is cold), in the order the split lists them (shuffled by the repeat's seed). The
images are removed after each measurement.

Target (the issue's, fixed before any run): all N ready within 1.5x the slowest single build (median of
the repeats).

Run: ``python -m benchmarks.docker_prepare [--quick] [--json OUT] [--environments 8] [--repeats 3]``;
``--quick``: 3 environments of 2-4 s, one repeat. Needs ``scripts/setup_docker.sh``.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: its siblings import from the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import finish, positive, print_table, print_verdicts

MAX_RATIO = 1.5
TARGETS = (f"all environments ready within {MAX_RATIO:g}x the slowest single build (median)",)


def build_seconds(environments: int, low: float, high: float) -> list[float]:
    """Each environment's build time: ``low`` to ``high`` spread evenly."""
    step = (high - low) / max(1, environments - 1)
    return [low + step * k for k in range(environments)]


def write_tasks(root: Path, seconds: Sequence[float], salt: str) -> list[Any]:
    """One task folder per build time, each its own environment (the salt makes every image new)."""
    from harness_trainer.tasks import load_task

    tasks = []
    for index, wait in enumerate(seconds):
        folder = root / f"env-{index}"
        (folder / "environment").mkdir(parents=True)
        (folder / "tests").mkdir()
        (folder / "task.toml").write_text('version = "2.0"\n[environment]\nbuild_timeout_sec = 600\n')
        (folder / "instruction.md").write_text("Nothing to do.\n")
        (folder / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
        dockerfile = f"FROM debian:bookworm-slim\nRUN echo {salt}-{index} > /salt && sleep {wait:.2f}\n"
        (folder / "environment" / "Dockerfile").write_text(dockerfile)
        tasks.append(load_task(folder))
    return tasks


async def prepare_seconds(tasks: list[Any], data_dir: Path) -> tuple[float, list[str]]:
    """Wall time of ``RolloutRuntime.prepare`` on the docker backend, and the images it made."""
    from harness_trainer.rollouts.server.runtime import RolloutRuntime, RuntimeConfig

    runtime = RolloutRuntime(RuntimeConfig(upstream="http://127.0.0.1:9", data_dir=data_dir))
    try:
        started = time.perf_counter()
        await runtime.prepare(tasks, "docker")
        seconds = time.perf_counter() - started
        backend = runtime.backend("docker").backend  # type: ignore[attr-defined]  # the supervisor's
        images = [await backend.images.resolve(task) for task in tasks]  # built: answered from its cache
    finally:
        await runtime.aclose()
    return seconds, images


def remove(images: list[str]) -> int:
    """Remove ``images``; returns how many are still there (0)."""
    subprocess.run(["docker", "rmi", "-f", *images], capture_output=True, timeout=300)
    inspect_one = ("docker", "image", "inspect")
    still = [subprocess.run([*inspect_one, i], capture_output=True, timeout=60) for i in images]
    return sum(done.returncode == 0 for done in still)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    began = time.monotonic()
    seconds = build_seconds(args.environments, args.min_build, args.max_build)
    from harness_trainer.rollouts.server.runtime import RolloutRuntime

    at_once = inspect.signature(RolloutRuntime.prepare).parameters["at_once"].default
    config = {
        "quick": args.quick, "environments": args.environments, "repeats": args.repeats,
        "build_s": seconds, "at_once": at_once,
    }  # fmt: skip
    runs, leftovers = [], 0
    with tempfile.TemporaryDirectory(prefix="docker-prepare-") as scratch:
        tmp = Path(scratch)
        for seed in range(args.repeats):
            slowest = write_tasks(tmp / f"alone-{seed}", [seconds[-1]], uuid.uuid4().hex)
            alone, images = await prepare_seconds(slowest, tmp / f"capture-alone-{seed}")
            leftovers += remove(images)
            tasks = write_tasks(tmp / f"all-{seed}", seconds, uuid.uuid4().hex)
            random.Random(seed).shuffle(tasks)
            together, images = await prepare_seconds(tasks, tmp / f"capture-all-{seed}")
            leftovers += remove(images)
            runs.append({"seed": seed, "alone_s": alone, "all_s": together, "ratio": together / alone})
            print(f"repeat {seed + 1}/{args.repeats}: slowest alone {alone:.1f} s, all {args.environments} "
                  f"{together:.1f} s ({together / alone:.2f}x)", flush=True)  # fmt: skip
    median = statistics.median(r["ratio"] for r in runs)
    verdicts = [
        {
            "target": TARGETS[0],
            "pass": median <= MAX_RATIO,
            "measured": f"{median:.2f}x (median of {len(runs)}; worst {max(r['ratio'] for r in runs):.2f}x)",
        }
    ]
    return {
        "config": config, "runs": runs, "verdicts": verdicts, "all_pass": all(v["pass"] for v in verdicts),
        "leftover_images": leftovers, "elapsed_s": time.monotonic() - began,
    }  # fmt: skip


def print_report(result: dict[str, Any]) -> None:
    rows = [("repeat", "slowest alone", "all at once", "ratio")]
    for r in result["runs"]:
        rows.append((str(r["seed"]), f"{r['alone_s']:.1f} s", f"{r['all_s']:.1f} s", f"{r['ratio']:.2f}x"))
    print_table(rows)
    print_verdicts(result, 70)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="3 environments of 2-4 s, one repeat")
    add("--environments", type=positive, default=8)
    add("--min-build", type=float, default=10.0, help="the fastest build's seconds (default 10)")
    add("--max-build", type=float, default=30.0, help="the slowest build's seconds (default 30)")
    add("--repeats", type=positive, default=3)
    add("--json", type=Path, default=None, help="write the result here")
    add("--strict", action="store_true", help="exit 1 on a missed target")
    args = parser.parse_args(argv)
    if args.quick:
        args.environments, args.min_build, args.max_build, args.repeats = 3, 2.0, 4.0, 1
    return finish(asyncio.run(run(args)), args, print_report, leftovers_key="leftover_images")


if __name__ == "__main__":
    sys.exit(main())
