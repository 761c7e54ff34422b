"""Live checks of the E2B backend, for users with ``E2B_API_KEY`` (the CI cannot reach E2B).

``harness-trainer e2b smoke --task DIR --engine-url URL --proxy-public-url URL`` (:func:`smoke_rollout`):
one rollout through the project's own rollout path
(:class:`~harness_trainer.rollouts.server.runtime.RolloutRuntime` with ``sandbox="e2b"``, then
:func:`~harness_trainer.rollouts.server.run.run_rollout`), in this order of work:

1. start the capture proxy on ``proxy_host:proxy_port`` in front of the engine, and learn the served model
   from the engine's ``/v1/models`` unless one is given;
2. build the task's template, or find it in the E2B account (the backend's own ``TemplateBuilder``, with
   the harness's agent bundle as its last layers, and those of ``agents``), timed on its own;
3. the rollout: a sandbox from that template (``create``), the harness's agent install, the agent
   (mini-swe-agent by default) pointed at ``proxy_public_url``, the upload of the task's
   ``tests/``, the task's verifier, the trace export, then sandbox kill and capture-session delete;
4. print one line per phase with its seconds (the rollout's own ``phase_seconds``), the reward, the
   trace's turn count, and ``ok`` or ``FAIL: <reason>``.

Every path stops what it started: the sandbox is killed and the proxy stopped on success, on failure and on
cancellation (Ctrl-C cancels the main task under ``asyncio.run``: the rollout's own cleanup runs, then the
runtime's). A command killed with SIGKILL leaves its sandbox to E2B's timeout; every sandbox carries the
printed run id, so ``harness-trainer e2b cleanup --run ID`` kills it sooner. Passes (status 0) when the
agent ran (no install, sandbox or proxy error, at least one model call through the proxy) and the
verifier produced a reward, whatever its value.

E2B sandboxes are remote: they reach the proxy at ``proxy_public_url`` (e.g. a tunnel to
``proxy_host:proxy_port``), never at this machine's loopback. ``sandbox_class`` and ``template_class`` are
the SDK boundary; the tests pass the fake cloud, whose sandboxes share this host's network, so there a
loopback URL is allowed.

``--sandbox-only`` (:func:`smoke`, also ``python -m harness_trainer.launch.e2b_smoke --smoke``): starts one
sandbox from a named template (``base``), checks exec (output, env, exit code), a timeout that must kill the
whole process group, and a file round trip through ``/logs``, then closes it; one line per check.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from harness_trainer.sandboxes.base import SandboxStartError
from harness_trainer.sandboxes.e2b import E2BSandboxBackend
from harness_trainer.signals import run_interruptible
from harness_trainer.tasks.task import HarborTask, bare_task

# The rollout's phases in the order they run, with the names printed for them.
PHASES = {
    "capture_session": "session",
    "sandbox_start": "create",
    "install": "install",
    "agent": "agent",
    "upload": "upload",
    "verifier": "verifier",
    "trace": "trace",
    "cleanup": "cleanup",
}
PHASE_NOTES = {
    "sandbox_start": "the E2B sandbox from the template",
    "upload": "the task's tests/, into the sandbox",
    "verifier": "runs tests/test.sh, reads the reward",
    "cleanup": "sandbox killed, capture session deleted",
}
_LOG_LINES = 20


@dataclass(frozen=True)
class SmokeConfig:
    """What ``harness-trainer e2b smoke`` runs; see the module docstring."""

    task: HarborTask
    engine_url: str
    """The OpenAI-compatible engine the capture proxy forwards to."""
    proxy_public_url: str
    """How the E2B sandbox reaches the capture proxy started here (a tunnel to ``proxy_host:proxy_port``)."""
    model: str | None = None
    """The served model name; None: the engine's first ``/v1/models`` entry."""
    proxy_host: str = "127.0.0.1"
    proxy_port: int = 8300
    harness: str = "mini-swe-agent"
    agent_timeout_sec: float | None = None
    """None: the task's ``[agent] timeout_sec``."""
    step_limit: int = 20
    agents: tuple[str, ...] = ()
    """Harnesses whose agent bundles the template carries besides the rollout's own (``--e2b-agent``)."""


async def smoke_rollout(
    config: SmokeConfig,
    *,
    sandbox_class: Any = None,
    template_class: Any = None,
    say: Callable[[str], None] = print,
) -> int:
    """Run one rollout of ``config.task`` in E2B and print each phase; returns the exit status (0 ok, 1
    FAIL, 2 a usage error found before anything started)."""
    from harness_trainer.rollouts.server.runtime import LOOPBACK_HOSTS, RolloutRuntime, RuntimeConfig

    if sandbox_class is None and urlsplit(config.proxy_public_url).hostname in LOOPBACK_HOSTS:
        say(
            f"error: --proxy-public-url {config.proxy_public_url} is this machine's loopback, which an E2B "
            "sandbox cannot reach: expose the proxy (e.g. a tunnel) and give its public URL"
        )
        return 2
    run_id = f"smoke-{secrets.token_hex(4)}"
    e2b_options: dict[str, Any] = {"run_id": run_id}
    if sandbox_class is not None:
        e2b_options["sandbox_class"] = sandbox_class
    if template_class is not None:
        e2b_options["template_class"] = template_class
    with tempfile.TemporaryDirectory(prefix="ht-e2b-smoke-") as data_dir:
        runtime = RolloutRuntime(
            RuntimeConfig(
                upstream=config.engine_url,
                data_dir=Path(data_dir),
                capture_host=config.proxy_host,
                capture_port=config.proxy_port,
                public_url=config.proxy_public_url,
                served_model=config.model,
                sandbox_options={"e2b": e2b_options},
                agents=config.agents,
            )
        )
        try:
            return await _run(runtime, config, run_id, say)
        finally:
            await runtime.aclose()  # cancelled rollouts already killed their sandboxes; this stops the proxy


