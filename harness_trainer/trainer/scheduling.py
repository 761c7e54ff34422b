"""Rollout scheduling: groups of sessions run in the background while the trainer trains.

Dataset rows are cycled in order (reshuffled per pass when asked); group ``i`` rolls row ``i`` out
``num_generations`` times with one seed. At most ``max_concurrent_rollouts`` sessions are live; a new group
is admitted only while groups in flight plus groups finished but not yet taken stay within
``admission_limit`` ((max_staleness + 1) × groups per step), which bounds how stale a trained rollout can be.
The trainer takes finished groups in admission order, so the data order is reproducible and a resumed run
starts at the first group it had not taken.

Sessions follow OpenEnv's loop-owning protocol: sync sessions run in a thread pool; a factory with a
coroutine ``acreate`` and sessions with ``wait`` / ``afetch_training_trace`` / ``averify`` / ``aclose`` run
natively on the scheduler's event loop. Every session is closed on every path: done, failed, stopped.
Transport failures make a rollout unscorable; a :class:`CaptureContractError` is a bug, so it stops the
scheduler (after closing every live session) and is raised to the trainer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import random
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from harness_trainer.trace import CaptureContractError, TrainingTrace, load_trace
from harness_trainer.trainer.outcome import (
    HarnessRolloutOutcome,
    RewardFunctionError,
    apply_reward_fn,
    build_outcome,
    completion_messages,
)
from harness_trainer.trainer.rows import Row, build_rows

logger = logging.getLogger(__name__)

RewardFn = Callable[[HarnessRolloutOutcome], float | None]


@dataclass
class Rollout:
    """One member of a group, once its session is over."""

    group: int
    member: int
    policy_version: int = 0
    reward: float | None = None
    outcome: HarnessRolloutOutcome | None = None
    trace: TrainingTrace | None = None
    rows: list[Row] = field(default_factory=list)
    unscorable: str | None = None
    timed_out: bool = False
    seconds: float = 0.0
    verify_metrics: dict[str, Any] = field(default_factory=dict)
    findings: list[Any] | None = None

    @property
    def scored(self) -> bool:
        return self.unscorable is None and self.reward is not None


@dataclass
class Group:
    """``num_generations`` rollouts of one dataset row with one seed."""

    index: int
    row: dict[str, Any]
    seed: int
    rollouts: list[Rollout]

    @property
    def scored(self) -> list[Rollout]:
        return [r for r in self.rollouts if r.scored]


@dataclass
class SchedulerConfig:
    num_generations: int
    max_concurrent_rollouts: int
    admission_limit: int
    agent_timeout: float | None
    seed: int
    shuffle: bool = False
    vocab_size: int | None = None
    close_timeout_s: float = 60.0


def row_order(num_rows: int, group: int, *, seed: int, shuffle: bool) -> int:
    """Which dataset row group ``group`` rolls out: rows in order, one pass after another."""
    epoch, position = divmod(group, num_rows)
    if not shuffle:
        return position
    order = list(range(num_rows))
    random.Random(seed + epoch).shuffle(order)
    return order[position]


def _is_async(factory: Any) -> bool:
    return inspect.iscoroutinefunction(getattr(factory, "acreate", None))


def _as_trace(captured: Any, session_id: str | None) -> TrainingTrace:
    """Our TrainingTrace from ours, OpenEnv's model, or plain JSON; malformed → CaptureContractError."""
    if isinstance(captured, TrainingTrace):
        return captured
    if hasattr(captured, "model_dump_json"):
        return load_trace(captured.model_dump_json(), session_id=session_id)
    return load_trace(captured, session_id=session_id)


