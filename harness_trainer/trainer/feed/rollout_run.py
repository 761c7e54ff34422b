"""One rollout under the scheduler: its session made, waited on, its capture read, verified and scored.

:func:`run_rollout` drives one :class:`~harness_trainer.rollouts.client.contract.AsyncSession` (a sync one
comes wrapped, :mod:`.sync_adapter`) and closes it on every path; what it raises is the scheduler's to
judge (:mod:`.failures`). :class:`LiveSessions` holds the sessions open now, so that a stop or a fatal
failure closes them all at once from any thread.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel

from harness_trainer.rollouts.client.contract import (
    AsyncSession,
    AsyncSessionFactory,
    CapturedTrace,
    Verification,
)
from harness_trainer.trace import TrainingTrace, load_trace
from harness_trainer.trainer.step.groups import Group, Rollout
from harness_trainer.trainer.step.outcome import (
    HarnessRolloutOutcome,
    apply_reward_fn,
    build_outcome,
    completion_messages,
)
from harness_trainer.trainer.step.rows import build_rows

logger = logging.getLogger(__name__)

RewardFn = Callable[[HarnessRolloutOutcome], float | None]
"""A ``rollout_reward_fn``: a rollout's reward from its outcome (None: ungraded)."""


@dataclass(frozen=True)
class RolloutSettings:
    """What every rollout of a scheduler shares."""

    rollout_timeout: float | None
    vocab_size: int | None
    temperature: float | None
    """The temperature the trainer computes logprobs at; every captured turn must have sampled at it."""
    reward_fn: RewardFn | None


class LiveSessions:
    """The sessions open now; :meth:`close_all` closes them at once (any thread)."""

    def __init__(self) -> None:
        self._sessions: set[AsyncSession] = set()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def add(self, session: AsyncSession) -> None:
        with self._lock:
            self._sessions.add(session)

    def discard(self, session: AsyncSession) -> None:
        with self._lock:
            self._sessions.discard(session)

    def close_all(self) -> None:
        """Close every live session, in parallel (each close may block: a server's DELETE, a sandbox's
        stop); a failure is logged."""
        with self._lock:
            live = list(self._sessions)
        if not live:
            return
        with concurrent.futures.ThreadPoolExecutor(min(len(live), 16)) as closer:
            list(closer.map(_close, live))


async def run_rollout(
    factory: AsyncSessionFactory[AsyncSession],
    group: Group,
    rollout: Rollout,
    settings: RolloutSettings,
    live: LiveSessions,
    stopping: threading.Event,
) -> None:
    """Run ``rollout`` of ``group`` to its score (:func:`score`). A timeout keeps the captured turns and
    sets ``timed_out``; once ``stopping`` is set the rollout ends with a RuntimeError. The session is
    closed on every path."""
    session = await factory.acreate(group.row, seed=group.seed, episode_id=rollout.rollout_id)
    live.add(session)
    try:
        if stopping.is_set():  # the stop closed the live sessions before this one joined them
            raise RuntimeError("training stopped")
        try:
            await session.wait(timeout_s=settings.rollout_timeout)
        except TimeoutError:
            rollout.timed_out = True
        if stopping.is_set():
            raise RuntimeError("training stopped")
        trace = as_trace(await session.afetch_training_trace(), session.session_id)
        verify = await session.averify(completion_messages(trace.to_trace_entries()))
        score(rollout, trace, verify, session.session_id, settings)
    finally:
        live.discard(session)
        try:
            await session.aclose()
        except Exception:
            logger.warning("closing a rollout session failed", exc_info=True)


def score(
    rollout: Rollout,
    trace: TrainingTrace,
    verify: Verification,
    session_id: str | None,
    settings: RolloutSettings,
) -> None:
    """Rows, outcome and reward of a finished rollout; a reward function's failure propagates."""
    rollout.verify_metrics = dict(verify.metrics)
    reported = rollout.verify_metrics.get("capture_session_id")
    rollout.capture_session_id = reported if isinstance(reported, str) else rollout.capture_session_id
    rollout.trace = trace
    rollout.rows = build_rows(
        trace,
        vocab_size=settings.vocab_size,
        temperature=settings.temperature,
        session_id=rollout.capture_session_id or session_id,
    )
    rollout.findings = verify.artifacts.get("findings")
    rollout.outcome = build_outcome(trace, verify, timed_out=rollout.timed_out)
    rollout.timed_out = rollout.outcome.timed_out
    rollout.reward = apply_reward_fn(rollout.outcome, settings.reward_fn)


def as_trace(captured: CapturedTrace, session_id: str | None) -> TrainingTrace:
    """Our TrainingTrace from ours, OpenEnv's model, or plain JSON; malformed → CaptureContractError."""
    if isinstance(captured, TrainingTrace):
        return captured
    if isinstance(captured, BaseModel):
        return load_trace(captured.model_dump_json(), session_id=session_id)
    return load_trace(captured, session_id=session_id)


def _close(session: AsyncSession) -> None:
    try:
        session.close()
    except Exception:
        logger.warning("closing a rollout session failed", exc_info=True)
