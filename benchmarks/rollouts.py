"""What a rollout costs beyond its agent, and how many concurrent rollouts one server holds on this machine.

Set-up (real processes on loopback, free ports, every one stopped on every path, Ctrl-C and SIGTERM
included; sandbox roots and capture journals in one temporary directory, given to the servers as
``TMPDIR`` and ``--data-dir``):

- **engine**: ``benchmarks/fake_vllm.py engine --command true``, a fake vLLM whose every reply is one
  ``bash`` tool call running ``true`` (so an agent never stops by itself); instant, or holding every
  reply ``--delay`` seconds for the concurrency points;
- **server**: ``harness-trainer serve`` on ``harness_trainer/examples/tasks`` (the rollout server; its
  capture proxy runs as its child process, ``serve``'s default), ``--max-concurrent-envs`` above the
  sessions asked for;
- **agent**: the ``toy`` harness's stdlib agent (``toy_agent.py``), run by the first ``python3`` on
  ``PATH``: the interpreter the harness runs in a local sandbox.

Measured:

1. **raw agent**: ``python3 toy_agent.py --steps N`` started directly against the engine (no server, no
   proxy, no sandbox), ``--repeats`` runs in a row after one warm-up: median seconds, start to exit.
2. **rollout**: the same agent and N through the server (``harness="toy"``, ``sandbox="local"``, task
   ``hello-file``) with :class:`HarborSessionFactory`, in a row after one warm-up (create → wait → fetch
   trace → verify → close): median seconds per rollout. **overhead** = rollout − raw, broken down with
   the medians of the result's ``phase_seconds``: capture_session, sandbox_start, install, ``agent −
   raw`` (``nsenter``, the login shell, the proxy hop), upload (the tests), verifier, trace, cleanup, and
   the rest (the client's HTTP calls and long poll, the server's bookkeeping). A rollout that fails (its
   agent makes fewer than N calls, or it is unscorable) is listed, left out of the medians and replaced.
3. **K sessions** (``--sessions``, default 64,128,256,512, a fresh server each): K rollouts on the slow
   engine, with a step limit out of reach. They are opened and started over the raw HTTP API from an
   asyncio client, at most ``--start-window`` starting at once (started: its agent process runs) and none
   while the machine's ``MemAvailable`` is under ``--min-free-mb``. Once every agent runs, the **hold
   window** (``--hold`` seconds): the server process's CPU (``utime + stime`` of all its threads,
   ``/proc/<pid>/stat``) as % of one core and of the machine; its proxy child's CPU the same way (with the
   proxy's own fdatasync helper), as % of one core; model calls per second through the proxy
   (``/metrics``) and the CPU ms per call of server and proxy together; the server's largest ``VmRSS``
   sample and its threads. **held**: the fewest
   agent processes alive (``argv[1]`` is ``toy_agent.py``, pointed at this server's proxy) in any sample
   of the window, and never more than the fewest open sessions ``GET /health`` reported. Then every
   session is stopped (``POST .../stop``: the agent killed as a timeout would), waited for, its trace
   fetched, and closed. **failed**: not opened or started, ended with an ``error``, or no trace.
   ``ramp s``: first open to every agent running; ``drain s``: first stop to last close; the server's
   CPU ms per session started (the ramp) and per session stopped and closed (the drain), and the stopped
   rollouts' median verifier, trace and cleanup seconds. A point that cannot hold all K (memory floor,
   start timeout, the server dying) ends the series, with the reason.

After each server stops, no process may remain that names its ports or the temporary directory, or that
sits in a mount namespace mounting from it (``leftover_processes`` in the JSON; the run exits 1).

Target: >= 512 concurrent sessions held, none failed, with the server's own CPU under 10 % of one core in
the hold window (the proxy's cost per call has its own target, in ``benchmarks/proxy.py``; it is printed
here beside the server's). Output: one table, then PASS/MISS; a MISS exits 0 unless ``--strict``.
Run: ``python benchmarks/rollouts.py [--quick] [--sessions 64,128,256,512] [--delay 2] [--hold 10]
[--steps 4] [--repeats 10] [--json OUT] [--strict]``; ``--quick`` is the tiny configuration of the test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

if not __package__:  # run as a script (python benchmarks/rollouts.py): its siblings import from the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    Server,
    cpu_seconds,
    finish,
    free_port,
    positive,
    print_table,
    start_server,
    status_value,
    stop_process,
    tree_cpu_seconds,
)
from harness_trainer.examples import TASKS
from harness_trainer.rollouts.client.factory import HarborSessionFactory
from harness_trainer.rollouts.client.session import RolloutUnscorable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
AGENT = ROOT / "harness_trainer" / "harnesses" / "toy_agent.py"
SPLIT, TASK = "train", "hello-file"
MODEL = "fake-vllm"
SAMPLING = {"temperature": 1.0}
CPUS = os.cpu_count() or 1
PHASES = ("capture_session", "sandbox_start", "install", "agent", "upload", "verifier", "trace", "cleanup")
COLUMNS = ("row", "seconds", "held", "failed", "CPU %core", "CPU %machine", "proxy %core", "calls/s")
COLUMNS += ("CPU ms/call",)
COLUMNS += ("RSS MB", "threads", "ramp s", "drain s")
MIN_SESSIONS, MAX_CPU_PCT = 512, 10.0
TARGET_NAME = ">= 512 concurrent sessions held with the server's own CPU under 10 %"
CALLS_METRIC = 'capture_proxy_requests_total{route="/v1/chat/completions",status="200"}'
NEVER_STOPS = 100_000  # the concurrency points' step limit: agents run until they are stopped


@dataclass
class Point:
    """One concurrency point while it runs: the sessions it opened and what went wrong."""

    sessions: int
    ids: list[str] = field(default_factory=list)  # opened (each closed before the point ends)
    started: int = 0  # rollouts the server accepted
    closed: set[str] = field(default_factory=set)
    alive: int = 0  # agent processes seen running at the last look
    alive_since: float = 0.0  # when ``alive`` last changed
    ended: int = 0  # rollouts already done while the ramp waits (their agents ended on their own)
    errors: list[str] = field(default_factory=list)
    drain_phases: list[dict[str, float]] = field(default_factory=list)  # each stopped rollout's phases
    limit: str = ""  # why not every session could be held, when one could not


# ---------------------------------------------------------------------------------------------- processes


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


# ---------------------------------------------------------------------------------------- raw and serial


def raw_runs(engine: Server, steps: int, repeats: int, cwd: Path) -> list[float]:
    """Seconds per direct agent run (start to exit), after one warm-up run."""
    python = shutil.which("python3") or sys.executable  # what the toy harness runs in a local sandbox
    argv = [python, str(AGENT), "--base-url", engine.url + "/v1", "--api-key", "raw", "--model", MODEL]
    argv += ["--steps", str(steps), (TASKS / SPLIT / TASK / "instruction.md").read_text()]
    seconds = []
    for run in range(repeats + 1):
        start = time.perf_counter()
        done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300)
        elapsed = time.perf_counter() - start
        tools = sum('"tool"' in line for line in done.stdout.splitlines())
        if done.returncode != 0 or tools != steps:
            raise RuntimeError(
                f"raw agent: exit {done.returncode}, {tools}/{steps} tool calls:\n{done.stdout}"
            )
        if run:
            seconds.append(elapsed)
    return seconds


def task_index(server: Server) -> int:
    with urllib.request.urlopen(f"{server.url}/splits/{SPLIT}/tasks", timeout=30) as reply:
        return next(task["index"] for task in orjson.loads(reply.read())["tasks"] if task["name"] == TASK)


def serial_rollouts(server: Server, steps: int, repeats: int) -> tuple[list[float], list[dict], list[str]]:
    """``repeats`` rollouts in a row after a warm-up: each one's seconds and phase seconds, and what went
    wrong with those that failed (left out of the medians; at most ``repeats`` of them are tried)."""
    factory = HarborSessionFactory(
        server.url, split=SPLIT, harness="toy", sandbox="local", sampling=SAMPLING,
        agent_timeout_sec=120, agent_step_limit=steps,
    )  # fmt: skip
    seconds: list[float] = []
    phases: list[dict[str, float]] = []
    failures: list[str] = []
    try:
        index, warm = task_index(server), True
        while len(seconds) < repeats and len(failures) <= repeats:
            elapsed, phase_seconds, problem = one_rollout(factory, index, steps)
            if problem:
                failures.append(problem)
            elif not warm:
                seconds.append(elapsed)
                phases.append(phase_seconds)
            warm = warm and bool(problem)
    finally:
        factory.close()
    if not seconds:
        raise RuntimeError(f"no rollout succeeded: {failures[:3]}")
    return seconds, phases, failures


def one_rollout(factory: HarborSessionFactory, index: int, steps: int) -> tuple[float, dict[str, float], str]:
    """One rollout, create to close: its seconds, its phase seconds, and what went wrong ('' if nothing)."""
    start = time.perf_counter()
    session = factory.create(index)
    try:
        session.wait_for_completion(timeout_s=120)
        turns = len(session.fetch_training_trace().turns)
        session.verify([])
    except (RolloutUnscorable, TimeoutError) as exc:  # a result of this rollout, not a benchmark failure
        return 0.0, {}, f"{type(exc).__name__}: {exc}"
    finally:
        session.close()
    elapsed, result = time.perf_counter() - start, session.result
    assert result is not None
    if result.model_calls != steps or turns != steps:
        tail = result.log_tail.strip().splitlines()[-1:]
        return elapsed, {}, f"{result.model_calls}/{steps} model calls, agent exit {result.exit_code}: {tail}"
    return elapsed, dict(result.phase_seconds), ""


def summarize_serial(raw: list[float], rollout: list[float], phases: list[dict[str, float]]) -> dict:
    """Medians, and the overhead (rollout − raw) broken into phases: the parts add up to the whole."""
    medians = {name: statistics.median(p.get(name, 0.0) for p in phases) for name in PHASES}
    raw_s, rollout_s = statistics.median(raw), statistics.median(rollout)
    parts = {}
    for name in PHASES:  # the agent phase's share of the overhead is what it took beyond the raw run
        parts["agent - raw" if name == "agent" else name] = medians[name] - (raw_s if name == "agent" else 0)
    parts["rest"] = rollout_s - raw_s - sum(parts.values())
    return {
        "raw": {"median_s": raw_s, "runs_s": raw},
        "rollout": {"median_s": rollout_s, "runs_s": rollout, "phase_medians_s": medians},
        "overhead_s": rollout_s - raw_s,
        "overhead_parts_s": parts,
    }


# -------------------------------------------------------------------------------------------- concurrency


async def start_one(
    client: aiohttp.ClientSession, server: Server, body: dict, point: Point, gate: asyncio.Semaphore
) -> None:
    """Open a session and start its rollout; a refusal is recorded in ``point.errors``, not raised."""
    async with gate:
        try:
            async with client.post(server.url + "/sessions") as reply:
                data = await reply.read()
            if reply.status != 201:
                raise RuntimeError(f"POST /sessions: HTTP {reply.status} {data[:300]!r}")
            session_id = orjson.loads(data)["session_id"]
            point.ids.append(session_id)
            async with client.post(f"{server.url}/sessions/{session_id}/rollout", json=body) as reply:
                data = await reply.read()
            if reply.status != 202:
                raise RuntimeError(f"POST /sessions/{session_id}/rollout: HTTP {reply.status} {data[:300]!r}")
            point.started += 1
        except (aiohttp.ClientError, RuntimeError) as exc:
            point.errors.append(f"start: {exc}")


def stalled(server: Server, config: dict[str, Any], deadline: float, point: Point, alive: int) -> str:
    """Why the ramp cannot go on ('' while it can)."""
    if server.process.poll() is not None:
        return f"the server exited (code {server.process.returncode}):\n{server.log_tail(1500)}"
    if (free := mem_available_mb()) < config["min_free_mb"]:
        return f"memory: MemAvailable {free:.0f} MB < {config['min_free_mb']} MB with {alive} agents running"
    if time.monotonic() > deadline:
        return f"start timeout: {alive} of {point.started} agents running after {config['ramp_timeout_s']} s"
    return ""


async def ramp(client: aiohttp.ClientSession, server: Server, config: dict[str, Any], point: Point) -> int:
    """Open and start ``point.sessions`` rollouts, at most ``start_window`` starting at once; returns the
    agents running once every started one runs or has ended, or when ``point.limit`` says why not."""
    body = {"split": SPLIT, "index": config["task_index"], "harness": "toy", "sandbox": "local"}
    body |= {"sampling": SAMPLING, "agent_step_limit": NEVER_STOPS, "agent_timeout_sec": 3600}
    gate, starting = asyncio.Semaphore(config["client_concurrency"]), []
    deadline = time.monotonic() + config["ramp_timeout_s"]
    for _ in range(point.sessions):
        while len(starting) - point.alive - point.ended >= config["start_window"] and not point.limit:
            await watch(client, server, config, deadline, point)
        if not point.limit and mem_available_mb() < config["min_free_mb"]:
            point.limit = stalled(server, config, deadline, point, point.alive)
        if point.limit:
            break
        starting.append(asyncio.create_task(start_one(client, server, body, point, gate)))
    await asyncio.gather(*starting)
    while point.alive + point.ended < point.started and not point.limit:
        await watch(client, server, config, deadline, point)
    return point.alive


async def watch(
    client: aiohttp.ClientSession, server: Server, config: dict[str, Any], deadline: float, point: Point
) -> None:
    """After a moment, update ``point.alive``; when it has not moved for 2 s, count the rollouts that
    already ended (an agent that crashed at start never shows up); set ``point.limit`` on a stall."""
    await asyncio.sleep(0.5)
    alive = await asyncio.to_thread(count_agents, server)
    if alive != point.alive:
        point.alive, point.alive_since = alive, time.monotonic()
    elif time.monotonic() - point.alive_since > 2:
        point.ended = sum(await asyncio.gather(*(ended(client, server, i) for i in list(point.ids))))
        point.alive_since = time.monotonic()
    point.limit = stalled(server, config, deadline, point, alive)


async def ended(client: aiohttp.ClientSession, server: Server, session_id: str) -> bool:
    try:
        async with client.get(f"{server.url}/sessions/{session_id}") as reply:
            return orjson.loads(await reply.read()).get("status") == "done"
    except (aiohttp.ClientError, ValueError):
        return False  # unknown: counted as still starting


async def proxy_calls(client: aiohttp.ClientSession, server: Server) -> float:
    """Model calls the server's capture proxy has answered with 200 (its ``/metrics`` counter)."""
    async with client.get(f"http://{server.proxy}/metrics") as reply:
        text = (await reply.read()).decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(CALLS_METRIC))


