"""Soak: hundreds of rollouts through the whole stack, watching the long-lived processes for leaks.

Set-up (the same as ``benchmarks/rollouts.py``, whose rig, ``benchmarks/rollouts_rig.py``, it uses; real
processes on loopback, free ports, every one stopped on every path, Ctrl-C and SIGTERM included; sandbox
roots and capture journals in one temporary directory):

- **engine**: ``benchmarks/fake_vllm.py engine --command true``, the instant fake vLLM (every reply one
  ``bash`` tool call running ``true``, so an agent runs until its step limit);
- **server**: ``harness-trainer serve`` on ``harness_trainer/examples/tasks`` (the rollout server; its
  capture proxy runs as its child process, **proxy** below), ``--max-concurrent-envs`` just above the
  concurrency;
- **rollouts**: task ``hello-file``, the ``toy`` agent in ``local`` sandboxes, ``--steps`` model calls each,
  driven over the server's HTTP API from an asyncio client in **waves** of ``--concurrency`` rollouts
  (open → start → long-poll until done → fetch the trace → close; the next wave starts when the last one
  is closed). Warm-up waves first (``--warmup`` rollouts, not counted: allocator arenas, caches and
  connection pools fill), then waves until ``--rollouts`` have run.

Measured, for the server, its proxy and the engine: ``VmRSS`` and ``Threads`` (``/proc/<pid>/status``) and
open fds (``/proc/<pid>/fd``), sampled every ``--interval`` seconds by a thread and once after every wave
(when nothing is in flight). Reported: the values after the last warm-up wave (**start**) and after the last
wave (**end**); the RSS **slope** in MB per 100 rollouts, a least-squares fit of every sample after the
warm-up against the rollouts closed so far, and the same fit over the second half of the run only (a
cache that fills up and stops shows as a slope falling to ~0 there, a leak as a slope that stays). Per
wave: its wall time, failures, model calls and journal bytes per call (the proxy's
``capture_proxy_journal_bytes_total`` over its call counter, from ``/metrics``); expected journal bytes =
the first counted wave's bytes per call × every counted call. After the last wave: open rollout sessions
and capture sessions (``GET /health``), sandbox roots under the server's ``TMPDIR``, bytes and session
folders left under the capture ``--data-dir`` (journals are deleted with their sessions), the server's
child processes other than its proxy; and after the servers stop, any process naming their ports or the
temporary directory.

Verdicts (for the server and its proxy, the processes under test; the engine is a fixture, shown for the
record): memory flat (each one's RSS slope < 5 MB per 100 rollouts), no fd growth (each one's end <= start
+ 8 + concurrency: pooled
keep-alive connections come and go with the load, a leak grows with the rollouts), journal as expected
(every counted wave's bytes per call within 10 % of the first's, nothing left on disk), nothing left
(no session, capture session, sandbox, child or leftover process; no failed rollout). Output: one table,
then PASS/MISS; a MISS exits 0 unless ``--strict`` (leftover processes exit 1).
Run: ``python benchmarks/soak.py [--quick] [--rollouts 500] [--warmup 32] [--concurrency 16] [--steps 4]
[--interval 1] [--json OUT] [--strict]``; ``--quick`` is the tiny configuration of the test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import orjson

if not __package__:  # run as a script (python benchmarks/soak.py): its siblings import from the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    Server,
    children,
    finish,
    positive,
    print_table,
    print_verdicts,
    status_value,
    stop_process,
)
from benchmarks.rollouts_rig import (
    CALLS_METRIC,
    SAMPLING,
    SPLIT,
    leftovers,
    proxy_pid,
    start_engine,
    start_rollout_server,
    task_index,
)

MAX_SLOPE_MB = 5.0  # per 100 rollouts
FD_SLACK = 8  # plus one per rollout of a wave: keep-alive connections come and go with the load
JOURNAL_TOLERANCE = 0.10
BYTES_METRIC = "capture_proxy_journal_bytes_total"
TARGET_NAMES = (
    f"memory flat: server and proxy RSS slope < {MAX_SLOPE_MB:g} MB per 100 rollouts",
    f"no fd growth: server and proxy fds at the end <= start + {FD_SLACK} + concurrency",
    f"journal as expected: bytes per call within {JOURNAL_TOLERANCE:.0%} every wave, none left on disk",
    "nothing left: no failed rollout, session, sandbox or process",
)
COLUMNS = ("wave", "rollouts", "seconds", "failed", "calls", "journal B/call", "server RSS MB", "fds")
COLUMNS += ("threads", "proxy RSS MB", "proxy fds", "engine RSS MB", "engine fds")
FULL = {"rollouts": 500, "warmup": 32, "concurrency": 16, "steps": 4, "interval": 1.0}
QUICK = {"rollouts": 20, "warmup": 12, "concurrency": 4, "steps": 3, "interval": 0.5}


# ----------------------------------------------------------------------------------------------- sampling


def process_sample(pid: int) -> dict[str, float]:
    """RSS (MB), threads and open fds of ``pid``."""
    return {
        "rss_mb": status_value(pid, "VmRSS") / 1024,
        "threads": status_value(pid, "Threads"),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
    }


def tree_bytes(root: Path) -> tuple[int, int]:
    """Apparent bytes of every file under ``root``, and the session folders under ``root/sessions``."""
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_size
    sessions = root / "sessions"
    return total, len(list(sessions.iterdir())) if sessions.is_dir() else 0


class Sampler(threading.Thread):
    """Samples the processes every ``interval`` seconds with the rollouts closed so far (``done``)."""

    def __init__(self, pids: dict[str, int], interval: float) -> None:
        super().__init__(daemon=True)
        self.pids, self.interval = pids, interval
        self.done = 0  # rollouts closed since the warm-up wave; set by the driver
        self.counting = False  # after the warm-up
        self.samples: list[dict[str, Any]] = []
        self.halt = threading.Event()

    def sample(self) -> dict[str, Any]:
        row: dict[str, Any] = {"t": time.monotonic(), "done": self.done}
        for name, pid in self.pids.items():
            with contextlib.suppress(OSError, KeyError):  # the process ended: the run is failing anyway
                row[name] = process_sample(pid)
        return row

    def run(self) -> None:
        while not self.halt.wait(self.interval):
            if self.counting:
                self.samples.append(self.sample())


def slope_per_100(samples: list[dict[str, Any]], name: str) -> float | None:
    """Least-squares slope of ``name``'s RSS (MB) against rollouts done, per 100 rollouts."""
    points = [(s["done"], s[name]["rss_mb"]) for s in samples if name in s]
    if len(points) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    var = sum((x - mean_x) ** 2 for x, _ in points)
    if var == 0:
        return None
    return 100 * sum((x - mean_x) * (y - mean_y) for x, y in points) / var


