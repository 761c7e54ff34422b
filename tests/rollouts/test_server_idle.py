"""The rollout server closes sessions that no client has asked about for its idle timeout: a crashed
trainer's sessions would otherwise hold their slots (MAX_CONCURRENT_ENVS) until the server restarts."""

from __future__ import annotations

import asyncio
import time

from aiohttp.test_utils import TestClient, TestServer

from harness_trainer.rollouts.server.routes import RolloutServer
from harness_trainer.rollouts.server.runtime import RuntimeConfig
from harness_trainer.tasks.sources import LocalTaskSource
from tests.hardening.fakes import IdleRuntime
from tests.rollouts.conftest import EXAMPLES


async def poll(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await condition():
            return True
        await asyncio.sleep(0.05)
    return False


async def test_idle_sessions_are_closed_and_polled_or_running_ones_are_kept(tmp_path) -> None:
    runtime = IdleRuntime(RuntimeConfig(upstream="http://127.0.0.1:9", data_dir=tmp_path, served_model="m"))
    server = RolloutServer(runtime, LocalTaskSource(EXAMPLES), max_concurrent_envs=4, idle_timeout_s=0.4)
    async with TestClient(TestServer(server.app())) as client:
        abandoned = (await (await client.post("/sessions")).json())["session_id"]
        polled = (await (await client.post("/sessions")).json())["session_id"]
        running = (await (await client.post("/sessions")).json())["session_id"]
        body = {"split": "train", "index": 0, "harness": "toy", "sandbox": "local", "episode_id": "hold"}
        assert (await client.post(f"/sessions/{running}/rollout", json=body)).status == 202

        async def abandoned_gone() -> bool:
            assert (await client.get(f"/sessions/{polled}")).status == 200  # a client that keeps asking
            return abandoned not in server.slots

        assert await poll(abandoned_gone, 10.0)
        assert (await client.get(f"/sessions/{abandoned}")).status == 404
        assert running in server.slots and server.slots[running].status == "running"
        assert polled in server.slots
        health = await (await client.get("/health")).json()
        assert health["reaped_idle_sessions"] == 1 and health["sessions"] == 2
        for session in (polled, running):
            assert (await client.delete(f"/sessions/{session}")).status == 200


async def test_no_idle_timeout_keeps_every_session(tmp_path) -> None:
    runtime = IdleRuntime(RuntimeConfig(upstream="http://127.0.0.1:9", data_dir=tmp_path, served_model="m"))
    server = RolloutServer(runtime, LocalTaskSource(EXAMPLES), idle_timeout_s=None)
    async with TestClient(TestServer(server.app())) as client:
        session = (await (await client.post("/sessions")).json())["session_id"]
        await asyncio.sleep(0.5)
        assert session in server.slots and server.reaped == 0
