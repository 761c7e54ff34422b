"""Pooled HF sandbox starts against a fake Hub with injected latencies: 256 starts at once, against the time
the pool's hosts take to start plus the time the Hub takes to make that many sandboxes.

The Hub is the tests' fake (``tests/sandboxes/fake_hf.py``: an HTTP server on loopback standing in for the
Jobs API and each job's ``sbx-server``; each job an overlay of its image exported from the Docker daemon,
its commands really run; it needs root and ``scripts/setup_docker.sh``), so this benchmark runs from a
repository checkout. The hf backend (``HfSandboxBackend(dedicated=False)``) and ``huggingface_hub``'s
``SandboxPool`` and HTTP client are the real ones.

**What a start is.** A pooled sandbox may write only its home, so a Harbor task's paths (``/logs``,
``/tests``, its workdir) cannot be made there and ``backend.start`` refuses every Harbor task in a pool. A
start here is therefore the backend's pooled start up to the task's paths,
``HfSandboxBackend.create_sandbox``: the token checked, the run's pool opened (its hosts booted, once, for
all starts), a sandbox made through ``SandboxPool.create`` (with the backend's retries) and its first
command answered (the backend asks the sandbox for its home): what a task that needs only its home gets.
No agent bundle is uploaded.

**Burst.** ``--starts`` (256) ``create_sandbox`` calls submitted at once on one backend with
``concurrency`` = starts and ``sandboxes_per_host`` 50 (the defaults ``serve`` would use), so the pool
boots ``ceil(256 / 50)`` = 6 hosts up front in parallel. Measured from the submission to the last sandbox
started (T_last), against the yardstick (one host's start time + starts / create rate): the hosts boot in
parallel, then the creates go at the Hub's rate. Every sandbox is really made (a uid and a home in its
host's overlay) and stays open until the last has started; all are closed after, and every host job is
cancelled. ``--repeats`` times, each on a fresh fake Hub.

**Injected latencies** (Hugging Face publishes neither figure: its sandbox guide says a sandbox spins up
"in seconds" and a pool's create is "~one proxy round-trip once a host is warm"; both are assumptions).
Every duration is multiplied by ``--scale``, every rate divided by it:

- a host job's start: 30 s from ``run_job`` to its server answering (scheduling a ``cpu-basic`` VM, pulling
  a small image, fetching and starting ``sbx-server``);
- pooled creates: 10 per second, Hub-wide (one budget across every host, each create waiting its turn):
  a conservative stand-in for a proxy round trip plus the server's ``useradd`` and Landlock setup;
- not modelled: network time of each call (loopback here), the Jobs API's own rate limits, a host that
  fails to start.

Target (fixed before any run): T_last within 1.5x (host start + starts / create rate), with no failed
start; and no job left running after.

Run: ``python -m benchmarks.hf_pool [--quick] [--json OUT] [--scale 0.25] [--repeats 3] [--starts 256]``;
``--quick``: 32 starts, scale 0.1, one repeat.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: its siblings import from the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import finish, positive, print_table, print_verdicts
from benchmarks.e2b_starts import write_task

REAL = {"host_start_s": 30.0, "create_rate_per_s": 10.0, "sandboxes_per_host": 50}
IMAGE = "debian:bookworm-slim"
MAX_BOUND_RATIO = 1.5
TARGETS = (f"last start within {MAX_BOUND_RATIO:g}x (host start + starts / create rate), none failed",)


async def burst(starts: int, scale: float, tmp: Path) -> dict[str, Any]:
    """One burst (see the module docstring) on a fresh fake Hub under ``tmp``."""
    import pytest

    from harness_trainer.sandboxes.hf import HfSandboxBackend
    from tests.sandboxes.fake_hf import FakeHub

    task = write_task(tmp / "tasks", "home-only", f"FROM {IMAGE}\n")
    host_start_s, rate = REAL["host_start_s"] * scale, REAL["create_rate_per_s"] / scale
    with FakeHub(tmp / "hub") as hub, pytest.MonkeyPatch.context() as patch, hub.use(patch):
        hub.job_start_s, hub.create_rate_per_s = host_start_s, rate
        backend = HfSandboxBackend(
            dedicated=False, concurrency=starts, sandboxes_per_host=REAL["sandboxes_per_host"],
            retry_backoff_s=2.0 * scale, kill_grace_s=0.5,
        )  # fmt: skip
        t0 = time.monotonic()

        async def start() -> float:
            await backend.create_sandbox(task, lifetime_s=600)
            return time.monotonic() - t0

        try:
            done = await asyncio.gather(*(start() for _ in range(starts)), return_exceptions=True)
            hosts = len(hub.running())
        finally:
            await backend.aclose()
        leftover = len(hub.running())
    times = sorted(d for d in done if isinstance(d, float))
    errors = [repr(d) for d in done if not isinstance(d, float)]
    t_last = times[-1] if times else float("nan")
    bound = host_start_s + starts / rate
    run = {
        "t_last_s": t_last, "first_start_s": times[0] if times else None,
        "median_start_s": statistics.median(times) if times else None, "started": len(times),
        "failed": len(errors), "errors": errors[:3], "hosts": hosts, "bound_s": bound,
        "ratio": t_last / bound, "leftover_jobs": leftover,
    }  # fmt: skip
    print(f"burst: last start {t_last:.2f} s, bound {bound:.2f} s ({run['ratio']:.2f}x), "
          f"{hosts} hosts, {len(errors)} failed")  # fmt: skip
    return run


def verdicts(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ratios = [r["ratio"] for r in runs]
    failed = sum(r["failed"] for r in runs)
    median = statistics.median(ratios)
    return [
        {
            "target": TARGETS[0],
            "pass": median <= MAX_BOUND_RATIO and failed == 0,
            "measured": f"{median:.2f}x (median; worst {max(ratios):.2f}x), {failed} failed starts",
        }
    ]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    config = {
        "quick": args.quick, "scale": args.scale, "starts": args.starts, "repeats": args.repeats,
        "image": IMAGE, "real": REAL,
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="hf-pool-", dir="/var/tmp") as scratch:
        runs = [
            await burst(args.starts, args.scale, Path(scratch) / f"burst-{k}") for k in range(args.repeats)
        ]
    found = verdicts(runs)
    return {
        "config": config,
        "runs": runs,
        "verdicts": found,
        "all_pass": all(v["pass"] for v in found),
        "leftover_jobs": sum(r["leftover_jobs"] for r in runs),
        "elapsed_s": time.monotonic() - started,
    }


def print_report(result: dict[str, Any]) -> None:
    rows = [("repeat", "last start", "median start", "bound", "ratio", "hosts", "failed")]
    for k, r in enumerate(result["runs"]):
        rows.append((
            str(k), f"{r['t_last_s']:.2f} s", f"{r['median_start_s'] or float('nan'):.2f} s",
            f"{r['bound_s']:.2f} s", f"{r['ratio']:.2f}x", str(r["hosts"]), str(r["failed"]),
        ))  # fmt: skip
    print_table(rows)
    print_verdicts(result, 80)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="32 starts, scale 0.1, one repeat")
    add("--scale", type=float, default=0.25, help="durations times this, rates divided by it (default 0.25)")
    add("--starts", type=positive, default=256)
    add("--repeats", type=positive, default=3, help="bursts, each on a fresh fake Hub (default 3)")
    add("--json", type=Path, default=None, help="write the result here")
    add("--strict", action="store_true", help="exit 1 on a missed target")
    args = parser.parse_args(argv)
    if args.quick:
        args.starts, args.scale, args.repeats = 32, 0.1, 1
    return finish(asyncio.run(run(args)), args, print_report, leftovers_key="leftover_jobs")


if __name__ == "__main__":
    sys.exit(main())