async def hold(client: aiohttp.ClientSession, server: Server, seconds: float) -> dict[str, Any]:
    """Sample the server while every session is held: CPU, model calls, RSS, threads, agents alive."""
    pid, proxy, alive, open_sessions, rss = server.process.pid, proxy_pid(server), [], [], []
    calls, cpu, start = await proxy_calls(client, server), cpu_seconds(pid), time.perf_counter()
    proxy_cpu = tree_cpu_seconds(proxy) if proxy is not None else 0.0
    while True:
        alive.append(await asyncio.to_thread(count_agents, server))
        async with client.get(server.url + "/health") as reply:
            open_sessions.append(orjson.loads(await reply.read())["sessions"])
        rss.append(status_value(pid, "VmRSS") / 1024)
        if (left := start + seconds - time.perf_counter()) <= 0:
            break
        await asyncio.sleep(min(1.0, left))
    cpu, calls = cpu_seconds(pid) - cpu, await proxy_calls(client, server) - calls
    proxy_cpu = tree_cpu_seconds(proxy) - proxy_cpu if proxy is not None else 0.0
    window = time.perf_counter() - start
    return {
        "window_s": window, "held": min(min(alive), min(open_sessions)), "agents_alive": alive,
        "open_sessions": open_sessions, "cpu_s": cpu, "cpu_pct_core": 100 * cpu / window,
        "cpu_pct_machine": 100 * cpu / window / CPUS, "calls_per_s": calls / window,
        "proxy_process": proxy is not None, "proxy_cpu_pct_core": 100 * proxy_cpu / window,
        "cpu_ms_per_call": 1000 * (cpu + proxy_cpu) / calls if calls else None, "rss_mb": max(rss),
        "threads": status_value(pid, "Threads"),
    }  # fmt: skip


