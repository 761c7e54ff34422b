"""Shared by the benchmarks: server subprocesses on free loopback ports; a process's CPU and memory.

Every process started through :func:`start_server` is stopped when its ``ExitStack`` closes (TERM, then
KILL after a grace), before its captured output is closed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
