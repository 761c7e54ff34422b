"""What each agent costs: its start-up to its first model call, and the capture proxy's CPU per call.

Every harness a scripted model can drive (its class's ``dialect``: the toy agent and every real one) runs
``--runs`` rollouts (3) of one toy task (``train/hello-file``: one shell command, then the agent's way of
finishing), one rollout at a time, through a real ``harness-trainer serve`` (local sandboxes, its capture
proxy as its own process) in front of the dev engine replaying each agent's solver transcript
(:mod:`harness_trainer.devloop.solver`: the same replies the dev loop's warm-up records), with the dev
loop's options for it (:mod:`harness_trainer.devloop.prompts`: mini-swe-agent's compact prompt,
qwen-code's shell tool alone). Measured per rollout:

- **start-up to the first model call**: the first captured call's arrival (its turn's ``started_at``)
  less the moment the agent was started (the rollout's request, plus its capture-session, sandbox-start
  and install phases, which run before the agent, one after the other);
- **proxy CPU per call**: the proxy process's CPU time (its threads' ``/proc/…/schedstat``) over the
  agent's rollouts, divided by their model calls (each rollout's own session minted, exported and closed
  included: what the proxy spends per call of such a rollout); and the proxy's own time in each call
  (``proxy_ms``: the call's wall time less the engine's);
- the agent phase's wall time, and the reward (1: the transcript solved the task).

Baseline: the toy agent (a 100-line stdlib script), whose start-up is a Python interpreter's. No speed
targets: the table is for choosing agents knowing their cost; its one check is that every run solved its
task, so the timings are of rollouts that worked. Rows are medians over the runs; the ratio is the
agent's start-up over the toy agent's.

Run: ``python -m benchmarks.agents [--quick] [--json OUT] [--runs 3] [--only a,b]``; ``--quick``: one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: its siblings import from the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import finish, free_port, positive, print_table, print_verdicts, run_seconds
from benchmarks.rollouts_rig import leftovers, proxy_pid, start_healthy
from harness_trainer.examples import TASKS

SPLIT, TASK = "train", "hello-file"
BASELINE = "toy"
TARGETS = ("every agent solved the task in every run (the timings are of rollouts that worked)",)
BEFORE_AGENT = ("capture_session", "sandbox_start", "install")
"""The rollout's phases that run before its agent starts, one after the other."""


def plan(harnesses: Sequence[str], runs: int) -> list[tuple[str, list[dict[str, Any]]]]:
    """The rollouts in the order they run, each with the replies the engine will give it."""
    from harness_trainer.devloop.solver import solver_replies
    from harness_trainer.tasks import load_task

    task = load_task(TASKS / SPLIT / TASK)
    return [(harness, solver_replies(harness, task)) for harness in harnesses for _ in range(runs)]


def startup_s(requested: float, result: dict[str, Any]) -> float | None:
    """Seconds from the agent's start to its first model call's arrival (None: it made none)."""
    turns = (result.get("trace") or {}).get("turns") or []
    arrivals = [t["metadata"]["started_at"] for t in turns if "started_at" in (t.get("metadata") or {})]
    if not arrivals:
        return None
    phases = result.get("phase_seconds") or {}
    return min(arrivals) - requested - sum(float(phases.get(p, 0.0)) for p in BEFORE_AGENT)


def proxy_ms(result: dict[str, Any]) -> list[float]:
    """The proxy's own milliseconds in each of the rollout's calls."""
    turns = (result.get("trace") or {}).get("turns") or []
    return [t["metadata"]["timings"]["proxy_ms"] for t in turns if "timings" in (t.get("metadata") or {})]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from harness_trainer.devloop.solver import SCRIPTED_HARNESSES

    began = time.monotonic()
    harnesses = [h for h in SCRIPTED_HARNESSES if not args.only or h in args.only]
    if BASELINE not in harnesses:
        harnesses.insert(0, BASELINE)
    rollouts = plan(harnesses, args.runs)
    rows: dict[str, list[dict[str, Any]]] = {h: [] for h in harnesses}
    proxy_cpu: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-agents-") as scratch:
        tmp = Path(scratch)
        tags = measure(args, harnesses, rollouts, tmp, rows, proxy_cpu)
        left = leftovers(tags, tmp)  # once the servers are stopped: nothing of theirs may be left
    agents = {h: summary(rows[h], proxy_cpu.get(h)) for h in harnesses}
    unsolved = [f"{h} {a['solved']}/{a['runs']}" for h, a in agents.items() if a["solved"] < a["runs"]]
    verdicts = [{
        "target": TARGETS[0], "pass": not unsolved,
        "measured": f"unsolved: {', '.join(unsolved)}" if unsolved else f"{len(agents)} agents, every run",
    }]  # fmt: skip
    return {
        "config": {"quick": args.quick, "runs": args.runs, "task": f"{SPLIT}/{TASK}", "harnesses": harnesses},
        "agents": agents, "runs": rows, "verdicts": verdicts, "all_pass": not unsolved,
        "leftover_processes": left, "elapsed_s": time.monotonic() - began,
    }  # fmt: skip


