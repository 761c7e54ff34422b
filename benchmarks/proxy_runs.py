"""The proxy benchmark's servers and runs: the engine, the pass-through and the proxy started healthy, one
timed run of a point against a target (its sessions minted before and deleted after), and the memory and
trace-export measurement on a fresh proxy (see :mod:`benchmarks.proxy`). Shared with
:mod:`benchmarks.replicas`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from benchmarks.common import Server, free_port, start_server, status_value, stop_process, tree_cpu_seconds
from benchmarks.proxy_agents import SAMPLING, Point, Target, converse

HERE = Path(__file__).resolve().parent


@dataclass
class RunResult:
    """One timed run: every call's latency, the run's seconds and the target server's CPU seconds."""

    latencies: list[float] = field(default_factory=list)
    seconds: float = 0.0
    cpu_s: float = 0.0


# ---------------------------------------------------------------------------------------------- processes


async def wait_healthy(server: Server, timeout: float = 60.0) -> None:
    """Wait until ``server`` answers ``/health`` with 200; RuntimeError with its output if it does not."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as client:
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                break
            with contextlib.suppress(aiohttp.ClientError):
                async with client.get(server.url + "/health") as reply:
                    if reply.status == 200:
                        return
            await asyncio.sleep(0.1)
    detail = "exited" if server.process.poll() is not None else f"not healthy after {timeout:.0f}s"
    raise RuntimeError(f"{server.name} {detail}; its output:\n{server.log_tail()}")


async def start_proxy(stack: contextlib.ExitStack, engine_url: str) -> tuple[Server, str]:
    """A proxy on a fresh data directory; returns it and its admin key."""
    data_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="proxy-bench-"))
    port, key = free_port(), secrets.token_hex(16)
    command = [sys.executable, "-m", "capture_proxy", "--upstream", engine_url, "--host", "127.0.0.1"]
    command += ["--port", str(port), "--data-dir", data_dir, "--admin-key", key]
    proxy = start_server(stack, "proxy", command, port)
    await wait_healthy(proxy)
    return proxy, key


async def start_targets(stack: contextlib.ExitStack) -> tuple[dict[str, Target], Server]:
    """The engine, the pass-through and the proxy, healthy; the targets, and the engine's server."""
    fake = [sys.executable, str(HERE / "fake_vllm.py")]
    port = free_port()
    engine = start_server(stack, "engine", [*fake, "engine", "--port", str(port)], port)
    await wait_healthy(engine)
    port = free_port()
    passthrough_command = [*fake, "passthrough", "--port", str(port), "--upstream", engine.url]
    passthrough = start_server(stack, "passthrough", passthrough_command, port)
    await wait_healthy(passthrough)
    proxy, key = await start_proxy(stack, engine.url)
    chat = "/v1/chat/completions"
    targets = {
        "direct": Target("direct", engine.url + chat, None),
        "passthrough": Target("passthrough", passthrough.url + chat, passthrough),
        "proxy": Target("proxy", proxy.url + chat, proxy, (proxy.url, key)),
    }
    return targets, engine


def memory_mb(pid: int, key: str) -> float:
    """``VmRSS``/``VmHWM`` of ``pid`` in MB."""
    return status_value(pid, key) / 1024


# -------------------------------------------------------------------------------------------------- runs


def admin_headers(target: Target) -> dict[str, str]:
    """The proxy's admin authorization header."""
    assert target.admin is not None
    return {"Authorization": f"Bearer {target.admin[1]}"}


async def mint_sessions(client: aiohttp.ClientSession, target: Target, count: int, turns: int) -> list[str]:
    """Open ``count`` proxy sessions of ``turns`` model calls each; their ids."""
    assert target.admin is not None
    body = {"sampling": SAMPLING, "max_model_calls": turns}

    async def mint() -> str:
        async with client.post(target.admin[0] + "/sessions", json=body, headers=admin_headers(target)) as r:
            if r.status != 201:
                raise RuntimeError(f"POST /sessions: HTTP {r.status}: {(await r.read())[:500]!r}")
            return (await r.json())["session_id"]

    return list(await asyncio.gather(*(mint() for _ in range(count))))


async def delete_sessions(client: aiohttp.ClientSession, target: Target, session_ids: list[str]) -> None:
    """Delete the proxy sessions ``session_ids``, all at once."""
    assert target.admin is not None

    async def delete(session_id: str) -> None:
        url = f"{target.admin[0]}/sessions/{session_id}"
        async with client.delete(url, headers=admin_headers(target)) as reply:
            if reply.status >= 300:
                raise RuntimeError(f"DELETE /sessions/{session_id}: HTTP {reply.status}")

    await asyncio.gather(*(delete(session_id) for session_id in session_ids))