# ------------------------------------------------------------------------------------------------ driving


async def get_json(client: aiohttp.ClientSession, url: str, **params: str) -> dict[str, Any]:
    async with client.get(url, params=params) as reply:
        return orjson.loads(await reply.read())


async def metrics(client: aiohttp.ClientSession, server: Server) -> tuple[float, float]:
    """(model calls answered, journal bytes written) by the server's capture proxy since it started."""
    async with client.get(f"http://{server.proxy}/metrics") as reply:
        lines = (await reply.read()).decode().splitlines()
    calls = sum(float(line.split()[-1]) for line in lines if line.startswith(CALLS_METRIC))
    written = sum(float(line.split()[-1]) for line in lines if line.startswith(BYTES_METRIC + " "))
    return calls, written


async def one_rollout(
    client: aiohttp.ClientSession, server: Server, body: dict[str, Any], steps: int, sampler: Sampler
) -> str:
    """One rollout, open to close; '' when it made ``steps`` calls and gave a trace, else what went wrong."""
    session_id, problem = "", ""
    try:
        async with client.post(server.url + "/sessions") as reply:
            data = await reply.read()
        if reply.status != 201:
            return f"POST /sessions: HTTP {reply.status} {data[:200]!r}"
        session_id = orjson.loads(data)["session_id"]
        url = f"{server.url}/sessions/{session_id}"
        async with client.post(url + "/rollout", json=body) as reply:
            data = await reply.read()
        if reply.status != 202:
            return f"POST rollout: HTTP {reply.status} {data[:200]!r}"
        state: dict[str, Any] = {"status": "running"}
        while state["status"] != "done":
            state = await get_json(client, url, wait="30")
        result = state["result"]
        if result.get("error") or result["model_calls"] != steps:
            problem = f"{result['model_calls']}/{steps} calls, error {result.get('error')!r}"
        async with client.get(url + "/trace") as reply:
            trace = await reply.read()
        if reply.status != 200 and not problem:
            problem = f"GET trace: HTTP {reply.status} {trace[:200]!r}"
        elif not problem and len(orjson.loads(trace)["turns"]) != steps:
            problem = f"trace of {len(orjson.loads(trace)['turns'])} turns, not {steps}"
    except (aiohttp.ClientError, KeyError, ValueError) as exc:
        problem = f"{type(exc).__name__}: {exc}"
    finally:
        if session_id:
            with contextlib.suppress(aiohttp.ClientError):
                async with client.delete(f"{server.url}/sessions/{session_id}") as reply:
                    await reply.read()
        sampler.done += sampler.counting
    return problem


