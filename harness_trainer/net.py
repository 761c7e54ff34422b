"""Loopback helpers for the local processes this project starts: a free port, and waiting for health.

Used by the CLI's demo, the dev engine and vLLM launchers, the local rollout factory, the tests and the
benchmarks; stdlib only at import time (``httpx`` is imported when a wait starts).
"""

from __future__ import annotations

import socket
import subprocess
import time


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the kernel's pick; the socket is closed again)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_healthy(url: str, process: subprocess.Popen, timeout: float = 180.0) -> None:
    """Poll ``url``/health until it answers 200; fail early if ``process`` (the server) exits.

    Raises:
        RuntimeError: ``process`` exited before the server was healthy.
        TimeoutError: not healthy within ``timeout`` seconds.
    """
    import httpx  # late: the CLI's import stays light

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"the server for {url} exited with code {process.returncode} before it was healthy"
            )
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"the server at {url} was not healthy after {timeout:.0f}s")