async def finish_one(client: aiohttp.ClientSession, server: Server, session_id: str, point: Point) -> None:
    """Stop one rollout, wait for it, fetch its trace, close it; a failure is recorded, not raised."""
    url = f"{server.url}/sessions/{session_id}"
    try:
        async with client.post(url + "/stop") as reply:
            await reply.read()
        body: dict[str, Any] = {"status": "running"}
        while body["status"] != "done":
            async with client.get(url, params={"wait": "30"}) as reply:
                body = orjson.loads(await reply.read())
        point.drain_phases.append(body["result"]["phase_seconds"])
        if error := body["result"].get("error"):
            raise RuntimeError(f"rollout error: {error}")
        if not body["result"]["timed_out"]:  # the engine never lets an agent finish: it crashed
            code, lines = body["result"]["exit_code"], body["result"]["log_tail"].strip().splitlines()
            raise RuntimeError(f"the agent ended before it was stopped (exit {code}): {lines[-1:]}")
        async with client.get(url + "/trace") as reply:
            trace = await reply.read()
        if reply.status != 200:
            raise RuntimeError(f"GET trace: HTTP {reply.status} {trace[:300]!r}")
    except (aiohttp.ClientError, RuntimeError, KeyError, ValueError) as exc:
        point.errors.append(f"{session_id}: {exc}")
    finally:
        await close_session(client, url, point, session_id)


