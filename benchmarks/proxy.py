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
import contextlib
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if not __package__:  # run as a script (python benchmarks/proxy.py): its siblings import from the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import finish, positive, print_table, print_verdicts, run_with_servers
from benchmarks.proxy_agents import Point
from benchmarks.proxy_runs import measure_memory, run_point, start_targets

TARGETS = ("direct", "passthrough", "proxy")
COLUMNS = ("point", "target", "req/s", "vs pass", "p50 ms", "p99 ms", "+p50 ms", "+p99 ms", "CPU ms/req")
COLUMNS += ("peak RSS MB",)
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
