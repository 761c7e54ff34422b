"""Test doubles shared by the hardening tests."""

from __future__ import annotations

import asyncio
from typing import Any

from harness_trainer.rollouts.result import RolloutOptions, RolloutResult
from harness_trainer.rollouts.server.runtime import RolloutRuntime
from harness_trainer.tasks.task import HarborTask


class IdleRuntime(RolloutRuntime):
    """A rollout runtime with no proxy and no sandboxes: a rollout finishes at once, with an empty trace
    (or, told to, runs until stopped or cancelled), so the rollout server's HTTP layer can be driven hard."""

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    async def open_capture_sessions(self) -> int:
        return 0

    async def rollout(
        self, task: HarborTask, options: RolloutOptions, stop: asyncio.Event | None = None
    ) -> RolloutResult:
        if options.episode_id == "hold" and stop is not None:
            await stop.wait()
        trace: dict[str, Any] = {"schema_version": 1, "turns": []}
        return RolloutResult(
            task_name=task.name, harness=options.harness, sandbox=options.sandbox, trace=trace
        )