async def close_session(client: aiohttp.ClientSession, url: str, point: Point, session_id: str) -> None:
    with contextlib.suppress(aiohttp.ClientError):  # gone already (or the server is): nothing to close
        async with client.delete(url) as reply:
            await reply.read()
    point.closed.add(session_id)


async def run_point(server: Server, config: dict[str, Any], sessions: int) -> dict[str, Any]:
    """Ramp up, hold, drain; every session closed on every path."""
    point, pid = Point(sessions), server.process.pid
    marks = [(time.perf_counter(), cpu_seconds(pid))]  # at the start, the ramp's end, the hold's, the drain's
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=120)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as client:
        try:
            alive = await ramp(client, server, config, point)
            marks.append((time.perf_counter(), cpu_seconds(pid)))
            window = await hold(client, server, config["hold"])
            marks.append((time.perf_counter(), cpu_seconds(pid)))
            finishing = (finish_one(client, server, session_id, point) for session_id in list(point.ids))
            await asyncio.wait_for(asyncio.gather(*finishing), config["drain_timeout_s"])
            marks.append((time.perf_counter(), cpu_seconds(pid)))
            after = await asyncio.to_thread(count_agents, server)
        finally:
            unclosed = [i for i in point.ids if i not in point.closed]
            urls = [f"{server.url}/sessions/{session_id}" for session_id in unclosed]
            await asyncio.gather(
                *(close_session(client, u, point, i) for u, i in zip(urls, unclosed, strict=True))
            )
    return summarize_point(point, window, marks, alive, after)


