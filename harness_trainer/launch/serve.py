"""``harness-trainer serve``: the rollout server over HTTP, with the capture proxy it starts (or one that
runs already), its flags and handler.

Every option can come from ``--config FILE``'s ``serve`` section instead
(:mod:`harness_trainer.launch.config_file`; a flag given wins). aiohttp, the runtime and the tasks load
only when the server starts, so ``--help`` stays instant.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from capture_proxy.cli import add_proxy_arguments
from harness_trainer.harnesses import HARNESSES
from harness_trainer.launch.config_file import apply_config, configurable
from harness_trainer.launch.e2b_commands import agent_names
from harness_trainer.launch.flag_types import non_negative_float, non_negative_int
from harness_trainer.rollouts.run_options import DEFAULT_RUN

SECTION = "serve"
"""``serve``'s section of a ``--config`` file: its options by their flag's name with underscores."""


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The rollout server's flags and those of the capture proxy it starts (:func:`add_proxy_arguments`,
    its listening ones as ``--capture-*``), and ``--config`` (a file's ``serve`` section holds them all);
    :func:`run_serve` runs a namespace parsed with them."""
    parser.add_argument(
        "--dataset", required=True, action="append",
        help="a folder of task splits, or a Hugging Face dataset id (repeatable: a factory's split= names "
        "one as given, NAME:SPLIT one of its splits; a bare split name means the first dataset's)",
    )  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help="where the rollout server binds")
    parser.add_argument("--port", type=int, default=8200, help="the rollout server's port")
    add_proxy_arguments(parser, prefix="capture-", data_dir=Path("runs/capture"), standalone=False)
    parser.add_argument(
        "--capture-url", default=None,
        help="use this running capture proxy instead of starting one (with its --capture-admin-key; it "
        "takes its own --replicas, not serve's)",
    )  # fmt: skip
    parser.add_argument(
        "--proxy", choices=("process", "in-process"), default="process",
        help="run the capture proxy as a child process (its own core; default) or in the server's loop",
    )  # fmt: skip
    parser.add_argument(
        "--sandbox-start-rate", type=float, default=0, help="sandbox starts per second, at most"
    )
    parser.add_argument(
        "--max-sandbox-starts", type=non_negative_int, default=32,
        help="sandbox creates in flight at once; the rest queue (default 32; 0: no cap)",
    )  # fmt: skip
    parser.add_argument(
        "--sandbox-start-jitter", type=non_negative_float, default=0.0, metavar="SECONDS",
        help="each sandbox start first waits a random 0..SECONDS (spreads a group's starts; e.g. 2 with e2b)",
    )  # fmt: skip
    parser.add_argument(
        "--max-concurrent-envs",
        type=int,
        default=0,
        help="open sessions at most (default $MAX_CONCURRENT_ENVS or 8)",
    )
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=3600.0,
        help="close a session no client asked about for this many seconds (0: never)",
    )
    parser.add_argument(
        "--e2b-templates", choices=("build", "prebuilt"), default="build",
        help="E2B tasks without a named template: build the template from the task's environment on first "
        "use (default), or only use one built ahead (`harness-trainer e2b build-templates`)",
    )  # fmt: skip
    parser.add_argument(
        "--e2b-agent", action="append", metavar="HARNESS",
        help="put this harness's agent bundle in every sandbox (an E2B template's layer; repeatable; part of "
        "a template's name: give `e2b build-templates --agent` the same list). A rollout's own harness's "
        "bundle goes in anyway",
    )  # fmt: skip
    parser.add_argument(
        "--run-id", default=None,
        help="label E2B and HF sandboxes with this run; a server restarted with the same id first kills "
        "the ones a dead server left (one server per id; `harness-trainer e2b cleanup --run ID` and "
        "`harness-trainer hf cleanup --run ID` do it by hand)",
    )  # fmt: skip
    parser.add_argument(
        "--no-host-trust", dest="host_trust", action="store_false",
        help="do not carry this machine's CA bundle and proxy variables into image builds and sandboxes on "
        "this machine (by default they are, so HTTPS works there wherever it works here)",
    )  # fmt: skip
    parser.add_argument(
        "--no-group-setup", dest="group_setup", action="store_false",
        help="set up every GRPO group member's sandbox on its own; by default, on a backend that forks "
        "(local, docker, e2b), each group is set up once and its members start from a snapshot of it",
    )  # fmt: skip
    parser.add_argument(
        "--prepare", action="append", metavar="SPLIT",
        help="before serving, build the environment of every task of this split on --prepare-sandbox (an "
        "image, a template; repeatable): a broken one stops serve at start, naming it (default: none)",
    )  # fmt: skip
    parser.add_argument(
        "--prepare-sandbox", default=DEFAULT_RUN.sandbox, metavar="NAME",
        help=f"the sandbox backend --prepare builds for (default: {DEFAULT_RUN.sandbox})",
    )  # fmt: skip
    parser.add_argument(
        "--prepare-harness", action="append", metavar="NAME", choices=sorted(HARNESSES),
        help="with --prepare, also build this harness's agent bundle and set it up in every environment "
        "(repeatable; a pip agent's venv is made for each image's Python): an agent that cannot run there "
        "stops serve at start (default: none; rollouts provision their agent at their first start)",
    )  # fmt: skip
    configurable(parser, SECTION, trainer=False)


