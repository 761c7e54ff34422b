"""The capture proxy as a child process of the rollout runtime (``python -m capture_proxy``).

``harness-trainer serve`` runs its proxy this way: every model call of every agent goes through the proxy,
so in the server's own process it would share one interpreter lock (and one core) with the server's
bookkeeping, and a crash of either would take the other. The child gets the admin key through its
environment (never its command line, which any process on the host can read), dies with its parent
(``setpriv --pdeathsig``, as the local sandboxes' init does, where util-linux is installed), and is stopped
with SIGTERM (then SIGKILL) when the runtime closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import time
from pathlib import Path

import httpx

from capture_proxy.admin_client import CaptureClient
from capture_proxy.config import ADMIN_KEY_ENV


class ProxyProcessError(RuntimeError):
    """The proxy child did not come up (it exited, or did not answer in time)."""


class ProxyProcess:
    """One ``python -m capture_proxy`` child on ``host:port``, journaling into ``data_dir``."""

    def __init__(
        self,
        upstream: str,
        data_dir: Path,
        admin_key: str,
        host: str,
        port: int,
        public_url: str | None = None,
        served_model: str | None = None,
        allowed_upstreams: tuple[str, ...] = (),
        replicas: bool = False,
        probe_interval_s: float | None = None,
    ) -> None:
        self.upstream, self.data_dir, self.admin_key = upstream, Path(data_dir), admin_key
        self.allowed_upstreams, self.replicas = allowed_upstreams, replicas
        self.probe_interval_s = probe_interval_s
        """With ``replicas``: the proxy's ``--probe-interval`` (None: its default)."""
        self.host, self.port, self.public_url, self.served_model = host, port, public_url, served_model
        self.process: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "proxy.log"

    def argv(self) -> list[str]:
        # SIGTERM when the parent dies, so a SIGKILLed server leaves no proxy behind.
        setpriv = shutil.which("setpriv")
        argv = [setpriv, "--pdeathsig", "TERM"] if setpriv else []
        argv += [sys.executable, "-m", "capture_proxy", "--upstream", self.upstream, "--host", self.host]
        argv += ["--port", str(self.port), "--data-dir", str(self.data_dir)]
        for engine in self.allowed_upstreams:
            argv += ["--upstream", engine]
        if self.replicas:
            argv.append("--replicas")
        if self.probe_interval_s is not None:
            argv += ["--probe-interval", str(self.probe_interval_s)]
        if self.public_url:
            argv += ["--public-url", self.public_url]
        if self.served_model:
            argv += ["--served-model", self.served_model]
        return argv

    async def start(self, client: CaptureClient, timeout_s: float = 60.0) -> None:
        """Start the child and wait until ``client`` (its admin client) is answered."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, ADMIN_KEY_ENV: self.admin_key}
        with self.log_path.open("ab") as log:
            self.process = await asyncio.create_subprocess_exec(
                *self.argv(), stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log, env=env
            )
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2.0) as probe:
            while not await self._healthy(probe):
                if self.process.returncode is not None:
                    code = self.process.returncode
                    raise ProxyProcessError(f"the capture proxy exited with {code}:\n{self.tail()}")
                if time.monotonic() > deadline:
                    await self.stop()
                    detail = f"did not answer within {timeout_s:.0f} s"
                    raise ProxyProcessError(f"the capture proxy {detail}:\n{self.tail()}")
                await asyncio.sleep(0.05)
        await client.sessions()  # the admin key works

    async def _healthy(self, probe: httpx.AsyncClient) -> bool:
        try:
            return (await probe.get(self.url + "/health")).status_code == 200
        except httpx.HTTPError:
            return False

    def tail(self, limit: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return ""

    async def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM (the proxy lets in-flight calls finish journaling), then SIGKILL after ``grace_s``."""
        process, self.process = self.process, None
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        try:
            await asyncio.wait_for(process.wait(), grace_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
