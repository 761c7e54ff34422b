"""``finish``: cleanup awaited to its end through every cancellation of its caller, which is then raised."""

from __future__ import annotations

import asyncio

import pytest

from harness_trainer.finish import finish


async def _slow(steps: list[str], error: Exception | None = None) -> str:
    for name in ("first", "second", "third"):
        await asyncio.sleep(0.02)
        steps.append(name)
    if error is not None:
        raise error
    return "done"


async def test_an_uncancelled_caller_gets_the_result_or_the_error() -> None:
    assert await finish(_slow([])) == "done"
    with pytest.raises(ValueError, match="broken"):
        await finish(_slow([], ValueError("broken")))


async def test_work_runs_to_its_end_through_two_cancellations_and_the_cancellation_is_raised_after() -> None:
    steps: list[str] = []
    caller = asyncio.ensure_future(finish(_slow(steps)))
    await asyncio.sleep(0.01)
    caller.cancel()
    await asyncio.sleep(0.02)
    caller.cancel()  # cancelled again while finishing, as a stopping run does
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert steps == ["first", "second", "third"]


async def test_an_error_of_work_whose_caller_was_cancelled_is_chained_to_the_cancellation() -> None:
    caller = asyncio.ensure_future(finish(_slow([], ValueError("broken"))))
    await asyncio.sleep(0.01)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError) as raised:
        await caller
    assert isinstance(raised.value.__cause__, ValueError)
