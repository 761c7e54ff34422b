"""The rollout benchmark's concurrency points: K sessions ramped up over the server's HTTP API, held while
the server (and its proxy) is sampled, then stopped and closed (see :mod:`benchmarks.rollouts`)."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from benchmarks.common import Server, cpu_seconds, status_value, tree_cpu_seconds
from benchmarks.rollouts_rig import (
    CALLS_METRIC,
    CPUS,
    SAMPLING,
    SPLIT,
    count_agents,
    mem_available_mb,
    proxy_pid,
)

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
