"""``harness-trainer e2b build-templates | cleanup | smoke``: the E2B commands, their flags and handlers.

Each handler checks ``E2B_API_KEY`` before any cloud call; the E2B SDK and the rest load only then, so
``--help`` stays instant. The handlers' ``sandbox_class`` / ``template_class`` are the SDK boundary
(``e2b.AsyncSandbox`` / ``e2b.AsyncTemplate`` by default; the tests pass a fake cloud).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from harness_trainer.launch.flag_types import non_negative_int
from harness_trainer.signals import run_interruptible


def add_e2b_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``e2b`` command's three subcommands, each with its flags and handler, on ``parser``."""
    e2b = parser.add_subparsers(dest="e2b_command", required=True)
    templates = e2b.add_parser(
        "build-templates", help="build the E2B template of every task of a dataset (once per environment)"
    )
    templates.add_argument("dataset", help="a folder of task splits, or a Hugging Face dataset id")
    templates.add_argument("--split", action="append", help="only this split (repeatable; default: all)")
    templates.add_argument("--jobs", type=int, default=4, help="builds at once")
    templates.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        help="seconds per build when the task sets no build_timeout_sec",
    )
    templates.add_argument("--log-dir", type=Path, default=None, help="build logs (default: the cache)")
    templates.add_argument(
        "--rebuild", action="store_true", help="build even when E2B already has the name (a failed build)"
    )
    templates.add_argument(
        "--agent", action="append", metavar="HARNESS",
        help="put this harness's agent bundle in every template (repeatable; as `serve --e2b-agent`: a "
        "rollout also puts its own harness's, so a prebuilt run needs its harness here)",
    )  # fmt: skip
    templates.set_defaults(func=_e2b_build_templates)
    cleanup = e2b.add_parser("cleanup", help="kill every E2B sandbox of a run (a server that died left them)")
    cleanup.add_argument("--run", required=True, help="the run id (serve --run-id)")
    cleanup.set_defaults(func=_e2b_cleanup)
    smoke = e2b.add_parser(
        "smoke", help="one live rollout in E2B: template, sandbox, agent through a capture proxy, verifier"
    )
    smoke.add_argument("--task", type=Path, default=None, help="a Harbor task folder")
    smoke.add_argument(
        "--engine-url", default=None, help="the OpenAI-compatible engine the capture proxy forwards to"
    )
    smoke.add_argument("--model", default=None, help="served model name (default: the engine's /v1/models)")
    smoke.add_argument(
        "--proxy-public-url", default=None,
        help="how the E2B sandbox reaches the capture proxy started here, e.g. a tunnel to --proxy-port "
        "(`cloudflared tunnel --url http://127.0.0.1:8300`); never this machine's loopback",
    )  # fmt: skip
    smoke.add_argument("--proxy-host", default="127.0.0.1", help="where the capture proxy binds")
    smoke.add_argument("--proxy-port", type=int, default=8300, help="the capture proxy's port")
    smoke.add_argument("--harness", default="mini-swe-agent", help="the agent (default mini-swe-agent)")
    smoke.add_argument(
        "--agent-timeout-sec", type=float, default=None, help="seconds for the agent (default: the task's)"
    )
    smoke.add_argument(
        "--step-limit", type=non_negative_int, default=20, help="agent steps (default 20; 0: the agent's)"
    )
    smoke.add_argument(
        "--e2b-agent", action="append", metavar="HARNESS",
        help="preinstall this harness's pinned agent in the task's template (repeatable; as serve's)",
    )  # fmt: skip
    smoke.add_argument(
        "--sandbox-only", action="store_true",
        help="only start one sandbox from --template and check exec, timeouts and files (no task, no agent)",
    )  # fmt: skip
    smoke.add_argument("--template", default="base", help="the template for --sandbox-only")
    smoke.set_defaults(func=_e2b_smoke)


def agent_names(names: list[str] | None, flag: str) -> tuple[str, ...] | None:
    """The harnesses ``names`` whose agent bundles go into every template; None (said on stderr) when one
    is unknown."""
    from harness_trainer.harnesses import HARNESSES

    unknown = sorted(set(names or ()) - set(HARNESSES))
    if unknown:
        known = ", ".join(sorted(HARNESSES))
        print(f"error: {flag}: unknown harness {', '.join(unknown)}; known: {known}", file=sys.stderr)
        return None
    return tuple(dict.fromkeys(names or ()))


async def _bundles(names: tuple[str, ...]) -> list[Any]:
    """The agent bundles of the harnesses ``names`` (built once per machine)."""
    from harness_trainer.harnesses import HARNESSES
    from harness_trainer.harnesses.bundles import provision

    return [await provision(package) for name in names if (package := HARNESSES[name].package) is not None]


def _e2b_cleanup(args: argparse.Namespace, sandbox_class: object = None) -> int:
    """Kill every E2B sandbox labelled with run ``args.run``; ``sandbox_class`` is the SDK boundary
    (``e2b.AsyncSandbox`` by default; tests pass a fake)."""
    import os

    if not os.environ.get("E2B_API_KEY"):
        print(
            "error: E2B_API_KEY is not set: finding a run's E2B sandboxes needs an E2B API key",
            file=sys.stderr,
        )
        return 2
    return run_interruptible(_e2b_cleanup_run(args.run, sandbox_class))


async def _e2b_cleanup_run(run_id: str, sandbox_class: object = None) -> int:
    from harness_trainer.sandboxes.e2b_runs import kill_run

    if sandbox_class is None:
        from e2b import AsyncSandbox as sandbox_class
    try:
        removed = await kill_run(sandbox_class, run_id)
    except Exception as exc:  # the SDK's errors (auth, network) are reported, not a traceback
        print(f"error: cannot list the E2B sandboxes and snapshots of run {run_id}: {exc}", file=sys.stderr)
        return 1
    print(f"removed {removed.describe()} of run {run_id}")
    return 0