def summarize_point(
    point: Point, window: dict[str, Any], marks: list[tuple[float, float]], alive: int, after: int
) -> dict[str, Any]:
    """The point's measures; ``marks``: (seconds, server CPU seconds) at its start and each stage's end."""
    (start, cpu0), (ramped, cpu1), (held, cpu2), (drained, cpu3) = marks
    result: dict[str, Any] = {"sessions": point.sessions, "opened": len(point.ids), "started": point.started}
    result |= {"agents_at_ramp_end": alive, "agents_after": after, "wall_s": drained - start}
    result |= {"ramp_s": ramped - start, "drain_s": drained - held}
    result["ramp_cpu_ms_per_session"] = 1000 * (cpu1 - cpu0) / max(point.started, 1)
    result["drain_cpu_ms_per_session"] = 1000 * (cpu3 - cpu2) / max(len(point.ids), 1)
    result |= window | {"failed": len(point.errors), "errors": point.errors[:20], "limit": point.limit}
    result["drain_phases_s"] = {  # where a stopped rollout's time goes: median and largest
        name: [f(p.get(name, 0.0) for p in point.drain_phases) for f in (statistics.median, max)]
        for name in ("upload", "verifier", "trace", "cleanup")
        if point.drain_phases
    }
    result["ok"] = window["held"] == point.sessions and not point.errors and not point.limit and after == 0
    return result