def wave_plan(rollouts: int, concurrency: int, warmup: int) -> list[tuple[str, int, bool]]:
    """Waves of at most ``concurrency``: (label, rollouts, counted); ``warmup`` rollouts first, uncounted."""
    plan = []
    for counted, total in ((False, warmup), (True, rollouts)):
        for number, start in enumerate(range(0, total, concurrency), 1):
            plan.append(
                (str(number) if counted else f"warm-up {number}", min(concurrency, total - start), counted)
            )
    return plan


async def run_waves(server: Server, engine: Server, tmp: Path, config: dict[str, Any]) -> dict[str, Any]:
    """The warm-up waves, then counted waves until ``config['rollouts']`` ran; a row per wave."""
    pids = {"server": server.process.pid, "engine": engine.process.pid}
    if (proxy := proxy_pid(server)) is not None:
        pids["proxy"] = proxy
    sampler = Sampler(pids, config["interval"])
    sampler.start()
    body = {"split": SPLIT, "index": config["task_index"], "harness": "toy", "sandbox": "local"}
    body |= {"sampling": SAMPLING, "agent_step_limit": config["steps"], "agent_timeout_sec": 120}
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=120)
    waves: list[dict[str, Any]] = []
    failures: list[str] = []
    async with aiohttp.ClientSession(timeout=timeout) as client:
        try:
            plan = wave_plan(config["rollouts"], config["concurrency"], config["warmup"])
            last_warmup = [label for label, _, counted in plan if not counted][-1]
            for label, size, counted in plan:
                calls0, bytes0 = await metrics(client, server)
                started = time.perf_counter()
                jobs = (one_rollout(client, server, body, config["steps"], sampler) for _ in range(size))
                problems = [p for p in await asyncio.gather(*jobs) if p]
                seconds = time.perf_counter() - started
                calls1, bytes1 = await metrics(client, server)
                quiet = sampler.sample()
                wave = {"wave": label, "counted": counted, "rollouts": size, "seconds": seconds}
                wave |= {"failed": len(problems), "calls": calls1 - calls0, "journal_bytes": bytes1 - bytes0}
                wave["bytes_per_call"] = wave["journal_bytes"] / wave["calls"] if wave["calls"] else None
                wave |= {name: quiet.get(name) for name in pids}
                waves.append(wave)
                failures += [f"wave {label}: {p}" for p in problems]
                print(progress(wave), flush=True)
                if counted:
                    sampler.samples.append(quiet)
                else:  # the last warm-up wave's sample is the fit's starting point (0 rollouts)
                    sampler.samples = [quiet]
                sampler.counting = label == last_warmup or sampler.counting
            health = await get_json(client, server.url + "/health")
        finally:
            sampler.halt.set()
            sampler.join()
    data_bytes, data_sessions = tree_bytes(tmp / "soak" / "capture")
    end = {"sessions": health["sessions"], "capture_sessions": health.get("capture_sessions")}
    end |= {"sandboxes": len(list((tmp / "soak" / "sandboxes").iterdir()))}
    end |= {"data_dir_bytes": data_bytes, "data_dir_sessions": data_sessions}
    end["server_children"] = len([pid for pid in children(server.process.pid) if pid != pids.get("proxy")])
    return {"waves": waves, "samples": sampler.samples, "failures": failures, "end": end}


