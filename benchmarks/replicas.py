"""What routing over engine replicas costs: the capture proxy with ``--replicas`` over 4 engines against 1.

Set-up (real processes on loopback, stopped on every path; the agents and workload of
``benchmarks/proxy.py``: 20-turn tool-calling conversations whose prompts grow from ~2.3k to ~8k ids):

- **throughput, replica-normalised**: engines of fixed capacity (``benchmarks/fake_vllm.py engine --delay D
  --max-concurrent N``: N replies at once, each held D seconds, so N / D calls per second). The replica
  proxy fronts 4 engines of N slots; the baseline proxy (no ``--replicas``) fronts one engine of 4N slots,
  the same capacity in one place. ``ratio`` = replica req/s / baseline req/s, closed loop at ``--agents``
  (64) agents: 1.0 means routing spread the load as well as one engine four times as big would have held
  it.
- **scaling**: the same closed loop through a ``--replicas`` proxy over 1, 2 and 4 of those N-slot engines:
  req/s over k replicas / (k x req/s over one), each conversation a rollout's model calls (its turns), so the
  ratio is rollout throughput against linear. Target (issue 22): at least 0.9 at 4.
- **added p50 routing latency**: engines that answer at once (no delay, no limit); ``--agents`` paced agents
  (SSE, 0.25-0.75 s between turns, as in the proxy benchmark's paced point). One proxy with ``--replicas``
  over 4 of them: its sessions routed by replicas against sessions of the same proxy that each name their
  engine (``SessionSpec.upstream``, spread round the 4; not routed), so the processes, pools and engines
  are the same and only the routing differs: the p50 difference. Also printed: the same replica sessions
  against a plain proxy over one engine (what a second and third engine process cost on this machine),
  and the routing code's own time per call (``ReplicaSet.pick`` + ``observe``, in this process).

Each conversation is one proxy session, minted before and deleted after its run. Repeats (``--repeats``,
default 3) alternate the order of the two proxies; medians are reported. The load comes from this process
on the same machine, so on a small machine it competes with the proxies for CPU, equally for each.

Targets (issue 22): ratio >= 0.95; added p50 <= 0.2 ms. A MISS does not fail the run unless ``--strict``.
Run: ``python -m benchmarks.replicas [--quick] [--agents 64] [--turns 20] [--repeats 3] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

if not __package__:  # run as a script: its siblings import from the package
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
)
from benchmarks.proxy_agents import SAMPLING, Point, Target
from benchmarks.proxy_runs import admin_headers, delete_sessions, drive, percentile, run_point, wait_healthy

HERE = Path(__file__).resolve().parent
REPLICAS = 4
DELAY_S = 0.05
SLOTS = 4
MIN_RATIO = 0.95
MAX_ADDED_P50_MS = 0.2
MIN_SCALING = 0.9
TARGET_NAMES = (
    "replica-normalised throughput >= 0.95",
    "added p50 routing latency <= 0.2 ms",
    f"throughput over {REPLICAS} replicas >= {MIN_SCALING} x linear",
)


async def start_engine(stack: contextlib.ExitStack, delay: float = 0.0, slots: int = 0) -> Server:
    port = free_port()
    command = [sys.executable, str(HERE / "fake_vllm.py"), "engine", "--port", str(port)]
    command += ["--delay", str(delay), "--max-concurrent", str(slots)]
    engine = start_server(stack, "engine", command, port)
    await wait_healthy(engine)
    return engine


async def start_proxy(stack: contextlib.ExitStack, engines: list[Server], replicas: bool) -> Target:
    data_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="replicas-bench-"))
    port, key = free_port(), secrets.token_hex(16)
    command = [sys.executable, "-m", "capture_proxy", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--data-dir", data_dir, "--admin-key", key, *(["--replicas"] if replicas else [])]
    for engine in engines:
        command += ["--upstream", engine.url]
    proxy = start_server(stack, "replica proxy" if replicas else "proxy", command, port)
    await wait_healthy(proxy)
    return Target(proxy.name, proxy.url + "/v1/chat/completions", proxy, (proxy.url, key))


async def run_named(target: Target, point: Point, turns: int, engines: list[str]) -> dict[str, Any]:
    """:func:`benchmarks.proxy_runs.run_point`, but each session names its engine, round ``engines`` in
    turn."""
    assert target.admin is not None
    async with aiohttp.ClientSession() as admin:

        async def mint(index: int) -> str:
            body = {"sampling": SAMPLING, "max_model_calls": turns, "upstream": engines[index % len(engines)]}
            url = target.admin[0] + "/sessions"  # type: ignore[index]
            async with admin.post(url, json=body, headers=admin_headers(target)) as reply:
                if reply.status != 201:
                    raise RuntimeError(f"POST /sessions: HTTP {reply.status}: {(await reply.read())[:500]!r}")
                return (await reply.json())["session_id"]

        keys = list(await asyncio.gather(*(mint(i) for i in range(point.conversations))))
        result = await drive(target, point, turns, list(keys))
        await delete_sessions(admin, target, keys)
    latencies = sorted(result.latencies)
    sample = {"calls": len(latencies), "seconds": result.seconds, "rps": len(latencies) / result.seconds}
    return sample | {"p50_ms": 1000 * percentile(latencies, 50), "p99_ms": 1000 * percentile(latencies, 99)}


def routing_us(calls: int = 200_000) -> float:
    """Microseconds of routing code per call: ``pick`` and ``observe`` for 64 sessions over 4 replicas."""
    from capture_proxy.replicas import ReplicaSet
    from capture_proxy.upstream import Upstream, UpstreamResult

    replicas = ReplicaSet([Upstream(f"http://127.0.0.1:{9000 + i}") for i in range(REPLICAS)], "m", 5.0)
    answered = UpstreamResult({"choices": []}, 200)
    sessions = [f"session-{i}" for i in range(64)]
    started = time.perf_counter()
    for call in range(calls):
        replicas.observe(replicas.pick(sessions[call % 64]), answered)
    return (time.perf_counter() - started) / calls * 1e6


async def compare(
    baseline: Target,
    replica: Target,
    point: Point,
    turns: int,
    repeats: int,
    label: str,
    named: list[str] | None = None,
) -> dict[str, Any]:
    """Both proxies on ``point``, ``repeats`` times in alternating order; the samples and the medians.
    With ``named``, the baseline's sessions each name one of those engines (:func:`run_named`)."""
    samples: dict[str, list[dict[str, Any]]] = {"baseline": [], "replicas": []}

    async def once(name: str, target: Target, point: Point, turns: int) -> dict[str, Any]:
        if name == "baseline" and named is not None:
            return await run_named(target, point, turns, named)
        return await run_point(target, point, turns)

    for name, target in (("baseline", baseline), ("replicas", replica)):  # warm-up, not measured
        await once(name, target, Point("warm-up", 2, 2, point.stream), min(turns, 3))
    for repeat in range(repeats):
        order = [("baseline", baseline), ("replicas", replica)]
        for name, target in order if repeat % 2 == 0 else order[::-1]:
            samples[name].append(await once(name, target, point, turns))
        b, r = samples["baseline"][-1], samples["replicas"][-1]
        print(
            f"repeat {repeat + 1}/{repeats} {label}: baseline {b['rps']:.0f} req/s p50 {b['p50_ms']:.2f} ms, "
            f"replicas {r['rps']:.0f} req/s p50 {r['p50_ms']:.2f} ms",
            flush=True,
        )
    pairs = list(zip(samples["baseline"], samples["replicas"], strict=True))
    return {
        "samples": samples,
        "ratio": statistics.median(r["rps"] / b["rps"] for b, r in pairs),
        "added_p50_ms": statistics.median(r["p50_ms"] - b["p50_ms"] for b, r in pairs),
        "baseline_rps": statistics.median(b["rps"] for b, _ in pairs),
        "replicas_rps": statistics.median(r["rps"] for _, r in pairs),
        "baseline_p50_ms": statistics.median(b["p50_ms"] for b, _ in pairs),
        "replicas_p50_ms": statistics.median(r["p50_ms"] for _, r in pairs),
    }