# ------------------------------------------------------------------------------------------------ report


def verdict(points: list[dict[str, Any]]) -> dict[str, Any]:
    """PASS when a point of >= 512 sessions held them all, none failed, under the CPU limit."""
    ok = [p for p in points if p["ok"]]
    passing = [p for p in ok if p["sessions"] >= MIN_SESSIONS and p["cpu_pct_core"] < MAX_CPU_PCT]
    big = [p for p in points if p["sessions"] >= MIN_SESSIONS]
    shown = (passing or big or ok or points or [None])[-1]
    if shown is None:
        return {"target": TARGET_NAME, "pass": False, "measured": "no concurrency point ran"}
    measured = (
        f"{shown['held']}/{shown['sessions']} held, {shown['failed']} failed, server CPU "
        f"{shown['cpu_pct_core']:.1f} % of one core ({shown['cpu_pct_machine']:.1f} % of {CPUS} cores) at "
        f"{shown['calls_per_s']:.0f} model calls/s, RSS {shown['rss_mb']:.0f} MB"
    )
    if shown["proxy_process"]:
        measured += (
            f"; its capture proxy process {shown['proxy_cpu_pct_core']:.1f} % of one core "
            f"({shown['cpu_ms_per_call']:.2f} ms per model call, server and proxy together)"
        )
    if shown["limit"]:
        measured += f"; limit: {shown['limit'].splitlines()[0]}"
    if not big:
        largest = max((p["sessions"] for p in ok), default=0)
        measured = f"no point of {MIN_SESSIONS} sessions ran (largest fully held: {largest}); {measured}"
    return {"target": TARGET_NAME, "pass": bool(passing), "measured": measured}