# ------------------------------------------------------------------------------------------------ report


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """Start/end/slope per process and the journal's expected vs written bytes (counted waves only)."""
    warm = [w for w in run["waves"] if not w["counted"]][-1]
    counted = [w for w in run["waves"] if w["counted"]]
    processes: dict[str, Any] = {}
    for name in ("server", "proxy", "engine"):
        if warm.get(name) is None:
            continue  # no such process (a server with its proxy in process)
        start, end = warm.get(name) or {}, (counted[-1] if counted else warm).get(name) or {}
        processes[name] = {
            f"{key}_{edge}": side.get(key)
            for key in ("rss_mb", "fds", "threads")
            for edge, side in (("start", start), ("end", end))
        }
        processes[name]["rss_slope_mb_per_100"] = slope_per_100(run["samples"], name)
        half = [sample for sample in run["samples"] if sample["done"] >= run["counted_rollouts"] / 2]
        processes[name]["rss_slope_second_half"] = slope_per_100(half, name)
        processes[name]["samples"] = sum(name in s for s in run["samples"])
    per_call = [w["bytes_per_call"] for w in counted if w["bytes_per_call"]]
    calls = sum(w["calls"] for w in counted)
    journal: dict[str, Any] = {"calls": calls, "written_bytes": sum(w["journal_bytes"] for w in counted)}
    journal["bytes_per_call_first"] = per_call[0] if per_call else None
    journal["expected_bytes"] = per_call[0] * calls if per_call else None
    journal["max_deviation"] = max((abs(v / per_call[0] - 1) for v in per_call), default=None)
    journal |= {"left_bytes": run["end"]["data_dir_bytes"], "left_sessions": run["end"]["data_dir_sessions"]}
    return {"processes": processes, "journal": journal}


def verdicts(result: dict[str, Any]) -> list[dict[str, Any]]:
    """PASS/MISS for each of ``TARGET_NAMES``, with what was measured."""
    journal, end = result["journal"], result["end"]
    tested = {name: p for name, p in result["processes"].items() if name != "engine"}
    deviation = journal["max_deviation"]
    left = {key: value for key, value in end.items() if key != "data_dir_bytes" and value}
    left |= {"failed rollouts": len(result["failures"])} if result["failures"] else {}
    left |= {"leftover processes": len(result["leftover_processes"])} if result["leftover_processes"] else {}
    slack = FD_SLACK + result["config"]["concurrency"]
    memory_ok, fds_ok, memory, fds = True, True, [], []
    for name, p in tested.items():
        slope = p["rss_slope_mb_per_100"]
        memory_ok &= slope is not None and slope < MAX_SLOPE_MB
        fds_ok &= p["fds_start"] is not None and p["fds_end"] <= p["fds_start"] + slack
        if slope is None:
            memory.append(f"{name} no slope (too few samples)")
        else:
            rss = f"RSS {p['rss_mb_start']:.0f} -> {p['rss_mb_end']:.0f} MB"
            memory.append(f"{name} {slope:+.2f} MB per 100 rollouts ({rss})")
        fds.append(f"{name} {p['fds_start']} -> {p['fds_end']} fds")
    written = "no journal bytes counted"
    if deviation is not None:
        written = f"{journal['bytes_per_call_first']:.0f} B/call, worst wave {deviation:.1%} off; "
        written += (
            f"{journal['written_bytes'] / 1e6:.2f} MB written vs {journal['expected_bytes'] / 1e6:.2f} MB "
        )
        written += f"expected; {journal['left_sessions']} sessions, {journal['left_bytes']} B left on disk"
    journal_ok = deviation is not None and deviation <= JOURNAL_TOLERANCE and not journal["left_sessions"]
    checks = [
        (memory_ok, "; ".join(memory) + f" over {result['counted_rollouts']} rollouts"),
        (fds_ok, "; ".join(fds)),
        (journal_ok, written),
        (not left, ", ".join(f"{key} {value}" for key, value in left.items()) or "nothing"),
    ]
    return [
        {"target": name, "pass": bool(ok), "measured": detail}
        for name, (ok, detail) in zip(TARGET_NAMES, checks, strict=True)
    ]


def fmt_slope(slope: float | None) -> str:
    return "-" if slope is None else f"{slope:+.2f}"


def progress(wave: dict[str, Any]) -> str:
    server = wave.get("server") or {}
    per_call = "-" if wave["bytes_per_call"] is None else f"{wave['bytes_per_call']:.0f}"
    return (
        f"wave {wave['wave']}: {wave['rollouts']} rollouts in {wave['seconds']:.1f} s, "
        f"{wave['failed']} failed, {per_call} journal B/call, "
        f"server RSS {server.get('rss_mb', 0):.1f} MB, {server.get('fds')} fds"
    )


