"""What the capture proxy costs an agent's call, against the engine called directly and a thin pass-through.

Set-up (all real processes on loopback, free ports, stopped on every path, Ctrl-C and SIGTERM included):

- **engine**: ``benchmarks/fake_vllm.py engine``, a fake vLLM that answers at once with vLLM 0.32's reply
  shape (200 completion ids with per-token logprobs, a ``bash`` tool call, ``prompt_token_ids`` of an
  append-only template: each turn's prompt extends the last turn's prompt + completion);
- **pass-through**: ``benchmarks/fake_vllm.py passthrough``, aiohttp forwarding bytes both ways over one
  keep-alive pool: the practical floor for an aiohttp hop;
- **proxy**: ``python -m capture_proxy`` with a fresh ``--data-dir`` in a temporary directory.

Workload: agents hold 20-turn conversations (``--turns``): an 8,000-character system prompt, two tool
schemas, a task; each turn appends the reply's tool call and a ~400-character tool result, so prompts
grow from ~2.3k to ~8k ids. Points: 1, 16 and 64 concurrent agents back to back (closed loop; a point
runs twice as many conversations as agents and at least ``--min-conversations``, so 1 agent holds 48 in a
row and 64 agents start a new one as each ends: a run lasts about a second, not a tenth of one, and each
agent's conversations are not all in lockstep), each with JSON and SSE replies, plus a **paced** point:
64 agents, SSE (what opencode, claude-code and codex ask for), a seeded pause of 0.25-0.75 s between
turns and a seeded 0-0.5 s start, so turns do not arrive in lockstep.

Targets: **direct** (the engine), **pass-through**, **proxy**. Direct and pass-through always get the
request the proxy sends upstream (non-streaming, with the capture fields and the sampling policy); a
point's SSE mode only changes what the agent asks of the proxy, so a proxy SSE row's added latency
includes the SSE replay. Each conversation is one proxy session (minted before the timed run, deleted
after it). The load comes from this process (asyncio + aiohttp, one client session per run) on the same
machine: on a small machine it competes with the servers for CPU, equally for every target.

Measured per target and point, one run per repeat (``--repeats``, default 5; targets in rotating order so
they share the machine's noise), reported as the median over repeats:

- req/s: calls / wall time of the run; ``vs pass``: the same-repeat ratio to the pass-through's req/s;
- p50/p99 latency: request sent to last byte received (the client's parsing excluded);
- ``+p50``/``+p99``: the same-repeat difference to the direct target's p50/p99: the latency added;
- CPU ms/req: ``utime + stime`` of the server process and the processes below it (``/proc/<pid>/stat``,
  all threads, 10 ms ticks: the proxy's fdatasync helper counts as the proxy) over the run, divided by its
  calls; peak RSS: the process's ``VmHWM`` after the run (so cumulative).

Then, on a second, fresh proxy (after a 2-session warm-up): ``VmRSS`` growth while ``--memory-sessions``
sessions run all their turns and are kept (as while they wait for their trace to be fetched), divided by
the sessions; then ``GET /sessions/{id}/trace`` for each, one at a time, timed to the last byte (median),
and one trace checked to chain (each prompt extends the last turn's prompt + completion). The RSS after
the exports and after deleting the sessions is printed too, not divided: exports are transient (one
session exported 64 times raises it as much as 64 sessions once), so that growth is allocator high water,
not memory a session holds.

Output: one table, then PASS/MISS per target; a MISS does not fail the run (exit 0) unless ``--strict``.
Run: ``python benchmarks/proxy.py [--quick] [--repeats 5] [--json OUT] [--strict]``; ``--quick`` is the tiny
configuration the test uses (1 and 4 agents, 4 turns, 1 repeat).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import random
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

if not __package__:  # run as a script (python benchmarks/proxy.py): its siblings import from the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    Server,
    finish,
    free_port,
    positive,
    print_table,
    print_verdicts,
    run_with_servers,
    start_server,
    status_value,
    stop_process,
    tree_cpu_seconds,
)

HERE = Path(__file__).resolve().parent
TARGETS = ("direct", "passthrough", "proxy")
COLUMNS = ("point", "target", "req/s", "vs pass", "p50 ms", "p99 ms", "+p50 ms", "+p99 ms", "CPU ms/req")
COLUMNS += ("peak RSS MB",)
CAPTURE = {"logprobs": True, "top_logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True}
SAMPLING = {"temperature": 1.0}
MODEL = "fake-vllm"
PAUSE_S = (0.25, 0.75)
STAGGER_S = 0.5
# Targets (the issue's), and how the report names them, in this order.
MIN_THROUGHPUT_RATIO = 0.70
MAX_CPU_MS = 2.0
MAX_PACED_ADDED_MS = (2.0, 15.0)
MAX_SESSION_MB = 0.5
MAX_TRACE_EXPORT_MS = 50.0
TARGET_NAMES = (
    "throughput >= 70% of pass-through at every concurrency",
    "proxy CPU <= 2 ms per request",
    "paced added latency p50 <= 2 ms and p99 <= 15 ms",
    "finished session < 0.5 MB resident",
    "trace export <= 50 ms",
)

_RULES = (
    "Read the relevant files before you change them, and keep every change as small as the task allows. ",
    "Run the project's tests after each change; a change that breaks a test is not finished. ",
    "Prefer the standard library and the project's existing helpers to new dependencies. ",
    "When a command fails, read its whole output before trying something else. ",
    "Never delete files you did not create, and never rewrite the history of the repository. ",
    "Explain what you did in one short paragraph when the task is complete. ",
)
SYSTEM_PROMPT = "".join(f"Rule {i + 1}. {_RULES[i % len(_RULES)]}" for i in range(200))[:8000]


def tool(name: str, description: str, **parameters: str) -> dict[str, Any]:
    """An OpenAI function tool whose parameters are all required strings (``name=description``)."""
    properties = {key: {"type": "string", "description": text} for key, text in parameters.items()}
    schema = {"type": "object", "properties": properties, "required": list(parameters)}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


TOOLS = [
    tool(
        "bash",
        "Run a bash command in the repository and return its output (stdout and stderr, truncated to 10,000 "
        "characters) and its exit code. Commands time out after 120 seconds.",
        command="The command line to run.",
    ),
    tool(
        "edit_file",
        "Replace one exact occurrence of old_text with new_text in a file; fails when old_text occurs zero "
        "times or more than once. Creates the file when old_text is empty.",
        path="Path relative to the repository root.",
        old_text="The text to replace, exactly.",
        new_text="The replacement.",
    ),
]


@dataclass(frozen=True)
class Point:
    name: str
    agents: int
    conversations: int
    stream: bool
    paced: bool = False


@dataclass
class Target:
    name: str
    url: str  # the chat completions endpoint
    server: Server | None  # the process whose CPU and memory are measured (none for direct)
    admin: tuple[str, str] | None = None  # proxy: (base URL, admin key)


@dataclass
class RunResult:
    latencies: list[float] = field(default_factory=list)
    seconds: float = 0.0
    cpu_s: float = 0.0


# ---------------------------------------------------------------------------------------------- processes


async def wait_healthy(server: Server, timeout: float = 60.0) -> None:
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


# ----------------------------------------------------------------------------------------------- agents


def opening(conversation: int) -> list[dict[str, Any]]:
    task = f"Task {conversation}: the test suite of project-{conversation} fails in tests/test_parser.py "
    task += "with a KeyError on nested sections. Find the cause, fix it, and show that the tests pass."
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task}]


def tool_result(conversation: int, turn: int) -> str:
    lines = [
        f"src/pkg_{conversation}/module_{turn}_{i}.py:{17 * i + turn}:    return parse_section("
        for i in range(9)
    ]
    return "\n".join(lines)[:400]


def parse_reply(body: bytes, stream: bool) -> dict[str, Any]:
    """The assistant message an agent keeps: from a chat completion, or accumulated from SSE deltas."""
    if not stream:
        message = orjson.loads(body)["choices"][0]["message"]
        return {"role": "assistant", "content": message.get("content"), "tool_calls": message["tool_calls"]}
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for line in body.split(b"\n"):
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        for choice in orjson.loads(line[6:]).get("choices") or []:
            delta = choice.get("delta") or {}
            content.append(delta.get("content") or "")
            for part in delta.get("tool_calls") or []:
                call = calls.setdefault(part["index"], {"type": "function", "function": {"arguments": ""}})
                call["id"] = part.get("id") or call.get("id")
                function = part.get("function") or {}
                call["function"]["name"] = function.get("name") or call["function"].get("name")
                call["function"]["arguments"] += function.get("arguments") or ""
    tool_calls = [calls[index] for index in sorted(calls)]
    return {"role": "assistant", "content": "".join(content) or None, "tool_calls": tool_calls}


async def converse(
    client: aiohttp.ClientSession,
    target: Target,
    conversation: int,
    point: Point,
    turns: int,
    key: str | None,
) -> list[float]:
    """Hold one conversation; return each call's latency in seconds (pauses, when paced, not included)."""
    messages = opening(conversation)
    headers = {"Content-Type": "application/json"}
    extra: dict[str, Any] = {**CAPTURE, **SAMPLING}
    if target.admin is not None:
        headers["Authorization"] = f"Bearer {key}"
        extra = {"stream": True, "stream_options": {"include_usage": True}} if point.stream else {}
    stream = point.stream and target.admin is not None
    delays = pacing(conversation, turns) if point.paced else [0.0] * turns
    latencies = []
    for turn in range(turns):
        if delays[turn]:
            await asyncio.sleep(delays[turn])
        data = orjson.dumps({"model": MODEL, "messages": messages, "tools": TOOLS, **extra})
        start = time.perf_counter()
        async with client.post(target.url, data=data, headers=headers) as reply:
            body = await reply.read()
        latencies.append(time.perf_counter() - start)
        if reply.status != 200:
            raise RuntimeError(f"{target.name}: HTTP {reply.status} on turn {turn}: {body[:500]!r}")
        message = parse_reply(body, stream)
        result = {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"]}
        messages += [message, result | {"content": tool_result(conversation, turn)}]
    return latencies


def pacing(conversation: int, turns: int) -> list[float]:
    """Seconds to wait before each turn: a start offset, then a think pause; the same for every target."""
    rng = random.Random(f"paced:{conversation}")
    return [rng.uniform(0, STAGGER_S)] + [rng.uniform(*PAUSE_S) for _ in range(turns - 1)]


# -------------------------------------------------------------------------------------------------- runs


def admin_headers(target: Target) -> dict[str, str]:
    assert target.admin is not None
    return {"Authorization": f"Bearer {target.admin[1]}"}


async def mint_sessions(client: aiohttp.ClientSession, target: Target, count: int, turns: int) -> list[str]:
    assert target.admin is not None
    body = {"sampling": SAMPLING, "max_model_calls": turns}

    async def mint() -> str:
        async with client.post(target.admin[0] + "/sessions", json=body, headers=admin_headers(target)) as r:
            if r.status != 201:
                raise RuntimeError(f"POST /sessions: HTTP {r.status}: {(await r.read())[:500]!r}")
            return (await r.json())["session_id"]

    return list(await asyncio.gather(*(mint() for _ in range(count))))


async def delete_sessions(client: aiohttp.ClientSession, target: Target, session_ids: list[str]) -> None:
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
    """RSS per finished session and trace export time, on a fresh proxy (see the module docstring)."""
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


# ------------------------------------------------------------------------------------------------ report


def relate(run: dict[str, dict[str, Any]]) -> None:
    """Add each target's same-repeat comparison to the direct target and to the pass-through."""
    for sample in run.values():
        sample["added_p50_ms"] = sample["p50_ms"] - run["direct"]["p50_ms"]
        sample["added_p99_ms"] = sample["p99_ms"] - run["direct"]["p99_ms"]
        sample["vs_passthrough"] = sample["rps"] / run["passthrough"]["rps"]


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over repeats of every measure (peak RSS: the largest), with the repeats kept."""
    summary: dict[str, Any] = {}
    for key in samples[0]:
        values = [sample[key] for sample in samples]
        summary[key] = max(values) if key == "peak_rss_mb" else statistics.median(values)
    return summary | {"repeats": samples}


def verdicts(points: dict[str, Any], memory: dict[str, Any]) -> list[dict[str, Any]]:
    proxy = {name: point["targets"]["proxy"] for name, point in points.items()}
    closed = {name: proxy[name] for name, point in points.items() if not point["paced"]}
    worst_ratio = min(closed, key=lambda name: closed[name]["vs_passthrough"])
    worst_cpu = max(proxy, key=lambda name: proxy[name]["cpu_ms_per_request"])
    paced = next(proxy[name] for name, point in points.items() if point["paced"])
    export_ms = memory["trace_export_ms"]["median"]
    ratio, cpu = closed[worst_ratio]["vs_passthrough"], proxy[worst_cpu]["cpu_ms_per_request"]
    added = (paced["added_p50_ms"], paced["added_p99_ms"])
    checks = [
        (ratio >= MIN_THROUGHPUT_RATIO, f"worst {ratio:.0%} of pass-through ({worst_ratio})"),
        (cpu <= MAX_CPU_MS, f"worst {cpu:.2f} ms ({worst_cpu})"),
        (
            added[0] <= MAX_PACED_ADDED_MS[0] and added[1] <= MAX_PACED_ADDED_MS[1],
            f"p50 {added[0]:+.2f} ms, p99 {added[1]:+.2f} ms",
        ),
        (
            memory["per_session_mb"] < MAX_SESSION_MB,
            f"{memory['per_session_mb']:.3f} MB per {memory['turns']}-turn session",
        ),
        (export_ms <= MAX_TRACE_EXPORT_MS, f"median {export_ms:.1f} ms for a {memory['turns']}-turn session"),
    ]
    return [
        {"target": name, "pass": bool(ok), "measured": detail}
        for name, (ok, detail) in zip(TARGET_NAMES, checks, strict=True)
    ]


def table_rows(points: dict[str, Any]) -> list[tuple[str, ...]]:
    def cell(value: float | None, fmt: str) -> str:
        return "-" if value is None else fmt.format(value)

    rows = [COLUMNS]
    for name, point in points.items():
        for target, s in point["targets"].items():
            added = (s["added_p50_ms"], s["added_p99_ms"]) if target != "direct" else (None, None)
            cells = [(s["rps"], "{:.0f}"), (s["vs_passthrough"] if target == "proxy" else None, "{:.0%}")]
            cells += [(s["p50_ms"], "{:.2f}"), (s["p99_ms"], "{:.2f}"), (added[0], "{:+.2f}")]
            cells += [(added[1], "{:+.2f}"), (s.get("cpu_ms_per_request"), "{:.2f}")]
            rows.append(
                (
                    name,
                    target,
                    *(cell(value, fmt) for value, fmt in cells),
                    cell(s.get("peak_rss_mb"), "{:.0f}"),
                )
            )
    return rows


def print_report(result: dict[str, Any]) -> None:
    c, memory = result["config"], result["memory"]
    print(
        f"\n{c['turns']}-turn conversations, {c['repeats']} repeats (medians), closed loop except the paced "
        f"point; proxy rows vs direct (+) and pass-through (vs pass); CPU and RSS of the serving process"
    )
    rows = table_rows(result["points"])
    print_table(rows, left=2)
    export = memory["trace_export_ms"]
    print(
        f"proxy memory: {memory['sessions']} finished {memory['turns']}-turn sessions kept: RSS "
        f"{memory['rss_before_mb']:.0f} -> {memory['rss_finished_mb']:.0f} MB "
        f"({memory['per_session_mb']:.3f} MB/session); after exporting each trace once "
        f"{memory['rss_exported_mb']:.0f} MB, after deleting them {memory['rss_deleted_mb']:.0f} MB"
    )
    chains = "one unbroken path" if memory["trace_chains"] else "BROKEN: a prompt does not extend its parent"
    print(
        f"trace export: median {export['median']:.1f} ms, max {export['max']:.1f} ms "
        f"({memory['trace_bytes'] / 1e6:.1f} MB JSON, {memory['trace_turns']} turns, {chains})"
    )
    print_verdicts(result, 56)


# -------------------------------------------------------------------------------------------------- main

FULL = {"agents": "1,16,64", "turns": 20, "repeats": 5, "paced_agents": 64, "min_conversations": 48}
FULL |= {"memory_sessions": 64}
QUICK = {"agents": "1,4", "turns": 4, "repeats": 1, "paced_agents": 4, "min_conversations": 2}
QUICK |= {"memory_sessions": 4}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny configuration: " + str(QUICK))
    parser.add_argument(
        "--agents", default=None, help=f"concurrent agents per point (default {FULL['agents']})"
    )
    parser.add_argument("--turns", type=positive, default=None, help="calls per conversation (default 20)")
    parser.add_argument(
        "--repeats", type=positive, default=None, help="runs per point and target (default 5)"
    )
    parser.add_argument("--paced-agents", type=positive, default=None, help="agents in the paced point (64)")
    parser.add_argument(
        "--min-conversations", type=positive, default=None, help="conversations per point, at least (48)"
    )
    parser.add_argument("--memory-sessions", type=positive, default=None, help="sessions for memory (64)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    return parser


def resolve(args: argparse.Namespace) -> dict[str, Any]:
    """The configuration: ``--quick`` or the full defaults, with every flag given on top."""
    config = dict(QUICK if args.quick else FULL)
    config |= {key: value for key in config if (value := getattr(args, key)) is not None}
    config["agents"] = [positive(part) for part in str(config["agents"]).split(",")]
    return config | {"quick": args.quick}


def make_points(config: dict[str, Any]) -> list[Point]:
    points = [
        Point(f"c{n} {'sse' if stream else 'json'}", n, max(2 * n, config["min_conversations"]), stream)
        for n in config["agents"]
        for stream in (False, True)
    ]
    paced = config["paced_agents"]
    return [*points, Point(f"paced c{paced} sse", paced, paced, True, paced=True)]


async def run(config: dict[str, Any], stack: contextlib.ExitStack) -> dict[str, Any]:
    targets, engine = await start_targets(stack)
    turns, points = config["turns"], make_points(config)
    for target in targets.values():  # warm-up, not measured: connections, caches, lazy imports
        await run_point(target, Point("warm-up", 2, 2, True), min(turns, 3))
    samples: dict[str, dict[str, list]] = {point.name: {name: [] for name in TARGETS} for point in points}
    for repeat in range(config["repeats"]):
        order = TARGETS[repeat % 3 :] + TARGETS[: repeat % 3]
        for point in points:
            this = {name: await run_point(targets[name], point, turns) for name in order}
            relate(this)
            for name in TARGETS:
                samples[point.name][name].append(this[name])
            line = ", ".join(
                f"{n} {this[n]['rps']:.0f} req/s p50 {this[n]['p50_ms']:.2f} ms" for n in TARGETS
            )
            print(f"repeat {repeat + 1}/{config['repeats']} {point.name}: {line}", flush=True)
    memory = await measure_memory(stack, engine.url, config["memory_sessions"], turns)
    result: dict[str, Any] = {"config": config, "memory": memory}
    result["points"] = {
        point.name: {"agents": point.agents, "conversations": point.conversations, "stream": point.stream}
        | {"paced": point.paced, "targets": {name: summarize(samples[point.name][name]) for name in TARGETS}}
        for point in points
    }
    servers = [engine.process.pid] + [t.server.process.pid for t in targets.values() if t.server is not None]
    result["server_pids"] = [*servers, memory["pid"]]
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print the table and verdicts; 0, or 1 on a missed target under ``--strict``."""
    args = build_parser().parse_args(argv)
    config = resolve(args)
    result = run_with_servers(run, config)
    if result is None:
        return 130
    result["verdicts"] = verdicts(result["points"], result["memory"])
    result["all_pass"] = all(verdict["pass"] for verdict in result["verdicts"])
    return finish(result, args, print_report, leftovers_key=None)


if __name__ == "__main__":
    sys.exit(main())