def run_serve(args: argparse.Namespace) -> int:
    """Serve rollouts until interrupted; 2 (said on stderr) when the tasks do not load or the flags do not
    fit together."""
    import logging
    import os

    from aiohttp import web

    from capture_proxy.app import tune_gc
    from harness_trainer.rollouts.server.routes import RolloutServer
    from harness_trainer.rollouts.server.runtime import RolloutRuntime, RuntimeConfig
    from harness_trainer.sandboxes.base import SandboxStartError
    from harness_trainer.tasks.catalog import TaskCatalog
    from harness_trainer.tasks.task import TaskError

    try:
        args = apply_config(args)
    except ValueError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        tasks = TaskCatalog.open(args.dataset)
        tasks.splits()
    except (TaskError, OSError, ValueError) as exc:
        print(f"error: cannot load tasks from {', '.join(args.dataset)}: {exc}", file=sys.stderr)
        return 2
    try:
        chosen = [task for split in args.prepare or () for task in tasks.tasks(split)]
    except KeyError as exc:
        print(f"error: --prepare: {exc.args[0]}", file=sys.stderr)
        return 2
    if (agents := agent_names(args.e2b_agent, "--e2b-agent")) is None:
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
    if args.prepare and (refused := _probe_engines(args.upstream)) is not None:
        print(f"error: {refused}", file=sys.stderr)
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
        inherit_host_trust=args.host_trust,
        group_setup=args.group_setup,
        sandbox_options=sandbox_options(args, limit),
        agents=agents,
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
    app = server.app()
    if args.prepare:
        harnesses = args.prepare_harness or []
        hook = _preparation(server.runtime, chosen, args.prepare, args.prepare_sandbox, harnesses)
        app.on_startup.append(hook)
    try:
        web.run_app(app, host=args.host, port=args.port, access_log=None, print=None)
    except SandboxStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _probe_engines(upstreams: list[str]) -> str | None:
    """With ``--prepare``, each ``--upstream`` engine that answers is probed
    (:mod:`harness_trainer.launch.probes`; serve loads no policy, so no identity probe; one not up yet is
    only warned about, as serve needs no engine to start): None when all pass, else the first failure."""
    import logging

    import httpx

    from harness_trainer.launch.probes import ProbeError, run_probes

    log = logging.getLogger(__name__)
    for url in upstreams:
        try:
            httpx.get(f"{url.rstrip('/').removesuffix('/v1')}/health", timeout=5)
        except httpx.HTTPError as exc:
            log.warning(
                "engine at %s does not answer (%r): not probed; the trainer's preflight probes it", url, exc
            )
            continue
        try:
            verdicts = run_probes(url, None)
        except ProbeError as exc:
            return f"probe of the engine at {url}: {exc}"
        log.info("engine at %s: %s", url, "; ".join(map(str, verdicts)))
    return None


def _preparation(
    runtime: Any, chosen: list[Any], splits: list[str], sandbox: str, harnesses: list[str]
) -> Any:
    """An aiohttp startup hook (it runs after the runtime starts): each task of ``splits`` prepared."""

    async def prepare(app: Any) -> None:
        import logging
        import time

        began = time.monotonic()
        prepared = await runtime.prepare(chosen, sandbox, harnesses=harnesses)
        logging.getLogger(__name__).info(
            "prepared %d environments of %s on %s in %.1f s", prepared, ", ".join(splits), sandbox,
            time.monotonic() - began,
        )  # fmt: skip

    return prepare


def sandbox_options(args: argparse.Namespace, concurrency: int) -> dict[str, dict[str, Any]]:
    """Each remote backend's options from serve's flags: the run id its sandboxes are labelled with (and
    reaped by), E2B's template mode, and the concurrency an HF pool sizes its hosts by."""
    return {
        "e2b": {"templates": args.e2b_templates, "run_id": args.run_id},
        "hf": {"run_id": args.run_id, "concurrency": concurrency},
    }


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