def table_rows(waves: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    def cells(side: dict[str, Any] | None, keys: Sequence[str]) -> tuple[str, ...]:
        side = side or {}
        return tuple(
            "-" if side.get(k) is None else f"{side[k]:.1f}" if k == "rss_mb" else str(side[k]) for k in keys
        )

    rows = [COLUMNS]
    for w in waves:
        per_call = "-" if w["bytes_per_call"] is None else f"{w['bytes_per_call']:.0f}"
        row = (w["wave"], str(w["rollouts"]), f"{w['seconds']:.1f}", str(w["failed"]), f"{w['calls']:.0f}")
        row += (per_call, *cells(w.get("server"), ("rss_mb", "fds", "threads")))
        row += cells(w.get("proxy"), ("rss_mb", "fds"))
        rows.append(row + cells(w.get("engine"), ("rss_mb", "fds")))
    return rows


def print_report(result: dict[str, Any]) -> None:
    c = result["config"]
    print(
        f"\n{result['counted_rollouts']} rollouts after {c['warmup']} warm-up rollouts, "
        f"waves of {c['concurrency']}, "
        f"{c['steps']} model calls each; process values sampled after each wave (nothing in flight)"
    )
    rows = table_rows(result["waves"])
    print_table(rows)
    for name, p in result["processes"].items():
        slope, half = (fmt_slope(p[key]) for key in ("rss_slope_mb_per_100", "rss_slope_second_half"))
        print(
            f"{name}: RSS {p['rss_mb_start']:.1f} -> {p['rss_mb_end']:.1f} MB, slope {slope} MB/100 rollouts "
            f"(second half {half}; {p['samples']} samples); fds "
            f"{p['fds_start']} -> {p['fds_end']}; threads {p['threads_start']} -> {p['threads_end']}"
        )
    print(f"after the last wave: {result['end']}")
    for line in result["failures"][:10] + [f"LEFTOVER PROCESS: {x}" for x in result["leftover_processes"]]:
        print(line)
    print_verdicts(result, max(len(name) for name in TARGET_NAMES))


# -------------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--quick", action="store_true", help=f"tiny configuration: {QUICK}")
    add("--rollouts", type=positive, default=None, help=f"counted rollouts ({FULL['rollouts']})")
    add("--warmup", type=positive, default=None, help=f"warm-up rollouts, not counted ({FULL['warmup']})")
    add("--concurrency", type=positive, default=None, help=f"rollouts per wave ({FULL['concurrency']})")
    add("--steps", type=positive, default=None, help=f"model calls per rollout ({FULL['steps']})")
    add("--interval", type=float, default=None, help=f"seconds between samples ({FULL['interval']})")
    add("--json", type=Path, default=None, help="also write the results to this JSON file")
    add("--strict", action="store_true", help="exit 1 when a target is missed")
    return parser


def resolve(args: argparse.Namespace) -> dict[str, Any]:
    """The configuration: ``--quick`` or the full defaults, with every flag given on top."""
    config: dict[str, Any] = dict(QUICK if args.quick else FULL)
    config |= {key: value for key in config if (value := getattr(args, key)) is not None}
    return config | {"quick": args.quick}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the soak, print the table and verdicts; 0, or 1 on leftovers or a MISS under ``--strict``."""
    args = build_parser().parse_args(argv)
    config = resolve(args)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops the servers too
    result: dict[str, Any] = {"config": config, "pids": [], "leftover_processes": []}
    started = time.perf_counter()
    try:
        with contextlib.ExitStack() as stack:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="soak-bench-")))
            engine = start_engine(stack, 0.0)
            server = start_rollout_server(stack, tmp, "soak", engine.url, config["concurrency"] + 2)
            result["pids"] = [engine.process.pid, server.process.pid]
            config["task_index"] = task_index(server)
            result |= asyncio.run(run_waves(server, engine, tmp, config))
            stop_process(server.process, 60.0)
            stop_process(engine.process)
            result["leftover_processes"] = leftovers([*server.tags, *engine.tags], tmp)
    except KeyboardInterrupt:
        print("interrupted: every server stopped, every session closed", file=sys.stderr)
        return 130
    result["elapsed_s"] = time.perf_counter() - started
    result["counted_rollouts"] = sum(w["rollouts"] for w in result["waves"] if w["counted"])
    result |= summarize(result)
    result["verdicts"] = verdicts(result)
    result["all_pass"] = all(v["pass"] for v in result["verdicts"])
    return finish(result, args, print_report)


if __name__ == "__main__":
    sys.exit(main())