def table_rows(result: dict[str, Any]) -> list[tuple[str, ...]]:
    steps, blank = result["config"]["steps"], ("-",) * (len(COLUMNS) - 2)
    rows = [COLUMNS, (f"raw agent ({steps} calls)", f"{result['raw']['median_s']:.3f}", *blank)]
    rows.append((f"rollout ({steps} calls)", f"{result['rollout']['median_s']:.3f}", *blank))
    rows.append(("overhead (rollout - raw)", f"{result['overhead_s']:.3f}", *blank))
    rows += [(f"  {name}", f"{value:.3f}", *blank) for name, value in result["overhead_parts_s"].items()]
    for p in result["points"]:
        per_call = "-" if p["cpu_ms_per_call"] is None else f"{p['cpu_ms_per_call']:.2f}"
        cells = (f"{p['wall_s']:.1f}", f"{p['held']}/{p['sessions']}", str(p["failed"]))
        cells += (
            f"{p['cpu_pct_core']:.1f}",
            f"{p['cpu_pct_machine']:.1f}",
            f"{p['proxy_cpu_pct_core']:.1f}" if p["proxy_process"] else "in server",
            f"{p['calls_per_s']:.0f}",
            per_call,
        )
        cells += (f"{p['rss_mb']:.0f}", str(p["threads"]), f"{p['ramp_s']:.1f}", f"{p['drain_s']:.1f}")
        rows.append((f"{p['sessions']} sessions", *cells))
    return rows


def print_report(result: dict[str, Any]) -> None:
    c = result["config"]
    print(
        f"\nseconds: median of {c['repeats']} runs (raw agent, rollout, overhead parts) or the point's wall "
        f"time (K sessions: ramp + {c['hold']} s hold + drain); K sessions on an engine holding each reply "
        f"{c['delay']} s; CPU, RSS and threads of the server process (and the CPU of its proxy process) "
        f"over the hold window; {CPUS} cores"
    )
    rows = table_rows(result)
    print_table(rows)
    for failure in result["serial_failures"]:
        print(f"failed serial rollout (left out of the medians): {failure}")
    for p in result["points"]:
        phases = ", ".join(f"{name} {median:.2f} s" for name, (median, _) in p["drain_phases_s"].items())
        print(
            f"{p['sessions']} sessions: server CPU {p['ramp_cpu_ms_per_session']:.1f} ms per session "
            f"started, {p['drain_cpu_ms_per_session']:.1f} ms per session stopped and closed; stopped"
            f" rollouts' medians: {phases or '-'}"
        )
        if p["limit"] or p["errors"]:
            errors = [error.split(": ", 1)[-1] for error in p["errors"]]
            print(f"  limit: {p['limit'] or '-'}; {len(errors)} failed: {sorted(set(errors))[:3]}")
    for line in result["leftover_processes"]:
        print(f"LEFTOVER PROCESS: {line}")
    v = result["verdict"]
    print(f"target:\n  {'PASS' if v['pass'] else 'MISS'}  {v['target']}  {v['measured']}")
    print(f"elapsed: {result['elapsed_s']:.0f} s")


# -------------------------------------------------------------------------------------------------- main

FULL = {"sessions": "64,128,256,512", "steps": 4, "repeats": 10, "delay": 2.0, "hold": 10.0}
QUICK = {"sessions": "8", "steps": 2, "repeats": 2, "delay": 0.5, "hold": 2.0}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--quick", action="store_true", help=f"tiny configuration: {QUICK}")
    add("--sessions", default=None, help=f"concurrency points, comma-separated (default {FULL['sessions']})")
    add("--steps", type=positive, default=None, help="model calls per raw agent and serial rollout (4)")
    add("--repeats", type=positive, default=None, help="raw agent runs and serial rollouts (10)")
    add("--delay", type=float, default=None, help="seconds the engine holds each reply at the points (2)")
    add("--hold", type=float, default=None, help="seconds of the hold window (10)")
    add("--start-window", type=positive, default=64, help="sessions starting at once, at most (64)")
    add("--client-concurrency", type=positive, default=16, help="client requests opening sessions (16)")
    add("--min-free-mb", type=int, default=2048, help="start no session below this MemAvailable (2048)")
    add("--json", type=Path, default=None, help="also write the results to this JSON file")
    add("--strict", action="store_true", help="exit 1 when the target is missed")
    return parser


