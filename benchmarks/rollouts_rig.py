"""The rollout benchmarks' rig: a fake engine and ``harness-trainer serve`` as real processes on loopback,
and what ``/proc`` says about them (the server's proxy child, the agents running, leftovers, free memory).

Shared by :mod:`benchmarks.rollouts` and :mod:`benchmarks.soak`; the set-up is described in
:mod:`benchmarks.rollouts`' docstring.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import orjson

from benchmarks.common import Server, free_port, start_server
from harness_trainer.examples import TASKS

HERE = Path(__file__).resolve().parent
SPLIT, TASK = "train", "hello-file"
MODEL = "fake-vllm"
SAMPLING = {"temperature": 1.0}
CPUS = os.cpu_count() or 1
CALLS_METRIC = 'capture_proxy_requests_total{route="/v1/chat/completions",status="200"}'


def start_healthy(
    stack: contextlib.ExitStack, name: str, command: list[str], port: int, tags: tuple[str, ...], env: dict
) -> Server:
    """Start ``command`` (a long stop grace: the server closes its sessions on TERM); wait for /health."""
    server = start_server(stack, name, command, port, tags=tags, env=env, stop_timeout=60.0)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and server.process.poll() is None:
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(server.url + "/health", timeout=5) as reply:
                if reply.status == 200:
                    return server
        time.sleep(0.1)
    detail = "exited" if server.process.poll() is not None else "not healthy after 60 s"
    raise RuntimeError(f"{name} {detail}; its output:\n{server.log_tail()}")


def start_engine(stack: contextlib.ExitStack, delay: float) -> Server:
    """The fake vLLM (each reply a ``bash`` tool call running ``true``), holding each reply ``delay`` s."""
    port = free_port()
    command = [sys.executable, str(HERE / "fake_vllm.py"), "engine", "--port", str(port), "--command", "true"]
    tags = (f"127.0.0.1:{port}",)
    return start_healthy(
        stack, f"engine (delay {delay} s)", [*command, "--delay", str(delay)], port, tags, {}
    )


def start_rollout_server(
    stack: contextlib.ExitStack, tmp: Path, name: str, engine: str, limit: int
) -> Server:
    """``harness-trainer serve`` with its sandboxes (``TMPDIR``) and journals under ``tmp/name``."""
    port, capture = free_port(), free_port()
    (sandboxes := tmp / name / "sandboxes").mkdir(parents=True)
    command = [sys.executable, "-m", "harness_trainer.cli", "serve", "--dataset", str(TASKS)]
    command += ["--upstream", engine, "--port", str(port), "--capture-port", str(capture)]
    command += ["--data-dir", str(tmp / name / "capture"), "--max-concurrent-envs", str(limit)]
    tags = (f"127.0.0.1:{port}", f"127.0.0.1:{capture}", f"--port {port}", str(tmp / name))
    server = start_healthy(stack, f"server {name}", command, port, tags, {"TMPDIR": str(sandboxes)})
    server.proxy = f"127.0.0.1:{capture}"
    return server


def proxy_pid(server: Server) -> int | None:
    """The server's capture proxy child (``serve`` runs it as its own process), if it has one."""
    for task in Path(f"/proc/{server.process.pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            with contextlib.suppress(OSError):
                if b"capture_proxy" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return int(pid)
    return None


def mem_available_mb() -> float:
    """The machine's ``MemAvailable`` in MB (``/proc/meminfo``)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    raise KeyError("MemAvailable")


def processes() -> list[tuple[str, list[bytes]]]:
    """Every process but this one: its pid, and its argv (empty for kernel threads)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                found.append((entry.name, Path(entry.path, "cmdline").read_bytes().split(b"\0")))
    return found


def count_agents(server: Server) -> int:
    """Toy agent interpreters (``argv[1]`` is the script) pointed at ``server``'s proxy."""
    proxy = server.proxy.encode()
    return sum(
        1
        for _, argv in processes()
        if len(argv) > 2 and argv[1].endswith(b"toy_agent.py") and proxy in b" ".join(argv)
    )


def leftovers(tags: Sequence[str], root: Path) -> list[str]:
    """Processes naming one of ``tags``, or in another mount namespace that mounts from ``root``."""
    own = os.readlink("/proc/self/ns/mnt")
    found = []
    for pid, argv in processes():
        text = b" ".join(argv).decode(errors="replace").strip()
        hit = any(tag in text for tag in tags)
        with contextlib.suppress(OSError):
            if not hit and os.readlink(f"/proc/{pid}/ns/mnt") != own:
                hit = str(root) in Path(f"/proc/{pid}/mountinfo").read_text()
        if hit:
            found.append(f"{pid} {text[:200]}")
    return found


def task_index(server: Server) -> int:
    """The index of the benchmark's task in its split, as ``server`` lists it."""
    with urllib.request.urlopen(f"{server.url}/splits/{SPLIT}/tasks", timeout=30) as reply:
        return next(task["index"] for task in orjson.loads(reply.read())["tasks"] if task["name"] == TASK)