class RolloutScheduler:
    """Runs rollout groups on a background event loop; the trainer pulls finished groups in order."""

    def __init__(
        self,
        factory: Any,
        rows: Sequence[dict[str, Any]],
        config: SchedulerConfig,
        *,
        reward_fn: RewardFn | None = None,
        policy_version: Callable[[], int] = lambda: 0,
        start_group: int = 0,
    ) -> None:
        if not rows:
            raise ValueError("the training dataset has no rows")
        self.factory = factory
        self.rows = list(rows)
        self.config = config
        self.reward_fn = reward_fn
        self.policy_version = policy_version
        self.next_to_take = start_group
        self._next_to_admit = start_group
        self._finished: dict[int, Group] = {}
        self._cond = threading.Condition()
        self._live: set[Any] = set()
        self._live_lock = threading.Lock()
        self._fatal: BaseException | None = None
        self._stopping = threading.Event()
        self._reward_error_logged = False
        self._loop = asyncio.new_event_loop()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            config.max_concurrent_rollouts, thread_name_prefix="rollout"
        )
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-scheduler", daemon=True)
        self._space: asyncio.Event | None = None
        self._slots: asyncio.Semaphore | None = None
        self._main: concurrent.futures.Future | None = None
        self._tasks: set[asyncio.Task] = set()

    # -- the trainer's side ------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        self._main = asyncio.run_coroutine_threadsafe(self._admit(), self._loop)

    def next_group(self, timeout: float | None = None) -> Group | None:
        """The next group in admission order once all its members are done; None on timeout.

        Raises the scheduler's fatal error (a CaptureContractError) once every session is closed.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._fatal is not None or self.next_to_take not in self._finished:
                if self._fatal is not None:
                    raise self._fatal
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(left if left is not None else 1.0)
            group = self._finished.pop(self.next_to_take)
            self.next_to_take += 1
        if self._space is not None:
            self._loop.call_soon_threadsafe(self._space.set)
        return group

    def live_sessions(self) -> int:
        with self._live_lock:
            return len(self._live)

    def stop(self) -> None:
        """Stop admitting, close every live session, and wait (bounded) for the members to wind down."""
        if self._stopping.is_set() and not self._thread.is_alive():
            return
        self._stopping.set()
        self._close_live()
        if self._thread.is_alive():
            future = asyncio.run_coroutine_threadsafe(self._drain(), self._loop)
            try:
                future.result(self.config.close_timeout_s)
            except (concurrent.futures.TimeoutError, Exception):
                logger.warning("rollouts did not wind down within %.0f s", self.config.close_timeout_s)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._close_live()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if not self._loop.is_running():
            self._loop.close()
        with self._cond:
            self._cond.notify_all()

    # -- the loop's side ---------------------------------------------------------------------------------

    async def _admit(self) -> None:
        self._space = asyncio.Event()
        self._slots = asyncio.Semaphore(self.config.max_concurrent_rollouts)
        while not self._stopping.is_set():
            with self._cond:
                in_system = self._next_to_admit - self.next_to_take
            if in_system >= self.config.admission_limit:
                self._space.clear()
                await self._space.wait()
                continue
            self._start_group(self._next_to_admit)
            self._next_to_admit += 1

    def _start_group(self, index: int) -> None:
        position = row_order(len(self.rows), index, seed=self.config.seed, shuffle=self.config.shuffle)
        group = Group(index, self.rows[position], self.config.seed + index, [])
        members = [Rollout(index, m) for m in range(self.config.num_generations)]
        group.rollouts = members
        task = asyncio.ensure_future(self._run_group(group))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_group(self, group: Group) -> None:
        await asyncio.gather(*(self._run_member(group, rollout) for rollout in group.rollouts))
        with self._cond:
            self._finished[group.index] = group
            self._cond.notify_all()

    async def _run_member(self, group: Group, rollout: Rollout) -> None:
        assert self._slots is not None
        async with self._slots:
            started = time.monotonic()
            rollout.policy_version = self.policy_version()
            try:
                if self._stopping.is_set():
                    raise RuntimeError("training stopped before this rollout started")
                if _is_async(self.factory):
                    await self._rollout_async(group, rollout)
                else:
                    await self._loop.run_in_executor(self._pool, self._rollout_sync, group, rollout)
            except (CaptureContractError, RewardFunctionError) as exc:
                self._fail(exc)
                rollout.unscorable = f"fatal: {exc}"
            except Exception as exc:
                rollout.unscorable = rollout.unscorable or f"{type(exc).__name__}: {exc}"
            rollout.seconds = time.monotonic() - started

    def _rollout_sync(self, group: Group, rollout: Rollout) -> None:
        session = self.factory.create(group.row, seed=group.seed, episode_id=_episode(group, rollout))
        self._track(session)
        try:
            try:
                session.wait_for_completion(timeout_s=self.config.agent_timeout)
            except TimeoutError:
                rollout.timed_out = True
            if self._stopping.is_set():
                raise RuntimeError("training stopped")
            trace = _as_trace(session.fetch_training_trace(), getattr(session, "session_id", None))
            verify = session.verify(completion_messages(trace.to_trace_entries()))
            self._score(rollout, trace, verify, session)
        finally:
            self._untrack(session)

    async def _rollout_async(self, group: Group, rollout: Rollout) -> None:
        session = await self.factory.acreate(group.row, seed=group.seed, episode_id=_episode(group, rollout))
        self._track(session)
        try:
            try:
                await session.wait(timeout_s=self.config.agent_timeout)
            except TimeoutError:
                rollout.timed_out = True
            trace = _as_trace(await session.afetch_training_trace(), getattr(session, "session_id", None))
            verify = await session.averify(completion_messages(trace.to_trace_entries()))
            self._score(rollout, trace, verify, session)
        finally:
            self._untrack(session)
            await session.aclose()

    def _score(self, rollout: Rollout, trace: TrainingTrace, verify: Any, session: Any) -> None:
        session_id = getattr(session, "session_id", None)
        rollout.trace = trace
        rollout.rows = build_rows(trace, vocab_size=self.config.vocab_size, session_id=session_id)
        rollout.verify_metrics = dict(getattr(verify, "metrics", None) or {})
        rollout.findings = (getattr(verify, "artifacts", None) or {}).get("findings")
        rollout.outcome = build_outcome(trace, verify, timed_out=rollout.timed_out)
        rollout.timed_out = rollout.outcome.timed_out
        try:
            rollout.reward = apply_reward_fn(rollout.outcome, self.reward_fn)
        except RewardFunctionError as exc:
            if exc.__cause__ is None:
                # A NaN, a bool or a string is a bug in the user's function: stop and name it.
                self._fail(exc)
                raise
            rollout.unscorable = f"reward function failed: {exc}"
            if not self._reward_error_logged:
                self._reward_error_logged = True
                logger.error(
                    "rollout_reward_fn failed; the rollout is unscorable:\n%s", traceback.format_exc()
                )
            else:
                logger.warning("rollout_reward_fn failed again: %s", exc)

    def _track(self, session: Any) -> None:
        with self._live_lock:
            self._live.add(session)
        if self._stopping.is_set():
            _close(session)

    def _untrack(self, session: Any) -> None:
        with self._live_lock:
            self._live.discard(session)
        _close(session)

    def _close_live(self) -> None:
        with self._live_lock:
            live = list(self._live)
        if not live:
            return
        with concurrent.futures.ThreadPoolExecutor(min(len(live), 16)) as closer:
            list(closer.map(_close, live))

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            if self._fatal is None:
                self._fatal = exc
        self._stopping.set()
        threading.Thread(target=self._close_live, name="close-sessions", daemon=True).start()
        with self._cond:
            self._cond.notify_all()

    async def _drain(self) -> None:
        if self._space is not None:
            self._space.set()
        if self._main is not None:
            self._main.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self.config.close_timeout_s)


def _episode(group: Group, rollout: Rollout) -> str:
    return f"group{group.index}-member{rollout.member}"


def _close(session: Any) -> None:
    try:
        closer = getattr(session, "close", None)
        if closer is not None:
            closer()
    except Exception:
        logger.warning("closing a rollout session failed", exc_info=True)