def _e2b_build_templates(args: argparse.Namespace, template_class: object = None) -> int:
    """Build every distinct E2B template of a dataset ahead of a run; ``template_class`` is the SDK
    boundary (``e2b.AsyncTemplate`` by default; tests pass a fake)."""
    import os

    if not os.environ.get("E2B_API_KEY"):
        print("error: E2B_API_KEY is not set: building E2B templates needs an E2B API key", file=sys.stderr)
        return 2
    from harness_trainer.sandboxes.e2b_templates import TemplateBuild, TemplateBuilder, build_all
    from harness_trainer.tasks.sources import open_task_source
    from harness_trainer.tasks.task import TaskError

    if (agents := agent_names(args.agent, "--agent")) is None:
        return 2
    try:
        source = open_task_source(args.dataset)
        tasks = [task for split in (args.split or source.splits()) for task in source.tasks(split)]
    except (TaskError, OSError, LookupError, ValueError) as exc:
        print(f"error: cannot load tasks from {args.dataset}: {exc}", file=sys.stderr)
        return 2
    from harness_trainer.harnesses.base import HarnessError

    builder = TemplateBuilder(
        template_class, timeout_s=args.timeout, log_dir=args.log_dir, rebuild=args.rebuild
    )
    try:
        builder.provide(run_interruptible(_bundles(agents)))
    except HarnessError as exc:
        print(f"error: --agent: {exc}", file=sys.stderr)
        return 2
    try:
        from tqdm import tqdm

        bar = tqdm(desc="E2B templates", unit="template", file=sys.stdout)
        say, tick = bar.write, bar.update
    except ImportError:
        bar, say, tick = None, print, lambda n: None

    def planned(count: int) -> None:
        if bar is not None:
            bar.reset(total=count)
        else:
            print(f"{len(tasks)} tasks, {count} templates to build or find")

    def report(name: str, task_names: list[str], done: object) -> None:
        who = ", ".join(task_names[:3]) + (f" +{len(task_names) - 3}" if len(task_names) > 3 else "")
        if isinstance(done, TemplateBuild):
            took = f" in {done.seconds:.1f} s" if done.status == "built" else ""
            say(f"{done.status} {name}{took} ({who})")
        else:
            say(f"FAILED {name} ({who}): {done}")
        tick(1)

    try:
        summary = run_interruptible(
            build_all(tasks, builder, jobs=args.jobs, on_planned=planned, on_done=report)
        )
    finally:
        if bar is not None:
            bar.close()
    named = f", {len(summary.named)} tasks name their own template" if summary.named else ""
    print(f"E2B templates: {len(summary.built)} built, {len(summary.reused)} reused, "
          f"{len(summary.failed)} failed{named} (build logs: {builder.log_dir})")  # fmt: skip
    return 1 if summary.failed else 0


def _e2b_smoke(args: argparse.Namespace, sandbox_class: object = None, template_class: object = None) -> int:
    """One live rollout in E2B (or, with ``--sandbox-only``, one sandbox's checks); ``sandbox_class`` and
    ``template_class`` are the SDK boundary (``e2b.AsyncSandbox`` / ``e2b.AsyncTemplate`` by default;
    tests pass the fake cloud)."""
    import os

    if not os.environ.get("E2B_API_KEY"):
        print("error: E2B_API_KEY is not set: the E2B smoke test needs an E2B API key", file=sys.stderr)
        return 2
    from harness_trainer.launch.e2b_smoke import SmokeConfig, smoke, smoke_rollout

    if args.sandbox_only:
        try:
            return run_interruptible(smoke(args.template, sandbox_class))
        except KeyboardInterrupt:
            print("interrupted: the sandbox was closed", file=sys.stderr)
            return 130
    from harness_trainer.harnesses import HARNESSES
    from harness_trainer.tasks.loader import load_task
    from harness_trainer.tasks.task import TaskError

    missing = [flag for flag, value in (("--task", args.task), ("--engine-url", args.engine_url),
               ("--proxy-public-url", args.proxy_public_url)) if not value]  # fmt: skip
    if missing:
        print(f"error: e2b smoke needs {', '.join(missing)} (or --sandbox-only)", file=sys.stderr)
        return 2
    if args.harness not in HARNESSES:
        known = ", ".join(sorted(HARNESSES))
        print(f"error: unknown harness {args.harness!r}; known: {known}", file=sys.stderr)
        return 2
    if (agents := agent_names(args.e2b_agent, "--e2b-agent")) is None:
        return 2
    try:
        task = load_task(args.task)
    except (TaskError, OSError) as exc:
        print(f"error: cannot load the task {args.task}: {exc}", file=sys.stderr)
        return 2
    config = SmokeConfig(
        task=task,
        engine_url=args.engine_url,
        proxy_public_url=args.proxy_public_url,
        model=args.model,
        proxy_host=args.proxy_host,
        proxy_port=args.proxy_port,
        harness=args.harness,
        agent_timeout_sec=args.agent_timeout_sec,
        step_limit=args.step_limit,
        agents=agents,
    )
    run = smoke_rollout(config, sandbox_class=sandbox_class, template_class=template_class)
    try:
        return run_interruptible(run)
    except KeyboardInterrupt:  # asyncio.run cancelled the smoke test, whose cleanup ran first
        print("FAIL: interrupted (the sandbox was killed and the capture proxy stopped)", flush=True)
        return 130