async def run(config: dict[str, Any], stack: contextlib.ExitStack) -> dict[str, Any]:
    agents, turns, repeats = config["agents"], config["turns"], config["repeats"]
    closed = Point(f"c{agents} json", agents, agents, False)
    paced = Point(f"paced c{agents} sse", agents, agents, True, paced=True)

    slow = [await start_engine(stack, DELAY_S, SLOTS) for _ in range(REPLICAS)]
    big = await start_engine(stack, DELAY_S, SLOTS * REPLICAS)
    over_big = await start_proxy(stack, [big], replicas=False)
    over_slow = await start_proxy(stack, slow, replicas=True)
    throughput = await compare(over_big, over_slow, closed, turns, repeats, closed.name)
    # Scaling: the replica proxy over 1, 2 and REPLICAS engines of one capacity, each point's median req/s.
    by_count: dict[int, float] = {REPLICAS: throughput["replicas_rps"]}
    for count in (1, 2):
        over = await start_proxy(stack, slow[:count], replicas=True)
        rates = [(await run_point(over, closed, turns))["rps"] for _ in range(repeats)]
        by_count[count] = statistics.median(rates)
    throughput["one_engine_rps"] = by_count[1]
    throughput["rps_by_replicas"] = {str(k): by_count[k] for k in sorted(by_count)}
    throughput["scaling_by_replicas"] = {str(k): by_count[k] / (k * by_count[1]) for k in sorted(by_count)}
    throughput["scaling"] = throughput["scaling_by_replicas"][str(REPLICAS)]

    fast = [await start_engine(stack) for _ in range(REPLICAS)]
    over_fast = await start_proxy(stack, fast, replicas=True)
    urls = [engine.url for engine in fast]
    latency = await compare(over_fast, over_fast, paced, turns, repeats, paced.name + " named/routed", urls)
    plain = await start_proxy(stack, fast[:1], replicas=False)
    versus_one = await compare(plain, over_fast, paced, turns, repeats, paced.name + " 1 engine/routed")
    return {
        "config": config,
        "throughput": throughput,
        "latency": latency,
        "latency_vs_one_engine": versus_one,
        "routing_us_per_call": routing_us(),
    }