async def drive(target: Target, point: Point, turns: int, keys: Sequence[str | None]) -> RunResult:
    """``point.agents`` agents work through ``point.conversations`` conversations; the timed part."""
    result = RunResult()
    queue = list(range(point.conversations))[::-1]

    async def agent(client: aiohttp.ClientSession) -> None:
        while queue:
            conversation = queue.pop()
            result.latencies += await converse(client, target, conversation, point, turns, keys[conversation])

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as client:
        pid = target.server.process.pid if target.server else None
        cpu_before = tree_cpu_seconds(pid) if pid else 0.0
        start = time.perf_counter()
        await asyncio.gather(*(agent(client) for _ in range(point.agents)))
        result.seconds = time.perf_counter() - start
        result.cpu_s = tree_cpu_seconds(pid) - cpu_before if pid else 0.0
    return result


async def run_point(target: Target, point: Point, turns: int) -> dict[str, Any]:
    """One run of ``point`` against ``target``, sessions minted before and deleted after (proxy)."""
    keys: list[str | None] = [None] * point.conversations
    async with aiohttp.ClientSession() as admin:
        if target.admin is not None:
            keys = list(await mint_sessions(admin, target, point.conversations, turns))
        result = await drive(target, point, turns, keys)
        if target.admin is not None:
            await delete_sessions(admin, target, [key for key in keys if key])
    latencies = sorted(result.latencies)
    calls = len(latencies)
    sample: dict[str, Any] = {"calls": calls, "seconds": result.seconds, "rps": calls / result.seconds}
    sample |= {"p50_ms": 1000 * percentile(latencies, 50), "p99_ms": 1000 * percentile(latencies, 99)}
    if target.server is not None:
        sample["cpu_ms_per_request"] = 1000 * result.cpu_s / calls
        sample["peak_rss_mb"] = memory_mb(target.server.process.pid, "VmHWM")
    return sample


def percentile(ordered: list[float], q: float) -> float:
    """The ``q``-th percentile of sorted values, linear between closest ranks."""
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


async def export_traces(
    client: aiohttp.ClientSession, target: Target, keys: list[str]
) -> tuple[list[float], bytes]:
    """``GET /sessions/{id}/trace`` for each session in turn: the seconds each took, and the first trace."""
    assert target.admin is not None
    seconds, first = [], b""
    for key in keys:
        start = time.perf_counter()
        async with client.get(f"{target.admin[0]}/sessions/{key}/trace", headers=admin_headers(target)) as r:
            body = await r.read()
        seconds.append(time.perf_counter() - start)
        if r.status != 200:
            raise RuntimeError(f"GET /sessions/{key}/trace: HTTP {r.status}: {body[:500]!r}")
        first = first or body
    return seconds, first


def trace_chains(trace: dict[str, Any]) -> bool:
    """Whether each turn's prompt extends the previous turn's prompt + completion (one unbroken path)."""
    turns = trace["turns"]
    for previous, turn in itertools.pairwise(turns):
        context = previous["prompt_token_ids"] + previous["completion_token_ids"]
        if turn["prompt_token_ids"][: len(context)] != context:
            return False
    return True


async def measure_memory(stack: contextlib.ExitStack, engine_url: str, sessions: int, turns: int) -> dict:
    """RSS per finished session and trace export time, on a fresh proxy (see :mod:`benchmarks.proxy`)."""
    proxy, key = await start_proxy(stack, engine_url)
    target = Target("proxy", proxy.url + "/v1/chat/completions", proxy, (proxy.url, key))
    pid = proxy.process.pid
    async with aiohttp.ClientSession() as admin:
        warm_keys = await mint_sessions(admin, target, 2, turns)  # warm-up: imports, caches, first journal
        await drive(target, Point("warm-up", 2, 2, False), turns, list(warm_keys))
        before = memory_mb(pid, "VmRSS")
        keys = await mint_sessions(admin, target, sessions, turns)
        await drive(target, Point("memory", min(16, sessions), sessions, False), turns, list(keys))
        finished = memory_mb(pid, "VmRSS")
        export_s, trace = await export_traces(admin, target, keys)
        exported = memory_mb(pid, "VmRSS")
        await delete_sessions(admin, target, keys + warm_keys)
        deleted = memory_mb(pid, "VmRSS")
    stop_process(proxy.process)
    parsed = orjson.loads(trace)
    result: dict[str, Any] = {"sessions": sessions, "turns": turns, "pid": pid}
    result |= {"rss_before_mb": before, "rss_finished_mb": finished, "rss_exported_mb": exported}
    result |= {"rss_deleted_mb": deleted, "per_session_mb": (finished - before) / sessions}
    result["trace_export_ms"] = {"median": 1000 * statistics.median(export_s), "max": 1000 * max(export_s)}
    result |= {
        "trace_bytes": len(trace),
        "trace_turns": len(parsed["turns"]),
        "trace_chains": trace_chains(parsed),
    }
    return result
