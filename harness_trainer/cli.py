"""The ``harness-trainer`` command. Parses arguments, then imports the heavy libraries it needs late,
so ``--help`` answers at once."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from harness_trainer.signals import run_interruptible


def _tiny_model(args: argparse.Namespace) -> int:
    from harness_trainer.models.tiny import ensure_tiny_model

    try:
        print(ensure_tiny_model(args.out))
    except FileExistsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _engine(args: argparse.Namespace) -> int:
    import torch

    from harness_trainer.dev_engine import load_engine, serve
    from harness_trainer.dev_engine.script import ScriptError
    from harness_trainer.models.tiny import ensure_tiny_model

    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model or str(ensure_tiny_model())
    try:
        state = load_engine(
            model,
            served_model_name=args.served_model_name,
            max_model_len=args.max_model_len,
            script=args.script,
            seed=args.seed,
        )
    except (OSError, ValueError, ScriptError) as exc:
        print(f"error: cannot start the dev engine: {exc}", file=sys.stderr)
        return 2
    print(
        f"dev engine: serving {state.config.served_model_name} on http://{args.host}:{args.port}/v1"
        + (f" (scripted by {args.script})" if args.script else ""),
        flush=True,
    )
    serve(state, host=args.host, port=args.port)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from harness_trainer.demo import run_demo

    return run_demo(port=args.port)


def _proxy(args: argparse.Namespace) -> int:
    from capture_proxy.cli import serve

    return serve(args)


def _proxy_trace(args: argparse.Namespace) -> int:
    from capture_proxy.assembly import UntrainableSession
    from capture_proxy.export import trace_from_journal
    from capture_proxy.journal import JournalError
    from harness_trainer.trace import CaptureContractError, dump_trace, load_trace

    try:
        trace = load_trace(trace_from_journal(args.session), session_id=args.session.name)
    except (UntrainableSession, JournalError, CaptureContractError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = dump_trace(trace)
    if args.out:
        args.out.write_text(text)
        print(f"{len(trace.turns)} turns -> {args.out}")
    else:
        print(text)
    return 0


def _watch_children_with_pidfds() -> None:
    """On Python 3.11, watch sandbox subprocesses through pidfds instead of one waiting thread each.

    The default watcher starts a thread per child: with hundreds of rollouts that is a thousand threads
    fighting over the GIL. Python 3.12+ does this by itself.
    """
    import asyncio
    import warnings

    if sys.version_info >= (3, 12) or not hasattr(asyncio, "PidfdChildWatcher"):
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        asyncio.set_child_watcher(asyncio.PidfdChildWatcher())


def _serve(args: argparse.Namespace) -> int:
    import logging
    import os

    from aiohttp import web

    from capture_proxy.app import tune_gc
    from harness_trainer.rollouts.server.routes import RolloutServer
    from harness_trainer.rollouts.server.runtime import RolloutRuntime, RuntimeConfig
    from harness_trainer.tasks.catalog import TaskCatalog
    from harness_trainer.tasks.task import TaskError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        tasks = TaskCatalog.open(args.dataset)
        tasks.splits()
    except (TaskError, OSError, ValueError) as exc:
        print(f"error: cannot load tasks from {', '.join(args.dataset)}: {exc}", file=sys.stderr)
        return 2
    if (agent_layer := _agent_layer(args.e2b_agent, "--e2b-agent")) is None:
        return 2
    limit = args.max_concurrent_envs or int(os.environ.get("MAX_CONCURRENT_ENVS", "8"))
    admin_key = args.capture_admin_key or os.environ.get("CAPTURE_PROXY_ADMIN_KEY") or None
    if args.capture_url and not admin_key:
        print("error: --capture-url needs the proxy's admin key (--capture-admin-key or "
              "$CAPTURE_PROXY_ADMIN_KEY)", file=sys.stderr)  # fmt: skip
        return 2
    if args.replicas and args.capture_url:
        print("error: --replicas configures the capture proxy serve starts; start an external one "
              "(--capture-url) with its own --replicas", file=sys.stderr)  # fmt: skip
        return 2
    config = RuntimeConfig(
        upstream=args.upstream[0],
        allowed_upstreams=tuple(args.upstream[1:]),
        replicas=args.replicas,
        data_dir=args.data_dir,
        capture_url=args.capture_url,
        admin_key=admin_key,
        capture_host=args.capture_host,
        capture_port=args.capture_port,
        public_url=args.public_url,
        served_model=args.served_model,
        sandbox_starts_per_s=args.sandbox_start_rate or None,
        max_sandbox_starts=args.max_sandbox_starts or None,
        sandbox_start_jitter_s=args.sandbox_start_jitter,
        proxy_process=args.proxy == "process",
        sandbox_options={
            "e2b": {"templates": args.e2b_templates, "agent_layer": agent_layer, "run_id": args.run_id}
        },
    )
    server = RolloutServer(
        RolloutRuntime(config), tasks, max_concurrent_envs=limit, idle_timeout_s=args.idle_timeout or None
    )
    _watch_children_with_pidfds()
    # With the proxy in-process, the server's hot path is the proxy's: the same collector settings pay off.
    tune_gc()
    print(
        f"rollout server: http://{args.host}:{args.port} (capture proxy "
        f"{args.capture_url or f'on port {args.capture_port}, {args.proxy}'}, "
        f"engines {', '.join(args.upstream)}, datasets {', '.join(args.dataset)}, at most {limit} sessions)",
        flush=True,
    )
    web.run_app(server.app(), host=args.host, port=args.port, access_log=None, print=None)
    return 0


def _agent_layer(names: list[str] | None, flag: str) -> str | None:
    """The E2B template layer that preinstalls the harnesses ``names``; None (said on stderr) when one of
    them cannot be preinstalled."""
    from harness_trainer.harnesses import template_agent_layer

    try:
        return template_agent_layer(names or [])
    except ValueError as exc:
        print(f"error: {flag}: {exc}", file=sys.stderr)
        return None


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
        killed = await kill_run(sandbox_class, run_id)
    except Exception as exc:  # the SDK's errors (auth, network) are reported, not a traceback
        print(f"error: cannot list the E2B sandboxes of run {run_id}: {exc}", file=sys.stderr)
        return 1
    print(
        f"killed {len(killed)} E2B sandboxes of run {run_id}" + (f": {', '.join(killed)}" if killed else "")
    )
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

    if (agent_layer := _agent_layer(args.agent, "--agent")) is None:
        return 2
    try:
        source = open_task_source(args.dataset)
        tasks = [task for split in (args.split or source.splits()) for task in source.tasks(split)]
    except (TaskError, OSError, LookupError, ValueError) as exc:
        print(f"error: cannot load tasks from {args.dataset}: {exc}", file=sys.stderr)
        return 2
    builder = TemplateBuilder(
        template_class,
        agent_layer=agent_layer,
        timeout_s=args.timeout,
        log_dir=args.log_dir,
        rebuild=args.rebuild,
    )
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
    if (agent_layer := _agent_layer(args.e2b_agent, "--e2b-agent")) is None:
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
        agent_timeout_s=args.agent_timeout,
        step_limit=args.step_limit,
        agent_layer=agent_layer,
    )
    run = smoke_rollout(config, sandbox_class=sandbox_class, template_class=template_class)
    try:
        return run_interruptible(run)
    except KeyboardInterrupt:  # asyncio.run cancelled the smoke test, whose cleanup ran first
        print("FAIL: interrupted (the sandbox was killed and the capture proxy stopped)", flush=True)
        return 130


def _dev(args: argparse.Namespace) -> int:
    from harness_trainer.devloop.run import run_dev

    return run_dev(args)


def _jobs_submit(args: argparse.Namespace) -> int:
    from harness_trainer.jobs.submit import run_submit

    return run_submit(args)


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="harness-trainer",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Train LLMs with reinforcement learning (async GRPO) on the behaviour of real coding agents.\n"
            "Agents (opencode, mini-swe-agent, claude-code, codex) run their own loop in sandboxes; a "
            "capture\nproxy records the exact tokens the engine sampled for them, and the trainer learns "
            "from those."
        ),
        epilog=(
            "start here:\n"
            "  harness-trainer dev            the whole loop on a CPU: tiny model, dev engine, a real agent\n"
            "                                 in local sandboxes, GRPO; leaves curves and a trace viewer\n"
            "  harness-trainer serve ...      the rollout server (with the capture proxy) for a real run\n"
            "  harness-trainer jobs submit    a whole training run on Hugging Face Jobs\n"
            "\n"
            "'harness-trainer COMMAND --help' for a command's options. Documentation: README.md and docs/\n"
            "in the repository; 'mkdocs serve' there builds it as a site."
        ),
    )
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("tiny-model", help="build (if needed) the tiny local model and print its directory")
    tiny.add_argument(
        "--out",
        type=Path,
        default=None,
        help="directory to build into (default: the cache, ~/.cache/harness-trainer)",
    )
    tiny.set_defaults(func=_tiny_model)

    engine = sub.add_parser("engine", help="serve a model on CPU with vLLM's wire shapes (the dev engine)")
    engine.add_argument("--model", default=None, help="model directory or hub id (default: the tiny model)")
    engine.add_argument("--host", default="127.0.0.1")
    engine.add_argument("--port", type=int, default=8000)
    engine.add_argument("--served-model-name", default=None, help="name clients use (default: --model)")
    engine.add_argument("--max-model-len", type=int, default=None, help="context length (default: model's)")
    engine.add_argument(
        "--script",
        default=None,
        help="JSON/JSONL file of assistant messages to reply with, in order (scripted mode)",
    )
    engine.add_argument("--seed", type=int, default=0, help="seed for requests that bring none")
    engine.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    engine.set_defaults(func=_engine)

    demo = sub.add_parser(
        "demo", help="start the dev engine on the tiny model and chat with it (tools included)"
    )
    demo.add_argument("--port", type=int, default=0, help="engine port (default: a free one)")
    demo.set_defaults(func=_demo)

    from capture_proxy.cli import add_arguments

    proxy = sub.add_parser(
        "proxy", help="serve the capture proxy in front of an engine (vLLM or the dev engine)"
    )
    add_arguments(proxy)
    proxy.set_defaults(func=_proxy)

    export = sub.add_parser("proxy-trace", help="export a session's TrainingTrace from its journal (offline)")
    export.add_argument(
        "session", type=Path, help="session directory (DATA_DIR/sessions/ID) or its calls.jsonl"
    )
    export.add_argument("--out", type=Path, default=None, help="write here instead of stdout")
    export.set_defaults(func=_proxy_trace)

    serve = sub.add_parser("serve", help="serve rollouts of Harbor tasks over HTTP, with the capture proxy")
    serve.add_argument(
        "--dataset", required=True, action="append",
        help="a folder of task splits, or a Hugging Face dataset id (repeatable: a factory's split= names "
        "one as given, NAME:SPLIT one of its splits; a bare split name means the first dataset's)",
    )  # fmt: skip
    serve.add_argument(
        "--upstream", required=True, action="append",
        help="the engine's base URL (vLLM or the dev engine); repeatable: a rollout's llm_url may name any "
        "given (the first is the default), and no other",
    )  # fmt: skip
    serve.add_argument(
        "--replicas", action="store_true",
        help="every --upstream is a replica of one model: the capture proxy pins each session to one, "
        "fails over and probes back in (GET /health lists them); not with --capture-url",
    )  # fmt: skip
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8200)
    serve.add_argument("--capture-host", default="127.0.0.1", help="where the capture proxy binds")
    serve.add_argument("--capture-port", type=int, default=8300)
    serve.add_argument("--public-url", default=None, help="how agents in sandboxes reach the capture proxy")
    serve.add_argument(
        "--capture-url", default=None, help="use this running capture proxy instead of starting one"
    )
    serve.add_argument(
        "--capture-admin-key", default=None, help="its admin key (default: $CAPTURE_PROXY_ADMIN_KEY)"
    )
    serve.add_argument(
        "--proxy", choices=("process", "in-process"), default="process",
        help="run the capture proxy as a child process (its own core; default) or in the server's loop",
    )  # fmt: skip
    serve.add_argument("--served-model", default=None, help="model name (default: the engine's first)")
    serve.add_argument("--data-dir", type=Path, default=Path("runs/capture"), help="capture journals")
    serve.add_argument(
        "--sandbox-start-rate", type=float, default=0, help="sandbox starts per second, at most"
    )
    serve.add_argument(
        "--max-sandbox-starts", type=_non_negative_int, default=32,
        help="sandbox creates in flight at once; the rest queue (default 32; 0: no cap)",
    )  # fmt: skip
    serve.add_argument(
        "--sandbox-start-jitter", type=_non_negative_float, default=0.0, metavar="SECONDS",
        help="each sandbox start first waits a random 0..SECONDS (spreads a group's starts; e.g. 2 with e2b)",
    )  # fmt: skip
    serve.add_argument(
        "--max-concurrent-envs",
        type=int,
        default=0,
        help="open sessions at most (default $MAX_CONCURRENT_ENVS or 8)",
    )
    serve.add_argument(
        "--idle-timeout",
        type=float,
        default=3600.0,
        help="close a session no client asked about for this many seconds (0: never)",
    )
    serve.add_argument(
        "--e2b-templates", choices=("build", "prebuilt"), default="build",
        help="E2B tasks without a named template: build the template from the task's environment on first "
        "use (default), or only use one built ahead (`harness-trainer e2b build-templates`)",
    )  # fmt: skip
    serve.add_argument(
        "--e2b-agent", action="append", metavar="HARNESS",
        help="preinstall this harness's pinned agent in every E2B template built from a task (repeatable; "
        "part of the template's name: give `e2b build-templates --agent` the same list)",
    )  # fmt: skip
    serve.add_argument(
        "--run-id", default=None,
        help="label E2B sandboxes with this run; a server restarted with the same id first kills the ones "
        "a dead server left (one server per id; `harness-trainer e2b cleanup --run ID` does it by hand)",
    )  # fmt: skip
    serve.set_defaults(func=_serve)

    e2b = sub.add_parser("e2b", help="E2B sandboxes").add_subparsers(dest="e2b_command", required=True)
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
        help="preinstall this harness's pinned agent in every template (repeatable; as `serve --e2b-agent`)",
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
        "--agent-timeout", type=float, default=None, help="seconds for the agent (default: the task's)"
    )
    smoke.add_argument(
        "--step-limit", type=_non_negative_int, default=20, help="agent steps (default 20; 0: the agent's)"
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

    from harness_trainer.devloop.run import add_dev_arguments

    dev = sub.add_parser(
        "dev", help="the local dev loop: tiny model, dev engine, a real agent in local sandboxes, GRPO"
    )
    add_dev_arguments(dev)
    dev.set_defaults(func=_dev)

    from harness_trainer.devloop.evaluate import add_eval_arguments, run_eval
    from harness_trainer.plots import add_plot_arguments, run_plot
    from harness_trainer.viewer.command import add_view_arguments, run_view

    evaluate = sub.add_parser(
        "eval", help="evaluate a checkpoint on a split of local tasks: k rollouts per task, pass@1 and pass@k"
    )
    add_eval_arguments(evaluate)
    evaluate.set_defaults(func=run_eval)

    view = sub.add_parser("view", help="write a run's static HTML trace viewer (one file, no server)")
    add_view_arguments(view)
    view.set_defaults(func=run_view)
    plot = sub.add_parser("plot", help="draw a run's reward / length / tool-call / loss curves as a PNG")
    add_plot_arguments(plot)
    plot.set_defaults(func=run_plot)

    from harness_trainer.jobs.submit import add_submit_arguments

    jobs = sub.add_parser("jobs", help="Hugging Face Jobs").add_subparsers(dest="jobs_command", required=True)
    submit = jobs.add_parser("submit", help="submit a training run to Hugging Face Jobs")
    add_submit_arguments(submit)
    submit.set_defaults(func=_jobs_submit)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