def verdicts(result: dict[str, Any]) -> list[dict[str, Any]]:
    ratio, added = result["throughput"]["ratio"], result["latency"]["added_p50_ms"]
    scaling = result["throughput"]["scaling"]
    checks = [
        (ratio >= MIN_RATIO, f"{ratio:.3f} ({REPLICAS} x {SLOTS} slots vs 1 x {REPLICAS * SLOTS})"),
        (added <= MAX_ADDED_P50_MS, f"{added:+.3f} ms (routed vs named sessions, one proxy, paced)"),
        (scaling >= MIN_SCALING, f"{scaling:.3f} x linear ({REPLICAS} x {SLOTS}-slot engines vs one)"),
    ]
    return [
        {"target": n, "pass": bool(ok), "measured": d}
        for n, (ok, d) in zip(TARGET_NAMES, checks, strict=True)
    ]


def print_report(result: dict[str, Any]) -> None:
    t, lat, c = result["throughput"], result["latency"], result["config"]
    print(f"\n{c['agents']} agents, {c['turns']}-turn conversations, {c['repeats']} repeats (medians)")
    rows = [("measure", "replicas", "baseline", "ratio / diff")]
    rows.append(
        (
            f"req/s, closed loop ({REPLICAS} x {SLOTS} vs 1 x {REPLICAS * SLOTS} slots of {DELAY_S:.2f} s)",
            f"{t['replicas_rps']:.0f}",
            f"{t['baseline_rps']:.0f}",
            f"{t['ratio']:.3f}",
        )
    )
    for count, rps in t["rps_by_replicas"].items():
        rows.append(
            (
                f"req/s over {count} replica(s) vs {count} x one {SLOTS}-slot engine",
                f"{rps:.0f}",
                f"{count} x {t['one_engine_rps']:.0f}",
                f"{t['scaling_by_replicas'][count]:.3f}",
            )
        )
    one = result["latency_vs_one_engine"]
    for label, part in (("routed vs named, same proxy", lat), ("routed vs a plain proxy on 1 engine", one)):
        rows.append(
            (
                f"p50 ms, paced, {label}",
                f"{part['replicas_p50_ms']:.2f}",
                f"{part['baseline_p50_ms']:.2f}",
                f"{part['added_p50_ms']:+.3f}",
            )
        )
    rows.append(
        ("routing code per call, us (pick + observe)", f"{result['routing_us_per_call']:.2f}", "-", "-")
    )
    print_table(rows)
    print_verdicts(result, 40)


FULL = {"agents": 64, "turns": 20, "repeats": 3}
QUICK = {"agents": 4, "turns": 4, "repeats": 1}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny configuration: " + str(QUICK))
    parser.add_argument("--agents", type=positive, default=None, help="concurrent agents (default 64)")
    parser.add_argument("--turns", type=positive, default=None, help="calls per conversation (default 20)")
    parser.add_argument("--repeats", type=positive, default=None, help="runs per proxy and point (default 3)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    config = dict(QUICK if args.quick else FULL)
    config |= {key: value for key in config if (value := getattr(args, key)) is not None}
    result = run_with_servers(run, config)
    if result is None:
        return 130
    result["verdicts"] = verdicts(result)
    result["all_pass"] = all(verdict["pass"] for verdict in result["verdicts"])
    return finish(result, args, print_report, leftovers_key=None)


if __name__ == "__main__":
    sys.exit(main())
