"""``python -m benchmarks``: run every benchmark of the project and write one report, ``BENCHMARKS.md``.

Each benchmark (``benchmarks.report.BENCHMARKS``) runs as its own subprocess, ``python -m
benchmarks.<name> [--quick] --json FILE``, one after the other so they never compete for the machine,
with the same settings every time (their defaults, or their ``--quick`` configurations). Its output is
streamed here line by line, prefixed with its name. The report (``benchmarks/report.py``) describes the
machine (CPU, cores, RAM, OS, Python, torch, date, git commit), then each benchmark's measurements as
ratios against its own baseline with medians and spreads and its PASS/MISS verdicts, then the soak.

The machine's load is recorded for each benchmark: the CPU that processes other than the benchmark's own
used while it ran (``/proc/stat``'s busy time less the CPU of the benchmark's process tree, as the kernel
accounts it to this process's children), in cores on average. When it was above :data:`HIGH_LOAD_CORES`,
the benchmark runs once more (its first result is dropped) and its section says so, with both loads.

A benchmark that fails (non-zero exit, no JSON) gets a section saying so with the end of its output; the
others still run, and the exit status is 1. A MISS is a result, not a failure. Ctrl-C or SIGTERM stops
the running benchmark (with one SIGTERM, on which it stops its own servers) and writes nothing; so does a
benchmark running past its time limit (then it counts as failed).

The learning benchmark takes hours in its full configuration, so the default run leaves it out
(:data:`~benchmarks.report.LONG`; ``--long`` or ``--only learning`` runs it), and the GPU check cannot run
here (:data:`~benchmarks.report.ELSEWHERE`). The report of a default run still has their sections, each
saying why it is not in this run; the learning section carries its search log, every run it ever made
with its commit and date.

Run: ``python -m benchmarks [--quick] [--long] [--only engine,soak] [--output BENCHMARKS.md] [--json-dir DIR]
[--update-readme] [--readme README.md]``.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import importlib.metadata
import json
import os
import platform
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import stop_process
from benchmarks.report import (
    BENCHMARKS,
    ELSEWHERE,
    LONG,
    not_run_section,
    readme_block,
    render_report,
    replace_block,
    section,
)

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = {"quick": 600.0, "full": 7200.0, "long": 6 * 3600.0}  # per benchmark
HIGH_LOAD_CORES = 0.5
"""Other processes' average CPU, in cores, above which a benchmark's run counts as disturbed and runs
again once (fixed before any run; a quarter of this project's 2-core machine)."""


class LoadMeter:
    """The CPU other processes use while a benchmark runs: the machine's busy time (``/proc/stat``) less
    what this process's children used (``RUSAGE_CHILDREN``: a waited-for child with every descendant it
    waited for), over the wall time, in cores."""

    def __init__(self) -> None:
        self.busy, self.children, self.wall = busy_seconds(), children_seconds(), time.perf_counter()

    def other_cores(self) -> float:
        wall = time.perf_counter() - self.wall
        if wall <= 0:
            return 0.0
        other = (busy_seconds() - self.busy) - (children_seconds() - self.children)
        return max(0.0, other / wall)


def busy_seconds() -> float:
    """Seconds every CPU of the machine spent busy since boot (``/proc/stat``: all but idle and iowait)."""
    fields = read("/proc/stat").splitlines()[0].split()[1:]
    ticks = [int(value) for value in fields[:8]]
    busy = sum(ticks) - ticks[3] - ticks[4]  # idle, iowait
    return busy / os.sysconf("SC_CLK_TCK")


def children_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def machine(quick: bool) -> dict[str, str]:
    """What the numbers were measured on."""
    cpuinfo = {key: value for key, _, value in map(field, read("/proc/cpuinfo").splitlines())}
    meminfo = {key: value.split()[0] for key, _, value in map(field, read("/proc/meminfo").splitlines())}
    release = {
        key: value.strip('"')
        for key, _, value in (line.partition("=") for line in read("/etc/os-release").splitlines())
    }
    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = "not installed"
    cores, usable = os.cpu_count() or 0, len(os.sched_getaffinity(0))
    mode = "quick (every benchmark's --quick configuration)" if quick else "full (every benchmark's defaults)"
    return {
        "CPU": cpuinfo.get("model name") or platform.processor() or platform.machine(),
        "cores": f"{cores}" + (f" ({usable} usable by this process)" if usable != cores else ""),
        "RAM": f"{int(meminfo.get('MemTotal', 0)) / 1024**2:.1f} GiB",
        "OS": f"{release.get('PRETTY_NAME') or platform.system()}, kernel {platform.release()}",
        "Python": platform.python_version(),
        "torch": torch,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "git commit": git_commit(),
        "mode": mode,
    }


def field(line: str) -> tuple[str, str, str]:
    """``key: value`` split at the first colon (``/proc`` files)."""
    key, sep, value = line.partition(":")
    return key.strip(), sep, value.strip()


def read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def git(*command: str) -> str:
    done = subprocess.run(["git", *command], cwd=ROOT, capture_output=True, text=True, timeout=30, check=True)
    return done.stdout.strip()


def git_commit() -> str:
    """The short commit, ``+ changes`` when tracked files differ from it."""
    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + (" + uncommitted changes" if dirty else "")


def run_one(name: str, quick: bool, json_dir: Path) -> tuple[dict[str, Any] | None, str, float]:
    """Run benchmark ``name``; its result (None when it failed), what went wrong ('' if nothing), seconds."""
    out = json_dir / f"{name}.json"
    out.unlink(missing_ok=True)
    command = [sys.executable, "-m", f"benchmarks.{name}", "--json", str(out)] + (
        ["--quick"] if quick else []
    )
    print(f"== {name}: {' '.join(command[1:])}", flush=True)
    started, tail = time.perf_counter(), collections.deque(maxlen=40)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    pipe, merged = subprocess.PIPE, subprocess.STDOUT
    # Its own session: a Ctrl-C reaches only this process, which then stops the benchmark with one TERM
    # (a second signal in the middle of its clean-up could leave its servers behind).
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=pipe, stderr=merged, text=True, env=env, start_new_session=True
    )
    limit = TIMEOUT_S["quick" if quick else "long" if name in LONG else "full"]
    watchdog = threading.Timer(limit, process.terminate)
    watchdog.start()
    try:
        assert process.stdout is not None
        for line in process.stdout:
            tail.append(line.rstrip("\n"))
            print(f"[{name}] {line}", end="", flush=True)
        code = process.wait()
    finally:
        watchdog.cancel()
        stop_process(process, 120.0)  # interrupted: TERM makes the benchmark stop its servers and exit
    seconds = time.perf_counter() - started
    result = json.loads(out.read_text()) if out.is_file() else None
    error = f"exit code {code}; the end of its output:\n" + "\n".join(tail)
    print(f"== {name}: {seconds:.0f} s, exit code {code}", flush=True)
    return result, "" if code == 0 and result is not None else error, seconds