async def _run(runtime: Any, config: SmokeConfig, run_id: str, say: Callable[[str], None]) -> int:
    from harness_trainer.rollouts.result import RolloutOptions

    try:
        await runtime.start()
    except (OSError, RuntimeError) as exc:  # a taken port, an engine that does not answer /v1/models
        say(f"FAIL: cannot start the capture proxy on {runtime.capture_url} for {config.engine_url}: {exc}")
        return 1
    say(
        f"E2B smoke: task {config.task.name}, harness {config.harness}, model {runtime.model}; capture proxy "
        f"{runtime.capture_url}, reached by the sandbox at {config.proxy_public_url}; run id {run_id}"
    )
    backend: E2BSandboxBackend = runtime.backend("e2b").backend  # the supervisor's E2B backend
    started = time.monotonic()
    try:
        template = await _template(backend, config.task)
    except SandboxStartError as exc:
        say(_phase_line("template", time.monotonic() - started, "failed"))
        say(f"FAIL: {exc}")
        return 1
    say(_phase_line("template", time.monotonic() - started, template))
    options = RolloutOptions(
        harness=config.harness,
        sandbox="e2b",
        agent_timeout_sec=config.agent_timeout_sec,
        agent_step_limit=config.step_limit,
    )
    result = await runtime.rollout(config.task, options)
    for phase, name in PHASES.items():
        if phase in result.phase_seconds:
            note = PHASE_NOTES.get(phase, "")
            if phase == "agent":
                note = f"exit {result.exit_code}{', timed out' if result.timed_out else ''}, "
                note += f"{result.model_calls} model calls, {result.tool_call_count} tool calls"
            say(_phase_line(name, result.phase_seconds[phase], note))
    say(f"reward {result.reward} ({result.reward_detail or 'no verifier run'})")
    say(f"turns {len((result.trace or {}).get('turns', []))}")
    problem = _failure(result, config.proxy_public_url)
    if problem is None:
        say("ok")
        return 0
    if result.log_tail:
        say("agent log (last lines):")
        for line in result.log_tail.splitlines()[-_LOG_LINES:]:
            say(f"  {line}")
    say(f"FAIL: {problem}")
    return 1


async def _template(backend: E2BSandboxBackend, task: HarborTask) -> str:
    """Build or find the task's template now, so its time is not the sandbox create's; says which."""
    named = backend.named_template(task)
    if named is not None:
        return f"{named} (named for the task)"
    build = await backend.template_builder.ensure(task)
    return f"{build.status} {build.name}"


def _failure(result: Any, public_url: str) -> str | None:
    """Why the rollout does not show a working E2B path; None when the agent ran and a reward came back."""
    if result.error is not None:
        return str(result.error)
    if result.model_calls == 0:
        return f"the agent made no model call through the capture proxy: can the sandbox reach {public_url}?"
    if result.reward is None:
        return f"the verifier produced no reward: {result.reward_detail}"
    return None


def _phase_line(name: str, seconds: float, note: str = "") -> str:
    return f"{name:<9}{seconds:9.2f} s" + (f"  {note}" if note else "")


async def smoke(template: str, sandbox_class: Any = None) -> int:
    """Start one real E2B sandbox, exercise it, close it; prints each check. Returns the exit status."""
    with tempfile.TemporaryDirectory() as folder:
        task = bare_task("e2b-smoke", Path(folder))
        backend = E2BSandboxBackend(template=template, sandbox_class=sandbox_class)
        sandbox = await backend.start(task, lifetime_s=120, env={"HT_SMOKE": "1"})
        try:
            checks = {
                "exec": (await sandbox.exec("echo $HT_SMOKE $X", env={"X": "2"})).stdout.strip() == "1 2",
                "exit code": (await sandbox.exec("exit 7")).exit_code == 7,
                "timeout": (await sandbox.exec("sleep 30 & sleep 30", timeout_s=2)).timed_out,
                # the whole command line: a sandbox's init may run a `sleep` of its own
                "group killed": (await sandbox.exec("pgrep -f '^sleep 30$' || true")).stdout.strip() == "",
            }
            await sandbox.write_file("/logs/verifier/reward.txt", "1\n")
            checks["files"] = await sandbox.read_file("/logs/verifier/reward.txt") == b"1\n"
        finally:
            await sandbox.close()
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    return 0 if all(checks.values()) else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m harness_trainer.launch.e2b_smoke --smoke``: the sandbox-only check."""
    parser = argparse.ArgumentParser(description="E2B sandbox backend tools")
    parser.add_argument("--smoke", action="store_true", help="run the manual smoke test (needs E2B_API_KEY)")
    parser.add_argument("--template", default="base", help="E2B template for the smoke test")
    args = parser.parse_args(argv)
    if not args.smoke:
        parser.print_help()
        return 2
    if not os.environ.get("E2B_API_KEY"):
        print("E2B_API_KEY is not set: the smoke test needs an E2B account", file=sys.stderr)
        return 2
    with contextlib.suppress(KeyboardInterrupt):
        return run_interruptible(smoke(args.template))
    return 130


if __name__ == "__main__":
    sys.exit(main())
