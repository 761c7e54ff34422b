"""A rollout's sandbox-seconds: each sandbox it started counted from the backend handing it over to the end of
its close, summed over its sandboxes; a clock that the test moves stands in for time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from harness_trainer.rollouts.server.sandbox_meter import SandboxMeter


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Box:
    """A sandbox whose close takes ``close_s`` of the test's clock."""

    def __init__(self, clock: Clock, close_s: float) -> None:
        self.clock, self.close_s, self.closes = clock, close_s, 0

    async def close(self) -> None:
        self.closes += 1
        self.clock.now += self.close_s


class Backend:
    def __init__(self, clock: Clock, start_s: float, close_s: float = 0.0, fail: bool = False) -> None:
        self.clock, self.start_s, self.close_s, self.fail = clock, start_s, close_s, fail

    async def start(self, task: Any, *, lifetime_s: float, env: dict[str, str] | None = None) -> Box:
        self.clock.now += self.start_s  # queued, created, prepared: none of it is counted
        if self.fail:
            raise RuntimeError("no sandbox")
        return Box(self.clock, self.close_s)


async def test_two_sandboxes_open_at_once_count_their_own_lifetimes_from_hand_over_to_closed() -> None:
    clock = Clock()
    meter = SandboxMeter(clock)
    agent = await meter.start(Backend(clock, start_s=7.0, close_s=2.0), Path("task"), lifetime_s=60)
    clock.now += 30.0  # the agent runs
    verifier = await meter.start(Backend(clock, start_s=5.0, close_s=1.0), Path("task"), lifetime_s=60)
    clock.now += 10.0  # the separate verifier runs
    await meter.close(verifier)  # 10 + its 1 s close
    assert meter.seconds == 11.0 and meter.elapsed() == 11.0 + 46.0  # the agent's: 30 + 5 + 10 + 1 so far
    clock.now += 4.0  # the trace is read
    await meter.close(agent)  # 30 + 5 + 11 + 4 + its 2 s close
    await meter.close(agent)  # closed already: nothing more
    assert meter.seconds == 11.0 + 52.0 == meter.elapsed() and agent.closes == 2


async def test_a_failed_start_counts_nothing() -> None:
    clock = Clock()
    meter = SandboxMeter(clock)
    with pytest.raises(RuntimeError):
        await meter.start(Backend(clock, start_s=3.0, fail=True), Path("task"), lifetime_s=60)
    assert meter.seconds == 0.0 == meter.elapsed()
