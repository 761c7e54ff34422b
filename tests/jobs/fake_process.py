"""A stand-in for each process the job launcher runs (vLLM, serve, warm-up, trainer), for its tests.

    python fake_process.py NAME [behaviour options] [whatever the launcher appends]

It reads ``--port`` and ``--capture-port`` from what the launcher appends and answers ``GET /health`` on
each (on loopback, whatever ``--host`` says) unless ``--never-listen``; everything else it was given is
ignored. Each event is one JSON line in ``$FAKE_EVENTS``: ``{"name", "event", "pid", "t", ...}``; the
``start`` event carries the argv, ``listening`` comes once every port answers, ``terminated`` on SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def record(name: str, event: str, **fields: Any) -> None:
    line = json.dumps({"name": name, "event": event, "pid": os.getpid(), "t": time.time(), **fields})
    with open(os.environ["FAKE_EVENTS"], "a") as events:
        events.write(line + "\n")


class Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b'{"status": "ok"}'
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def listen(ports: list[int]) -> None:
    for port in ports:
        server = ThreadingHTTPServer(("127.0.0.1", port), Health)
        threading.Thread(target=server.serve_forever, daemon=True).start()


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("name")
    parser.add_argument("--listen-after", type=float, default=0.0, help="seconds before /health answers")
    parser.add_argument("--never-listen", action="store_true")
    parser.add_argument("--die-after", type=float, default=None, help="exit this long after starting")
    parser.add_argument("--exit", type=int, default=0, help="exit code when it ends by itself")
    parser.add_argument("--hang", action="store_true", help="never end by itself")
    parser.add_argument("--ignore-term", action="store_true", help="survive SIGTERM (SIGKILL needed)")
    parser.add_argument("--grandchild", action="store_true", help="leave a `sleep` in its process group")
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--capture-port", type=int, default=None)
    args, _ = parser.parse_known_args()
    name = args.name
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda signum, frame: (record(name, "terminated"), os._exit(143)))
    record(name, "start", argv=sys.argv[1:])
    if args.grandchild:
        sleeper = subprocess.Popen(["sleep", "600"])
        record(name, "grandchild", child=sleeper.pid)
    ports = [port for port in (args.port, args.capture_port) if port is not None]
    started = time.monotonic()
    if ports and not args.never_listen:
        time.sleep(args.listen_after)
        listen(ports)
        record(name, "listening", ports=ports)
    if args.die_after is not None:
        time.sleep(max(0.0, args.die_after - (time.monotonic() - started)))
    elif args.hang or ports:
        while True:
            time.sleep(3600)
    record(name, "exit", code=args.exit)
    return args.exit


if __name__ == "__main__":
    sys.exit(main())
