"""E2B sandbox starts against a fake cloud with injected latencies: the agent's bundle in the template
against a per-rollout network install, and 256 rollouts asking for 16 environments at once.

The cloud is the tests' fake E2B (``tests/sandboxes/fake_e2b.py``: commands and template builds really run,
locally, each sandbox chrooted into an overlay of its template's image exported from the Docker daemon; it
needs root and ``scripts/setup_docker.sh``), so this benchmark runs from a repository checkout. The E2B
backend (``E2BSandboxBackend``, its ``TemplateBuilder``) and, for the burst, the ``SandboxSupervisor`` are
the real ones; only the SDK objects are fakes, with the SDK's signatures.

**Agent in the template** (part 1). One task whose image has Node (a Debian image with Node and npm from
the npm registry's packages: the only kind of image where a per-rollout install can work at all), two
backends on one cloud: one is given the harness's agent bundle (``provide``, what every rollout does: the
bundle becomes the template's last layer), the other not. Both templates are built first (a template build
is paid once per environment, not per rollout; its time is reported). Then, ``--agent-repeats`` times,
alternating the arms, one rollout's start overhead as ``rollouts/run.py`` pays it: ``backend.start``
(create + the backend's ``mkdir``) plus ``harness.install`` (bundle: the check that finds it; install: the
warned fallback, the real ``npm install`` of the pinned agent inside the sandbox, over the network from the
npm registry, as a sandbox without the bundle pays it). Ratio: per-rollout install overhead over bundle
overhead, paired by repeat.

**Burst** (part 2). ``--rollouts`` starts (256) of ``--environments`` tasks (16, each its own Dockerfile,
so its own template), submitted at once group by group (a GRPO group of ``rollouts / environments``
members per task, as the trainer asks), through ``SandboxSupervisor`` with the settings ``serve`` would use
against E2B: ``max_starts_in_flight`` 32 (``--max-sandbox-starts``' default), ``max_starts_per_s`` = the
account's create rate, ``start_jitter_s`` 2 s (the CLI's E2B example). Measured from the submission to the
last sandbox started (T_last); compared with the issue's yardstick, the slowest single build (measured in
the fake, request to ready) plus ``rollouts / create rate`` (creates of ready templates can overlap the
slowest build, so a ratio under 1 is possible; under ``max`` of the two it is not). Every one of the 256
sandboxes is really created (a namespace each: 3 processes, about 5 MB) and stays open until the last
started; all are closed after the measurement. ``--repeats`` times, each with a fresh cloud and seed.

**Injected latencies** (real-world numbers; every duration is multiplied by ``--scale``, every rate
divided by it, so a full run takes minutes instead of an hour):

- create: uniform 0.5-1.0 s per sandbox (an assumption for the API call plus boot as the SDK sees it; E2B
  documents restoring a template snapshot in about 80 ms, https://e2b.dev/docs/template/how-it-works);
- create rate: 5 sandboxes/s per team, E2B's Pro plan (Hobby: 1/s; https://e2b.dev/docs/sandbox/rate-limits),
  modelled as a token bucket 5 deep (the depth is an assumption); a create over it is answered 429, which the
  SDK's transport retries 3 times with its own backoff (``e2b.retry``, 0.1 s doubling, jittered) and then
  raises ``RateLimitException``, which the backend retries as it does (every ``*backoff_s`` option of
  ``E2BSandboxBackend`` at its default, scaled);
- template build: 30 s to 120 s, spread evenly over the environments (an assumption for a task image of a
  few layers; E2B does not publish build times); the fake also runs each build's steps for real;
- not modelled: the concurrent-sandbox cap (Pro: 100, up to 1,100 with an add-on; 256 needs the add-on),
  network time of commands, a ``Retry-After`` header.

Part 1 runs unscaled (its install is real time). A sandbox of a template is an overlay on the template's
filesystem (nothing is copied per create, as E2B restores a snapshot).

Targets (fixed before any run): the bundle's start overhead at least 10x smaller than the per-rollout
install's (median of the paired ratios; the issue's target, on opencode); exactly one build per distinct
environment; T_last within 1.5x of (slowest build + rollouts / create rate), with every sandbox started.

Run: ``python -m benchmarks.e2b_starts [--quick] [--json OUT] [--scale 0.25] [--repeats 3]
[--agent opencode] [--rollouts 256] [--environments 16]``; ``--quick``: 64 rollouts, 4 environments,
scale 0.05, one repeat, one pair of agent starts.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: its siblings import from the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import finish, positive, print_table, print_verdicts

REAL = {
    "create_s": (0.5, 1.0),
    "create_rate_per_s": 5.0,
    "create_burst": 5,
    "build_s": (30.0, 120.0),
    "start_jitter_s": 2.0,
    "max_starts_in_flight": 32,
}
MAX_BOUND_RATIO = 1.5
MIN_BUNDLE_SPEEDUP = 10.0
NPM_AGENTS = ("opencode", "codex", "claude-code")
NPM = ("npm", "10.9.2")
"""The npm the install arm's image runs (from the registry, beside Node from the bundles' ``NODE``)."""
TARGETS = (
    f"agent start with its bundle in the template at least {MIN_BUNDLE_SPEEDUP:g}x faster than a per-rollout "
    "network install (median)",
    "one template build per distinct environment",
    f"last start within {MAX_BOUND_RATIO:g}x (slowest build + rollouts / create rate), none failed",
)


def write_task(root: Path, name: str, dockerfile: str) -> Any:
    """A Harbor task folder with ``dockerfile`` as its environment, as a ``HarborTask``."""
    from harness_trainer.tasks.task import EnvironmentSpec, HarborTask

    folder = root / name
    (folder / "environment").mkdir(parents=True)
    (folder / "tests").mkdir()
    (folder / "task.toml").write_text('version = "1.0"\n')
    (folder / "instruction.md").write_text("Nothing to do.\n")
    (folder / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    (folder / "environment" / "Dockerfile").write_text(dockerfile)
    return HarborTask(
        name=name, path=folder, instruction="Nothing to do.", config={}, agent_timeout_sec=600,
        verifier_timeout_sec=60, environment=EnvironmentSpec(),
    )  # fmt: skip


# ------------------------------------------------------------------------------------ part 1: the agent


NODE_DOCKERFILE = """FROM debian:bookworm-slim
COPY node/bin/node /usr/local/bin/node
COPY npm/ /usr/local/lib/node_modules/npm/
RUN ln -s /usr/local/lib/node_modules/npm/bin/npm-cli.js /usr/local/bin/npm && node --version && npm --version
WORKDIR /app
"""


def node_task(root: Path) -> Any:
    """A task whose image has Node and npm, both from the npm registry's packages."""
    from harness_trainer.harnesses.bundles import NODE, fetch_npm
    from harness_trainer.harnesses.tools import NativeBinary

    task = write_task(root, "agent-task", NODE_DOCKERFILE)
    fetch_npm(NODE, task.environment_dir / "node")
    fetch_npm(NativeBinary(NPM[0], NPM[1], "bin/npm-cli.js"), task.environment_dir / "npm")
    return task