def measure(
    args: argparse.Namespace,
    harnesses: list[str],
    rollouts: list[tuple[str, list[dict[str, Any]]]],
    tmp: Path,
    rows: dict[str, list[dict[str, Any]]],
    proxy_cpu: dict[str, float],
) -> tuple[str, ...]:
    """Run ``rollouts`` through an engine and a ``serve`` started here (stopped on every path), filling in
    ``rows`` and ``proxy_cpu``; returns what names the servers' processes."""
    from harness_trainer.dev_engine.process import start_engine
    from harness_trainer.models.tiny import ensure_tiny_model

    with contextlib.ExitStack() as stack:
        script = tmp / "script.jsonl"
        script.write_text("\n".join(json.dumps(reply) for _, replies in rollouts for reply in replies))
        log = stack.enter_context((tmp / "engine.log").open("wb"))
        engine = start_engine(ensure_tiny_model(), "--script", str(script), output=log)
        stack.callback(engine.stop)
        port, capture = free_port(), free_port()
        command = [sys.executable, "-m", "harness_trainer.cli", "serve", "--dataset", str(TASKS)]
        command += ["--upstream", engine.url, "--port", str(port), "--capture-port", str(capture)]
        command += ["--data-dir", str(tmp / "capture"), "--max-concurrent-envs", "2"]
        tags = (f"127.0.0.1:{port}", f"127.0.0.1:{capture}", str(tmp))
        server = start_healthy(stack, "server", command, port, tags, {"TMPDIR": str(tmp)})
        proxy = proxy_pid(server)
        for harness in harnesses:
            rows[harness], cpu_ms = run_agent(server.url, harness, args.runs, proxy)
            if cpu_ms is not None:
                proxy_cpu[harness] = cpu_ms
    return tags


def run_agent(
    server_url: str, harness: str, runs: int, proxy: int | None
) -> tuple[list[dict[str, Any]], float | None]:
    """``runs`` rollouts of ``harness``, one at a time: each one's measurements, and the proxy's CPU
    milliseconds per model call over them (None: no proxy process, or no call)."""
    from harness_trainer.devloop.prompts import dev_harness_options
    from harness_trainer.rollouts.client.factory import HarborSessionFactory

    factory = HarborSessionFactory(
        server_url, split=SPLIT, harness=harness, sandbox="local", agent_timeout_sec=300,
        harness_options=dev_harness_options(harness),
    )  # fmt: skip
    rows = []
    try:
        index = next(t["index"] for t in factory.tasks() if t["name"] == TASK)
        cpu_before = run_seconds(proxy) if proxy is not None else 0.0
        for attempt in range(runs):
            requested = time.time()
            session = factory.create(index)
            try:
                session.wait_for_completion()
                result = session.result.model_dump() if session.result is not None else {}
                if result.get("error") is None:
                    result["trace"] = session.fetch_training_trace().model_dump()
            finally:
                session.close()
            row = {
                "startup_s": startup_s(requested, result),
                "proxy_ms": proxy_ms(result),
                "agent_s": float((result.get("phase_seconds") or {}).get("agent", 0.0)),
                "model_calls": int(result.get("model_calls", 0)),
                "reward": result.get("reward"),
                "error": result.get("error"),
            }
            rows.append(row)
            shown = "-" if row["startup_s"] is None else f"{row['startup_s']:.2f} s"
            print(f"{harness} {attempt + 1}/{runs}: first call after {shown}, {row['model_calls']} calls, "
                  f"reward {row['reward']}", flush=True)  # fmt: skip
        calls = sum(row["model_calls"] for row in rows)
        cpu_ms = (run_seconds(proxy) - cpu_before) * 1000 / calls if proxy is not None and calls else None
    finally:
        factory.close()
    return rows, cpu_ms


def summary(rows: list[dict[str, Any]], cpu_ms_per_call: float | None) -> dict[str, Any]:
    """One agent's medians (and worst start-up) over its runs."""
    startups = [r["startup_s"] for r in rows if r["startup_s"] is not None]
    overheads = [ms for r in rows for ms in r["proxy_ms"]]
    return {
        "startup_s": statistics.median(startups) if startups else None,
        "startup_worst_s": max(startups) if startups else None,
        "agent_s": statistics.median(r["agent_s"] for r in rows),
        "model_calls": statistics.median(r["model_calls"] for r in rows),
        "proxy_cpu_ms_per_call": cpu_ms_per_call,
        "proxy_ms_per_call": statistics.median(overheads) if overheads else None,
        "solved": sum(r["reward"] == 1.0 for r in rows),
        "runs": len(rows),
        "errors": sorted({r["error"] for r in rows if r["error"]}),
    }


def print_report(result: dict[str, Any]) -> None:
    rows = [("agent", "start-up to 1st call", "worst", "agent phase", "calls", "proxy CPU/call", "proxy/call",
             "solved")]  # fmt: skip
    for name, s in result["agents"].items():
        rows.append((
            name, _s(s["startup_s"]), _s(s["startup_worst_s"]), _s(s["agent_s"]), f"{s['model_calls']:g}",
            _ms(s["proxy_cpu_ms_per_call"]), _ms(s["proxy_ms_per_call"]), f"{s['solved']}/{s['runs']}",
        ))  # fmt: skip
    print_table(rows)
    print_verdicts(result, 80)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} ms"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="one run per agent")
    add("--runs", type=positive, default=3)
    add("--only", type=lambda text: text.split(","), default=None, help="these harnesses (and the toy)")
    add("--json", type=Path, default=None, help="write the result here")
    add("--strict", action="store_true", help="exit 1 on a missed target")
    args = parser.parse_args(argv)
    if args.quick:
        args.runs = 1
    return finish(run(args), args, print_report)


if __name__ == "__main__":
    sys.exit(main())
