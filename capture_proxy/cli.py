"""``python -m capture_proxy`` / ``harness-trainer proxy``: serve the capture proxy in front of an engine.

Only argparse is imported at module level, so ``--help`` is instant; aiohttp and the app load on serve.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import asyncio


def add_proxy_arguments(
    parser: argparse.ArgumentParser,
    *,
    prefix: str = "",
    data_dir: Path | None = None,
    standalone: bool = True,
) -> None:
    """The capture proxy's flags, declared once for every command that starts one.

    ``python -m capture_proxy`` and ``harness-trainer proxy`` take them all (``standalone``), and
    ``--data-dir`` is then required. ``harness-trainer serve``, which starts the proxy itself (its own
    ``--host``/``--port`` are the rollout server's), takes the engine, journal and listening flags only,
    the listening ones named with ``prefix`` (``--capture-host``, ``--capture-port``,
    ``--capture-admin-key``), and ``data_dir`` as ``--data-dir``'s default.
    """
    parser.add_argument(
        "--upstream", required=True, action="append",
        help="engine base URL, e.g. http://127.0.0.1:8000; repeat it to allow sessions to name further "
        "engines (the first is the default, no other is ever forwarded to), or with --replicas to serve "
        "one model from several engines",
    )  # fmt: skip
    parser.add_argument(
        "--replicas", action="store_true",
        help="every --upstream is a replica of one model (refused at start if they serve different ones): "
        "each session naming no engine is pinned to the least loaded replica, and moved off one that "
        "stops answering until a probe finds it back",
    )  # fmt: skip
    loopback_only = " (non-loopback needs an admin key)" if standalone else ""
    parser.add_argument(
        f"--{prefix}host", default="127.0.0.1", help=f"address the capture proxy binds{loopback_only}"
    )
    parser.add_argument(f"--{prefix}port", type=int, default=8300, help="the capture proxy's port")
    parser.add_argument(
        "--data-dir",
        type=Path,
        required=data_dir is None,
        default=data_dir,
        help="sessions and journals, reloaded on start" + (f" (default: {data_dir})" if data_dir else ""),
    )
    # A standalone proxy keeps its key beside the journals; the one serve starts gets a new one each start.
    stored = "one kept in DATA_DIR/admin_key" if standalone else "a new one each start"
    parser.add_argument(
        f"--{prefix}admin-key",
        default=None,
        help=f"admin bearer key (default: $CAPTURE_PROXY_ADMIN_KEY, else {stored})",
    )
    parser.add_argument("--public-url", default=None, help="URL agents use to reach the proxy")
    parser.add_argument("--served-model", default=None, help="model name upstream (default: engine's first)")
    if not standalone:
        return
    parser.add_argument(
        "--probe-interval", type=float, default=5.0, help="with --replicas: probe interval, seconds"
    )
    parser.add_argument("--upstream-api-key", default=None, help="bearer key the engine expects, if any")
    parser.add_argument("--upstream-timeout", type=float, default=600.0, help="seconds per engine attempt")
    parser.add_argument("--upstream-pool", type=int, default=512, help="connections to the engine, at most")
    parser.add_argument("--upstream-attempts", type=int, default=3, help="tries per call (408/429/5xx)")
    parser.add_argument("--keepalive", type=float, default=5.0, help="SSE keepalive interval, seconds")
    parser.add_argument("--max-body-mb", type=float, default=32.0, help="largest request body accepted")
    parser.add_argument(
        "--loop",
        choices=LOOPS,
        default="auto",
        help="event loop: uvloop's where it is installed (auto, the default), or asyncio's own",
    )


LOOPS = ("auto", "uvloop", "asyncio")


def new_event_loop(kind: str) -> asyncio.AbstractEventLoop:
    """The proxy's event loop: uvloop's where it is installed (``auto``), or asyncio's own.

    Measured on the proxy benchmark against asyncio's loop: 6-7 % less CPU per call with one agent and
    with 64 paced agents, 2-5 % more calls per second closed-loop. ``uvloop`` insists on it.
    """
    import asyncio

    if kind not in LOOPS:
        raise ValueError(f"unknown event loop {kind!r}; choose one of {', '.join(LOOPS)}")
    if kind != "asyncio":
        try:
            import uvloop
        except ImportError as exc:
            if kind == "uvloop":
                raise ImportError("--loop uvloop: uvloop is not installed (pip install uvloop)") from exc
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def serve(args: argparse.Namespace) -> int:
    """Build the config from parsed flags and serve until interrupted."""
    import logging
    import os

    from aiohttp import web

    from capture_proxy.app import build_app
    from capture_proxy.config import (
        ADMIN_KEY_ENV,
        ADMIN_KEY_FILE,
        ConfigError,
        ProxyConfig,
        is_loopback,
        stored_admin_key,
    )

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    admin_key = args.admin_key or os.environ.get(ADMIN_KEY_ENV) or None
    if admin_key is None and is_loopback(args.host):  # off loopback, a key must be given (refused below)
        try:
            admin_key = stored_admin_key(args.data_dir)
        except (ConfigError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"capture proxy: admin key in {args.data_dir / ADMIN_KEY_FILE}", flush=True)
    config = ProxyConfig(
        upstream=args.upstream[0],
        allowed_upstreams=tuple(args.upstream[1:]),
        replicas=args.replicas,
        probe_interval_s=args.probe_interval,
        data_dir=args.data_dir,
        admin_key=admin_key,
        host=args.host,
        port=args.port,
        public_url=args.public_url,
        served_model=args.served_model,
        upstream_api_key=args.upstream_api_key,
        upstream_timeout_s=args.upstream_timeout,
        upstream_attempts=args.upstream_attempts,
        upstream_pool=args.upstream_pool,
        keepalive_s=args.keepalive,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
        tune_gc=True,
    )
    try:
        app = build_app(config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        loop = new_event_loop(args.loop)
    except ImportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"capture proxy: http://{args.host}:{args.port} -> {', '.join(args.upstream)} "
        f"(data: {args.data_dir}; "
        f"event loop: {type(loop).__module__.split('.')[0]})",
        flush=True,
    )
    try:
        web.run_app(
            app,
            host=args.host,
            port=args.port,
            access_log=None,
            print=None,
            handler_cancellation=True,
            loop=loop,
        )
    except ConfigError as exc:  # found on start: replicas serving different models
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="capture_proxy", description=__doc__.split("\n")[0])
    add_proxy_arguments(parser)
    return serve(parser.parse_args(argv))