async def agent_starts(agent: str, repeats: int, tmp: Path) -> dict[str, Any]:
    """Part 1 (see the module docstring): start overhead with the agent's bundle in the template and
    with a per-rollout network install."""
    from harness_trainer.harnesses import make_harness
    from harness_trainer.harnesses.bundles import agent_path, provision
    from harness_trainer.sandboxes.e2b import E2BSandboxBackend
    from tests.sandboxes.fake_e2b import FakeE2BCloud, FakeLatency

    harness = make_harness(agent)
    package = harness.package
    task = await asyncio.to_thread(node_task, tmp / "tasks")
    cloud = FakeE2BCloud(tmp / "cloud-agent", latency=FakeLatency(create_s=REAL["create_s"]))
    common = {"sandbox_class": cloud, "template_class": cloud.template_class, "build_log_dir": tmp / "logs"}
    backends = {"install": E2BSandboxBackend(**common), "bundle": E2BSandboxBackend(**common)}
    backends["bundle"].provide([await provision(package)])
    arms: dict[str, dict[str, Any]] = {}
    try:
        for arm, backend in backends.items():
            build = await backend.template_builder.ensure(task)
            arms[arm] = {
                "template": build.name,
                "template_build_s": build.seconds,
                "create_s": [],
                "install_s": [],
                "overhead_s": [],
            }
            print(f"agent: {arm} template built in {build.seconds:.1f} s", flush=True)
        for repeat in range(repeats):
            for arm, backend in backends.items():
                started = time.perf_counter()
                sandbox = await backend.start(task, lifetime_s=900)
                created = time.perf_counter()
                await harness.install(sandbox)
                installed = time.perf_counter()
                path = agent_path(sandbox, package)
                check = await sandbox.exec(f"test -x {path} && du -sm $(dirname $(dirname {path}))")
                await sandbox.close()
                if check.exit_code != 0:
                    raise RuntimeError(f"{arm}: no {path} after the install: {check.stderr}")
                arms[arm]["installed_mb"] = int(check.stdout.split()[0])
                for key, seconds in (("create_s", created - started), ("install_s", installed - created)):
                    arms[arm][key].append(seconds)
                arms[arm]["overhead_s"].append(installed - started)
                print(f"agent {repeat + 1}/{repeats} {arm}: create {created - started:.2f} s, "
                      f"install {installed - created:.2f} s", flush=True)  # fmt: skip
    finally:
        for backend in backends.values():
            await backend.aclose()
    ratios = [a / b for a, b in zip(arms["install"]["overhead_s"], arms["bundle"]["overhead_s"], strict=True)]
    for values in arms.values():
        values["median_s"] = statistics.median(values["overhead_s"])
    return {"harness": agent, "package": package.spec, **arms, "ratios": ratios}


