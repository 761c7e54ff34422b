"""Shared by the benchmarks: server subprocesses on free loopback ports; a process's CPU and memory; the
report's table and verdict lines; the end of a run (report, ``--json``, exit status).

Every process started through :func:`start_server` is stopped when its ``ExitStack`` closes (TERM, then
KILL after a grace), before its captured output is closed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent
TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Server:
    """A server subprocess: its base URL, the process, its captured output, what identifies its processes."""

    name: str
    url: str
    process: subprocess.Popen
    log: Any
    tags: tuple[str, ...] = ()  # strings in the command line of every process it (or its sandboxes) starts
    proxy: str = ""  # a rollout server's capture proxy, ``host:port``

    def log_tail(self, chars: int = 3000) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-chars:]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_dev_loop(
    output: Path, flags: list[str], log: Path, what: str, env: dict[str, str] | None = None
) -> float:
    """``harness-trainer dev --output-dir OUTPUT FLAGS`` to its end, its output in ``log``; its wall seconds.
    ``env``: variables set for it on top of this process's environment.
    Stopped (SIGTERM, then SIGKILL) on every path: a Ctrl-C here stops the dev loop, which closes what it
    started.

    Raises:
        RuntimeError: it exited non-zero (the end of its log attached), naming ``what`` ran.
    """
    command = [sys.executable, "-m", "harness_trainer.cli", "dev", "--output-dir", str(output), *flags]
    started = time.perf_counter()
    with log.open("wb") as sink:
        process = subprocess.Popen(
            command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        try:
            code = process.wait()
        finally:
            stop_process(process, 60.0)
    if code != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"harness-trainer dev ({what}) exited with {code}:\n{tail}")
    return time.perf_counter() - started


def stop_process(process: subprocess.Popen, timeout: float = 30.0) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def start_server(
    stack: contextlib.ExitStack,
    name: str,
    command: list[str],
    port: int,
    *,
    tags: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    stop_timeout: float = 30.0,
) -> Server:
    """Start ``command`` with its output captured; it is stopped when ``stack`` closes. Not yet healthy."""
    log = stack.enter_context(tempfile.TemporaryFile())
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT)
    stack.callback(stop_process, process, stop_timeout)
    return Server(name, f"http://127.0.0.1:{port}", process, log, tags)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of every thread of ``pid``, past and present (children not included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def run_seconds(pid: int) -> float:
    """CPU time of ``pid``'s live threads to the nanosecond (the scheduler's ``schedstat``): finer than
    :func:`cpu_seconds`' clock ticks, for costs of a few milliseconds; a thread that ended is not counted."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (every thread's), from ``/proc``."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            found += [int(child) for child in (task / "children").read_text().split()]
    return found


def tree_cpu_seconds(pid: int) -> float:
    """:func:`cpu_seconds` of ``pid`` and of every process below it, live or reaped by its parent.

    For a server whose helpers are part of its cost (the capture proxy's fdatasync helper).
    """
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    total = sum(int(value) for value in fields[11:15]) / TICKS  # utime, stime, cutime, cstime
    for child in children(pid):
        with contextlib.suppress(OSError):
            total += tree_cpu_seconds(child)
    return total


def status_value(pid: int, key: str) -> int:
    """A number from ``/proc/<pid>/status``: ``VmRSS``/``VmHWM`` in kB, ``Threads``…"""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def positive(text: str) -> int:
    """An argparse type: an int of at least 1."""
    if (value := int(text)) < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def print_table(rows: list[tuple[str, ...]], left: int = 1) -> None:
    """Print ``rows`` (the header first) in columns two spaces apart: the first ``left`` columns left-aligned,
    the others right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        pairs = enumerate(zip(row, widths, strict=True))
        print("  ".join(text.ljust(w) if i < left else text.rjust(w) for i, (text, w) in pairs))


def print_verdicts(result: dict[str, Any], width: int) -> None:
    """Print ``result["verdicts"]`` as PASS/MISS lines (target names padded to ``width``), then the time."""
    print("targets:")
    for verdict in result["verdicts"]:
        mark = "PASS" if verdict["pass"] else "MISS"
        print(f"  {mark}  {verdict['target']:<{width}} {verdict['measured']}")
    print(f"elapsed: {result['elapsed_s']:.0f} s")


def run_with_servers(
    run: Callable[[dict[str, Any], contextlib.ExitStack], Awaitable[dict[str, Any]]], config: dict[str, Any]
) -> dict[str, Any] | None:
    """``run(config, stack)`` on an event loop, every server it starts entered on ``stack``; SIGTERM stops
    them as Ctrl-C does. Returns its result with ``elapsed_s``, or None when interrupted (said on stderr:
    every server is stopped by then)."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    started = time.perf_counter()
    try:
        with contextlib.ExitStack() as stack:
            result = asyncio.run(run(config, stack))
    except KeyboardInterrupt:
        print("interrupted: every server stopped", file=sys.stderr)
        return None
    result["elapsed_s"] = time.perf_counter() - started
    return result


def finish(
    result: dict[str, Any],
    args: argparse.Namespace,
    print_report: Callable[[dict[str, Any]], None],
    leftovers_key: str | None = "leftover_processes",
) -> int:
    """The end of a benchmark's ``main``: print the report, write ``result`` to ``args.json`` (if given), and
    return the exit status: 1 on leftover processes (``result[leftovers_key]``; none checked when ``None``),
    else 1 on a missed target under ``args.strict``, else 0."""
    print_report(result)
    if args.json is not None:
        args.json.write_text(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode() + "\n")
    if leftovers_key is not None and result[leftovers_key]:
        return 1
    return 1 if args.strict and not result["all_pass"] else 0
