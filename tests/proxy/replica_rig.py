"""Two real dev engines behind a real ``python -m capture_proxy --replicas`` on loopback, with the trainer's
:class:`EngineReplicas` over them: for the tests that restart an engine (stop it, start it again on its
port, with its start-up weights) and watch what the proxy and the trainer's side then do."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from capture_proxy.admin_client import CaptureClient
from harness_trainer.dev_engine.process import EngineProcess, start_engine
from harness_trainer.engines import DevEngine, RetryPolicy
from harness_trainer.engines.replicas import EngineReplicas
from harness_trainer.net import free_port
from harness_trainer.rollouts.server.proxy_process import ProxyProcess

ADMIN_KEY = "key"
PROBE_INTERVAL_S = 0.1


def weights(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    """The tiny model's weights with seeded noise: a version that samples unlike the start-up weights."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    noise = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=noise) * 0.05)
    return model.state_dict()


def weight_version(url: str) -> int:
    """The version a dev engine serves (``GET /weight_version``)."""
    return httpx.get(url + "/weight_version", timeout=30).json()["weight_version"]


@dataclass
class ReplicaRig:
    model_dir: Path
    engines: list[EngineProcess]
    proxy: ProxyProcess
    client: CaptureClient
    """The proxy's admin client."""
    replicas: EngineReplicas
    """The trainer's side, draining and enabling at the proxy."""

    @property
    def urls(self) -> list[str]:
        return [engine.url for engine in self.engines]

    async def step(self, version: int) -> None:
        """One training step's weight sync, then the version told to the proxy (as the trainer does)."""
        await self.replicas.pause()
        assert await self.replicas.push_weights(weights(self.model_dir, version), version) == version
        await self.replicas.resume()
        await self.client.set_policy(None, version)

    def restart(self, index: int) -> None:
        """Stop engine ``index`` and start it again on its port: a new process, with start-up weights."""
        port = int(self.engines[index].url.rsplit(":", 1)[1])
        self.engines[index].stop()
        self.engines[index] = start_engine(self.model_dir, port=port)

    def stop(self, index: int) -> None:
        self.engines[index].stop()

    def start(self, index: int) -> None:
        """Start engine ``index`` (stopped) again on its port."""
        port = int(self.engines[index].url.rsplit(":", 1)[1])
        self.engines[index] = start_engine(self.model_dir, port=port)

    async def table(self) -> list[dict[str, Any]]:
        return await self.client.replicas()

    async def wait_for(self, check: Callable[[list[dict[str, Any]]], bool], timeout: float = 30.0) -> None:
        """Until ``check`` holds of the proxy's replica table (the probe loop runs every 0.1 s)."""
        deadline = time.monotonic() + timeout
        while not check(await self.table()) and time.monotonic() < deadline:
            time.sleep(0.05)

    def new_session(self) -> str:
        response = self._admin("POST", "/sessions", json={})
        assert response.status_code == 201, response.text
        return response.json()["session_id"]

    def call(self, session_id: str) -> httpx.Response:
        """One greedy chat call of the session through the proxy."""
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Count to five."}]}
        body.update(temperature=0.0, max_tokens=4)
        return httpx.post(f"{self.proxy.url}/s/{session_id}/v1/chat/completions", json=body, timeout=120)

    def calls(self, session_id: str) -> list[dict[str, Any]]:
        response = self._admin("GET", f"/sessions/{session_id}/calls")
        assert response.status_code == 200, response.text
        return response.json()["calls"]

    def placed_on(self) -> dict[str, Any]:
        """The journal record of a new session's first call (its ``engine``, its versions)."""
        session = self.new_session()
        assert self.call(session).status_code == 200
        return self.calls(session)[-1]

    def _admin(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        return httpx.request(method, self.proxy.url + path, headers=headers, timeout=60, **kwargs)

    async def close(self) -> None:
        try:
            await self.proxy.stop()
            await self.client.aclose()
        finally:
            for engine in self.engines:
                engine.stop()


async def replica_rig(model_dir: Path, folder: Path) -> AsyncIterator[ReplicaRig]:
    """The rig, for an async fixture to yield from; every process it started is stopped after."""
    engines: list[EngineProcess] = []
    try:
        for _ in range(2):
            engines.append(start_engine(model_dir, port=free_port()))
        first, second = (engine.url for engine in engines)
        proxy = ProxyProcess(
            first, folder, ADMIN_KEY, "127.0.0.1", free_port(), allowed_upstreams=(second,), replicas=True,
            probe_interval_s=PROBE_INTERVAL_S,
        )  # fmt: skip
        client = CaptureClient(proxy.url, ADMIN_KEY)
    except BaseException:
        for engine in engines:
            engine.stop()
        raise
    no_retry = RetryPolicy(attempts=1)
    replicas = EngineReplicas(
        [DevEngine(url, retry=no_retry) for url in (first, second)], proxy_url=proxy.url, admin_key=ADMIN_KEY
    )
    rig = ReplicaRig(model_dir, engines, proxy, client, replicas)
    try:
        await proxy.start(client)
        yield rig
    finally:
        await rig.close()


@pytest.fixture
async def rig(tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[ReplicaRig]:
    """The rig on the tiny model (import this fixture where a test takes ``rig``)."""
    async for running in replica_rig(tiny_model_dir, tmp_path / "proxy"):
        yield running