# ------------------------------------------------------------------------------------- part 2: the burst


def build_seconds(environments: int, scale: float) -> list[float]:
    """Each environment's injected build time: ``REAL["build_s"]`` spread evenly, scaled."""
    low, high = REAL["build_s"]
    step = (high - low) / max(1, environments - 1)
    return [(low + step * k) * scale for k in range(environments)]


def scaled_backoffs(backend_class: type, scale: float) -> dict[str, float]:
    """Every ``*backoff_s`` option of the backend, at its default times ``scale`` (its retry waits are
    durations like any other)."""
    parameters = inspect.signature(backend_class).parameters.values()
    return {p.name: p.default * scale for p in parameters if p.name.endswith("backoff_s")}


async def burst(rollouts: int, environments: int, scale: float, seed: int, tmp: Path) -> dict[str, Any]:
    """Part 2 (see the module docstring): ``rollouts`` starts of ``environments`` templates at once."""
    from harness_trainer.sandboxes.e2b import E2BSandboxBackend
    from harness_trainer.sandboxes.e2b_templates import template_spec
    from harness_trainer.sandboxes.supervisor import SandboxSupervisor
    from tests.sandboxes.fake_e2b import FakeE2BCloud, FakeLatency

    random.seed(seed)
    tasks = [
        write_task(
            tmp / "tasks", f"env-{k}", f"FROM python:3.11-slim\nWORKDIR /app\nRUN echo {k} > /app/env\n"
        )
        for k in range(environments)
    ]
    durations = {
        template_spec(t).name: s for t, s in zip(tasks, build_seconds(environments, scale), strict=True)
    }
    rate = REAL["create_rate_per_s"] / scale
    low, high = REAL["create_s"]
    latency = FakeLatency(
        create_s=(low * scale, high * scale), build_s=durations.__getitem__, create_rate_per_s=rate,
        create_burst=REAL["create_burst"], retry_scale=scale,
    )  # fmt: skip
    cloud = FakeE2BCloud(tmp / "cloud", latency=latency)
    backend = E2BSandboxBackend(
        sandbox_class=cloud, template_class=cloud.template_class, build_log_dir=tmp / "logs",
        **scaled_backoffs(E2BSandboxBackend, scale),
    )  # fmt: skip
    supervisor = SandboxSupervisor(
        backend, max_starts_per_s=rate, max_starts_in_flight=REAL["max_starts_in_flight"],
        start_jitter_s=REAL["start_jitter_s"] * scale,
    )  # fmt: skip
    per_task = [task for task in tasks for _ in range(rollouts // environments)]
    per_task += tasks[: rollouts - len(per_task)]
    t0 = time.monotonic()

    async def start(task: Any) -> float:
        await supervisor.start(task, lifetime_s=600)
        return time.monotonic() - t0

    try:
        done = await asyncio.gather(*(start(task) for task in per_task), return_exceptions=True)
    finally:
        await supervisor.aclose()
    starts = sorted(d for d in done if isinstance(d, float))
    errors = [repr(d) for d in done if not isinstance(d, float)]
    builds = cloud.template_class.builds
    build_s = [b.finished_at - b.requested_at for b in builds if b.finished_at is not None]
    t_last = starts[-1] if starts else float("nan")
    bound = max(build_s) + rollouts / rate
    run = {
        "seed": seed, "t_last_s": t_last, "first_start_s": starts[0] if starts else None,
        "median_start_s": statistics.median(starts) if starts else None, "started": len(starts),
        "failed": len(errors), "errors": errors[:3], "builds": len(builds), "build_s": build_s,
        "max_build_s": max(build_s), "last_build_requested_s": max(b.requested_at for b in builds) - t0,
        "bound_s": bound, "ratio": t_last / bound, "create_calls": len(cloud.create_calls),
        "rate_limited": cloud.rate_limited, "rate_limit_errors": cloud.rate_limit_errors,
        "leftover_sandboxes": sum(not s.killed for s in cloud.sandboxes),
    }  # fmt: skip
    counts = f"{run['builds']} builds, {run['failed']} failed, {run['rate_limited']} 429s"
    print(
        f"burst seed {seed}: last start {t_last:.1f} s, bound {bound:.1f} s ({run['ratio']:.2f}x), {counts}"
    )
    return run


# ------------------------------------------------------------------------------------------------ run


def verdicts(
    config: dict[str, Any], agent: dict[str, Any], runs: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    builds = [r["builds"] for r in runs]
    ratios = [r["ratio"] for r in runs]
    failed = sum(r["failed"] for r in runs)
    median = statistics.median(ratios)
    speedup = statistics.median(agent["ratios"])
    return [
        {
            "target": TARGETS[0],
            "pass": speedup >= MIN_BUNDLE_SPEEDUP,
            "measured": f"{speedup:.1f}x (median of {len(agent['ratios'])}; {agent['package']}: "
            f"{agent['install']['median_s']:.2f} s vs {agent['bundle']['median_s']:.2f} s)",
        },
        {
            "target": TARGETS[1],
            "pass": all(b == config["environments"] for b in builds),
            "measured": f"{', '.join(map(str, builds))} builds for {config['environments']} environments",
        },
        {
            "target": TARGETS[2],
            "pass": median <= MAX_BOUND_RATIO and failed == 0,
            "measured": f"{median:.2f}x (median; worst {max(ratios):.2f}x), {failed} failed starts",
        },
    ]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    config = {
        "quick": args.quick, "scale": args.scale, "rollouts": args.rollouts,
        "environments": args.environments, "repeats": args.repeats, "agent_repeats": args.agent_repeats,
        "agent": args.agent, "real": REAL,
    }  # fmt: skip
    from harness_trainer.sandboxes.e2b import E2BSandboxBackend

    config["backoffs_s"] = scaled_backoffs(E2BSandboxBackend, args.scale)
    with tempfile.TemporaryDirectory(prefix="e2b-starts-", dir="/var/tmp") as scratch:
        tmp = Path(scratch)
        agent = await agent_starts(args.agent, args.agent_repeats, tmp / "agent")
        runs = [
            await burst(args.rollouts, args.environments, args.scale, seed, tmp / f"burst-{seed}")
            for seed in range(args.repeats)
        ]
    found = verdicts(config, agent, runs)
    return {
        "config": config,
        "agent": agent,
        "burst": runs,
        "verdicts": found,
        "all_pass": all(v["pass"] for v in found),
        "leftover_sandboxes": sum(r["leftover_sandboxes"] for r in runs),
        "elapsed_s": time.monotonic() - started,
    }


def print_report(result: dict[str, Any]) -> None:
    agent = result["agent"]
    rows = [("start overhead", "create (median)", "install (median)", "total (median)", "template build")]
    for arm in ("install", "bundle"):
        a = agent[arm]
        rows.append((
            f"{arm} ({agent['package']})", f"{statistics.median(a['create_s']):.2f} s",
            f"{statistics.median(a['install_s']):.2f} s", f"{a['median_s']:.2f} s",
            f"{a['template_build_s']:.1f} s",
        ))  # fmt: skip
    print_table(rows)
    print(f"per-rollout install / bundle: {statistics.median(agent['ratios']):.1f}x")
    rows = [("seed", "last start", "slowest build", "bound", "ratio", "builds", "failed", "429s")]
    for r in result["burst"]:
        rows.append((
            str(r["seed"]), f"{r['t_last_s']:.1f} s", f"{r['max_build_s']:.1f} s", f"{r['bound_s']:.1f} s",
            f"{r['ratio']:.2f}x", str(r["builds"]), str(r["failed"]), str(r["rate_limited"]),
        ))  # fmt: skip
    print_table(rows)
    print_verdicts(result, 80)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="64 rollouts, 4 environments, scale 0.05, one repeat")
    add("--scale", type=float, default=0.25, help="durations times this, rates divided by it (default 0.25)")
    add("--rollouts", type=positive, default=256)
    add("--environments", type=positive, default=16)
    add("--repeats", type=positive, default=3, help="bursts, each on a fresh cloud (default 3)")
    add("--agent-repeats", type=positive, default=5, help="start pairs in part 1 (default 5)")
    add("--agent", choices=NPM_AGENTS, default="opencode", help="the harness whose agent is installed")
    add("--json", type=Path, default=None, help="write the result here")
    add("--strict", action="store_true", help="exit 1 on a missed target")
    args = parser.parse_args(argv)
    if args.quick:
        args.rollouts, args.environments, args.scale, args.repeats, args.agent_repeats = 64, 4, 0.05, 1, 1
    return finish(asyncio.run(run(args)), args, print_report, leftovers_key="leftover_sandboxes")


if __name__ == "__main__":
    sys.exit(main())
