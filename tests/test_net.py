"""Loopback helpers (``harness_trainer.net``): a free port, and waiting for a server's health."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from harness_trainer.net import free_port, wait_until_healthy


class Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_a_free_port_can_be_bound_on_loopback() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port()))


def test_a_healthy_server_is_waited_for() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        wait_until_healthy(f"http://127.0.0.1:{server.server_port}", sleeper, timeout=10)
    finally:
        sleeper.kill()
        sleeper.wait()
        server.shutdown()
        server.server_close()


def test_a_server_process_that_exits_fails_the_wait_at_once() -> None:
    exited = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    exited.wait()
    with pytest.raises(RuntimeError, match="exited with code 3"):
        wait_until_healthy(f"http://127.0.0.1:{free_port()}", exited, timeout=60)


def test_a_server_that_never_answers_times_out() -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(TimeoutError, match="not healthy"):
            wait_until_healthy(f"http://127.0.0.1:{free_port()}", sleeper, timeout=1)
    finally:
        sleeper.kill()
        sleeper.wait()