def resolve(args: argparse.Namespace) -> dict[str, Any]:
    """The configuration: ``--quick`` or the full defaults, with every flag given on top."""
    config: dict[str, Any] = dict(QUICK if args.quick else FULL)
    config |= {key: value for key in config if (value := getattr(args, key)) is not None}
    config["sessions"] = [positive(part) for part in str(config["sessions"]).split(",")]
    config |= {"start_window": args.start_window, "client_concurrency": args.client_concurrency}
    config |= {"min_free_mb": args.min_free_mb, "quick": args.quick}
    return config


def serial_stage(stack: contextlib.ExitStack, tmp: Path, config: dict[str, Any], result: dict) -> None:
    """Raw agent runs and serial rollouts against the instant engine."""
    engine = start_engine(stack, 0.0)
    raw = raw_runs(engine, config["steps"], config["repeats"], tmp)
    server = start_rollout_server(stack, tmp, "serial", engine.url, 4)
    result["pids"] += [engine.process.pid, server.process.pid]
    rollout, phases, failures = serial_rollouts(server, config["steps"], config["repeats"])
    stop_process(server.process, 60.0)
    stop_process(engine.process)
    result["leftover_processes"] += leftovers([*server.tags, *engine.tags], tmp / "serial")
    result |= summarize_serial(raw, rollout, phases) | {"serial_failures": failures}
    print(
        f"raw agent {result['raw']['median_s']:.3f} s, rollout {result['rollout']['median_s']:.3f} s",
        flush=True,
    )


def concurrency_stage(stack: contextlib.ExitStack, tmp: Path, config: dict[str, Any], result: dict) -> None:
    """One fresh server per point, on the slow engine; stops after a point that could not hold them all."""
    engine = start_engine(stack, config["delay"])
    result["pids"].append(engine.process.pid)
    for sessions in config["sessions"]:
        config["ramp_timeout_s"] = 60 + 0.5 * sessions
        config["drain_timeout_s"] = 120 + 0.5 * sessions
        server = start_rollout_server(stack, tmp, f"k{sessions}", engine.url, sessions + 2)
        result["pids"].append(server.process.pid)
        config["task_index"] = task_index(server)
        point = asyncio.run(run_point(server, config, sessions))
        stop_process(server.process, 60.0)
        point["leftover_processes"] = leftovers(server.tags, tmp / f"k{sessions}")
        result["leftover_processes"] += point["leftover_processes"]
        result["points"].append(point)
        print(progress(point), flush=True)
        if point["limit"]:  # out of a resource (or the server died): more sessions would not do better
            break
    stop_process(engine.process)
    result["leftover_processes"] += leftovers(engine.tags, tmp)


def progress(point: dict[str, Any]) -> str:
    line = f"{point['sessions']} sessions: held {point['held']}, failed {point['failed']}, server CPU "
    line += f"{point['cpu_pct_core']:.1f} % of a core, {point['calls_per_s']:.0f} calls/s, "
    line += f"ramp {point['ramp_s']:.1f} s, drain {point['drain_s']:.1f} s"
    return line + (f"; limit: {point['limit'].splitlines()[0]}" if point["limit"] else "")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print the table and verdict; 0, or 1 on leftovers or a MISS under ``--strict``."""
    args = build_parser().parse_args(argv)
    config = resolve(args)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops the servers too
    result: dict[str, Any] = {
        "config": config,
        "cpus": CPUS,
        "pids": [],
        "points": [],
        "leftover_processes": [],
    }
    started = time.perf_counter()
    try:
        with contextlib.ExitStack() as stack:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rollout-bench-")))
            serial_stage(stack, tmp, config, result)
            concurrency_stage(stack, tmp, config, result)
    except KeyboardInterrupt:
        print("interrupted: every server stopped, every session closed", file=sys.stderr)
        return 130
    result["elapsed_s"] = time.perf_counter() - started
    result["verdict"] = verdict(result["points"])
    result["all_pass"] = result["verdict"]["pass"]
    return finish(result, args, print_report)


if __name__ == "__main__":
    sys.exit(main())