def run_measured(name: str, quick: bool, json_dir: Path) -> tuple[dict[str, Any] | None, str, float, str]:
    """:func:`run_one` with the machine's load recorded, once more when it was high (module docstring):
    its result, error and seconds, and a note on the load."""
    meter = LoadMeter()
    result, error, seconds = run_one(name, quick, json_dir)
    load = meter.other_cores()
    note = f"machine load: other processes used {load:.2f} cores on average while it ran"
    if load > HIGH_LOAD_CORES and not error:
        print(f"== {name}: other processes used {load:.2f} cores (> {HIGH_LOAD_CORES}): again", flush=True)
        meter = LoadMeter()
        result, error, seconds = run_one(name, quick, json_dir)
        again = meter.other_cores()
        note = (
            f"machine load: other processes used {load:.2f} cores on average during its first run (over "
            f"{HIGH_LOAD_CORES}), so it ran again, this result, at {again:.2f}"
        )
    return result, error, seconds, note


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="every benchmark in its quick configuration (for tests)")
    every = ",".join(BENCHMARKS)
    add("--only", default=None, help=f"comma-separated, from {every} (default: all but --long's)")
    add("--long", action="store_true", help=f"also the ones too long for the default run ({','.join(LONG)})")
    add("--output", type=Path, default=ROOT / "BENCHMARKS.md", help="the report (default BENCHMARKS.md)")
    add("--json-dir", type=Path, default=None, help="keep each benchmark's JSON result here")
    add("--update-readme", action="store_true", help="replace the README's benchmark block with the summary")
    add("--readme", type=Path, default=ROOT / "README.md", help="the README to update (default README.md)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmarks, write the report (and the README block); 0, or 1 when one failed."""
    args = build_parser().parse_args(argv)
    default = [name for name in BENCHMARKS if args.long or name not in LONG]
    names = default if args.only is None else [name.strip() for name in args.only.split(",") if name.strip()]
    names = sorted(set(names), key=lambda name: BENCHMARKS.index(name) if name in BENCHMARKS else -1)
    # The whole run's report names what it left out and why; a chosen few (--only) is only those.
    left_out = [] if args.only is not None else [n for n in (*BENCHMARKS, *ELSEWHERE) if n not in names]
    if unknown := [name for name in names if name not in BENCHMARKS]:
        build_parser().error(f"unknown benchmark(s) {unknown}; choose from {', '.join(BENCHMARKS)}")
    if args.update_readme and not args.readme.is_file():
        build_parser().error(f"no README at {args.readme}")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops the running benchmark too
    command = "python -m benchmarks" + (" --quick" if args.quick else "") + (" --long" if args.long else "")
    started, sections, failed = time.perf_counter(), [], False
    try:
        with tempfile.TemporaryDirectory(prefix="benchmarks-") as scratch:
            json_dir = args.json_dir or Path(scratch)
            json_dir.mkdir(parents=True, exist_ok=True)
            description = machine(args.quick)
            for name in names:
                result, error, seconds, note = run_measured(name, args.quick, json_dir)
                sections.append(section(name, result, error, seconds))
                sections[-1].notes.append(note)
                failed = failed or bool(error)
            sections += [not_run_section(name) for name in left_out]
    except KeyboardInterrupt:
        print("interrupted: the running benchmark was stopped; no report written", file=sys.stderr)
        return 130
    description["total time"] = f"{time.perf_counter() - started:.0f} s"
    args.output.write_text(render_report(description, sections, command))
    print(f"wrote {args.output}")
    if args.update_readme:
        text = args.readme.read_text()
        args.readme.write_text(
            replace_block(text, readme_block(description, sections, command + " --update-readme"))
        )
        print(f"updated the benchmark block of {args.readme}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
