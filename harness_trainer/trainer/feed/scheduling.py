"""Rollout scheduling: groups of sessions run in the background while the trainer trains.

Dataset rows are cycled in order (reshuffled per pass when asked), or chosen by a :class:`RowChooser` (a
curriculum, :mod:`.curriculum`); group ``i`` rolls its row out ``num_generations`` times with one seed. At
most ``concurrency_limit`` sessions are live (``max_concurrent_rollouts`` unless set; it may change while the
scheduler runs, :meth:`RolloutScheduler.set_concurrency_limit`: a lower limit stops new sessions from
starting until fewer are live, and cancels none); a new group is admitted only while groups in flight plus
groups finished but not yet taken stay within ``admission_limit`` ((max_staleness + 1) × groups per step),
which bounds how stale a trained rollout can be. With ``hold_taken`` (the trainer's), a taken group keeps
its place until :meth:`RolloutScheduler.release` frees it (its step trained and its weights pushed, or it
was dropped): released at the take instead, the next group would start sampling on the weights the taken
one is about to be trained from, one version more than ``max_staleness`` behind when it is trained.
The trainer takes finished groups in admission order, so the data order is reproducible and a resumed run
starts at the first group it had not taken.

Sessions follow OpenEnv's loop-owning protocol (:mod:`harness_trainer.rollouts.client.contract`), each
rollout run by :mod:`.rollout_run` on the scheduler's event loop (a sync factory's calls on a thread pool:
:mod:`.sync_adapter`). Every session is closed on every path: done, failed, stopped.

Failures, by kind (judged by :mod:`.failures`):

- An infrastructure failure (:data:`.failures.INFRASTRUCTURE_ERRORS`: the session's own
  :class:`RolloutUnscorable`, the rollout server refusing or gone, a sandbox, harness or capture error, a
  connection dropped or timed out) makes that rollout unscorable; the run goes on.
- A :class:`CaptureContractError`, or a ``rollout_reward_fn`` returning a bool, a non-number, NaN or
  infinity, is a bug: it stops the scheduler (after closing every live session) and is raised to the
  trainer.
- The run's first ``fail_fast_rollouts`` rollouts all failing one infrastructure way (one exception type
  and kind) stop the scheduler at once with a :class:`RolloutSchedulerError` naming it
  (:mod:`.first_rollouts`): an environment that cannot work fails every rollout, and finding out should
  cost seconds.
- Any other exception (a bug in the trainer's code, the factory's or a ``rollout_reward_fn`` that raises)
  is *unexpected* (counted and logged by :mod:`.unexpected`), its rollout unscorable; past
  ``max_unexpected_errors`` of them, or at a white-box harness adapter's second kind of bug in a row, the
  scheduler stops and the trainer gets a :class:`RolloutSchedulerError` whose cause is the last one. A
  reward function that raises counts here because it is user code that TRL would let raise: a broken one
  stops the run instead of quietly making every rollout unscorable. Nothing raised after the run began
  stopping is counted.
- The admission task, a group's task or the event loop's thread dying stops the scheduler too: the
  trainer's next :meth:`RolloutScheduler.next_group` raises a :class:`RolloutSchedulerError` caused by it.

Each finished rollout, failed ones included, is handed to ``on_rollout_done(group, rollout)`` (the run's
record, :mod:`.rollout_log`) in a worker thread, before its group can be taken.

Each rollout keeps its ``rollout_id`` (the episode id the factory was given, ``group{G}-member{M}``, which
the capture session's metadata records) and, once the session reports it, its ``capture_session_id`` (its
journal: ``DATA_DIR/sessions/ID``, :mod:`harness_trainer.rollouts.client.session`), unscorable ones too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from harness_trainer.rollouts.client.contract import MixesHarnesses, RolloutFactory
from harness_trainer.rollouts.errors import RolloutUnscorable
from harness_trainer.trainer.feed.failures import FailureKind, judge
from harness_trainer.trainer.feed.first_rollouts import FirstRollouts
from harness_trainer.trainer.feed.rollout_run import LiveSessions, RewardFn, RolloutSettings, run_rollout
from harness_trainer.trainer.feed.slots import Slots
from harness_trainer.trainer.feed.sync_adapter import as_async
from harness_trainer.trainer.feed.unexpected import UnexpectedErrors
from harness_trainer.trainer.step.groups import Group, Rollout

logger = logging.getLogger(__name__)


class RolloutSchedulerError(RuntimeError):
    """The scheduler stopped: a component died, or too many rollouts failed unexpectedly (cause chained)."""


class RowChooser(Protocol):
    """Decides each group's row at admission, told of each group as the trainer takes it.

    :meth:`choose` runs on the scheduler's loop thread, :meth:`taken` on the trainer's, inside
    :meth:`RolloutScheduler.next_group` before the take frees room for admission: a group admitted because
    group ``g`` was taken is chosen after ``taken(g)``. An implementation locks what the two share; what
    :meth:`taken` raises reaches the trainer (the group stays untaken).
    """

    def choose(self, index: int) -> int:
        """The row (position in the dataset) group ``index`` rolls out; called in increasing ``index``."""
        ...

    def taken(self, group: Group) -> None:
        """``group``, the next in admission order, is taken."""
        ...


@dataclass
class SchedulerConfig:
    num_generations: int
    max_concurrent_rollouts: int
    admission_limit: int
    rollout_timeout: float | None
    seed: int
    shuffle: bool = False
    vocab_size: int | None = None
    temperature: float | None = None
    """The temperature the trainer computes logprobs at; every captured turn must have sampled at it."""
    close_timeout_s: float = 60.0
    max_unexpected_errors: int = 3
    """Unexpected rollout errors tolerated; one more stops the scheduler (0: the first does)."""
    max_groups: int | None = None
    """Groups admitted in all, then none (an evaluation's one pass over its tasks); None: without end."""
    concurrency_limit: int | None = None
    """Sessions live at once at the start, in [1, max_concurrent_rollouts]; None: max_concurrent_rollouts."""
    fail_fast_rollouts: int = 0
    """When the first this many rollouts all fail one infrastructure way, stop (:mod:`.first_rollouts`)."""
    hold_taken: bool = False
    """A taken group counts against ``admission_limit`` until :meth:`RolloutScheduler.release` (module
    docstring); False: until it is taken."""


def row_order(num_rows: int, group: int, *, seed: int, shuffle: bool) -> int:
    """Which dataset row group ``group`` rolls out: rows in order, one pass after another."""
    epoch, position = divmod(group, num_rows)
    if not shuffle:
        return position
    order = list(range(num_rows))
    random.Random(seed + epoch).shuffle(order)
    return order[position]


class RolloutScheduler:
    """Runs rollout groups on a background event loop; the trainer pulls finished groups in order."""

    def __init__(
        self,
        factory: RolloutFactory,
        rows: Sequence[dict[str, Any]],
        config: SchedulerConfig,
        *,
        reward_fn: RewardFn | None = None,
        policy_version: Callable[[], int] = lambda: 0,
        start_group: int = 0,
        row_chooser: RowChooser | None = None,
        on_rollout_done: Callable[[Group, Rollout], None] | None = None,
    ) -> None:
        if not rows:
            raise ValueError("the training dataset has no rows")
        self.rows = list(rows)
        self.config = config
        self.policy_version = policy_version
        self.row_chooser = row_chooser
        self.on_rollout_done = on_rollout_done
        self.next_to_take = start_group
        self._next_to_admit = start_group
        self._released = start_group
        self._start_group_index = start_group
        self._finished: dict[int, Group] = {}
        self._cond = threading.Condition()
        self._live = LiveSessions()
        self._fatal: BaseException | None = None
        self._stopping = threading.Event()
        self._stopped = False
        self._unexpected_errors = UnexpectedErrors(config.max_unexpected_errors)
        self._first_rollouts = FirstRollouts(config.fail_fast_rollouts)
        self._loop = asyncio.new_event_loop()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            config.max_concurrent_rollouts, thread_name_prefix="rollout"
        )
        self._harness_for_group = factory.harness_for_group if isinstance(factory, MixesHarnesses) else None
        self.factory = as_async(factory, self._pool, self._stopping, made=self._live.add)
        """The factory as the async contract (a sync one's calls on the pool's threads)."""
        self._settings = RolloutSettings(
            config.rollout_timeout, config.vocab_size, config.temperature, reward_fn
        )
        self._thread = threading.Thread(target=self._run_loop, name="rollout-scheduler", daemon=True)
        self._space: asyncio.Event | None = None
        limit = (
            config.max_concurrent_rollouts if config.concurrency_limit is None else config.concurrency_limit
        )
        self._slots = Slots(self._check_limit(limit))
        self._main: concurrent.futures.Future | None = None
        self._tasks: set[asyncio.Task] = set()

    # -- the trainer's side ------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        self._main = asyncio.run_coroutine_threadsafe(self._admit(), self._loop)
        self._main.add_done_callback(self._admission_ended)

    def next_group(self, timeout: float | None = None) -> Group | None:
        """The next group in admission order once all its members are done; None on timeout.

        Raises:
            CaptureContractError: a rollout's capture was malformed.
            RewardFunctionError: the reward function returned something that is not a reward.
            RolloutSchedulerError: too many unexpected rollout errors, or a scheduler component died.
            Exception: what the row chooser's ``taken`` raised (the group stays untaken).
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
            if self.row_chooser is not None:  # before admission can see the take: see RowChooser
                self.row_chooser.taken(self._finished[self.next_to_take])
            group = self._finished.pop(self.next_to_take)
            self.next_to_take += 1
        if self._space is not None:
            self._loop.call_soon_threadsafe(self._space.set)
        return group

    def release(self, count: int | None = None) -> None:
        """Free the admission places of ``count`` more taken groups (None: of every group taken so far);
        only meaningful with ``hold_taken``. Any thread."""
        with self._cond:
            freed = self.next_to_take if count is None else self._released + count
            self._released = min(max(freed, self._released), self.next_to_take)
        if self._space is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._space.set)

    def live_sessions(self) -> int:
        return len(self._live)

    def set_concurrency_limit(self, limit: int) -> None:
        """Let at most ``limit`` rollouts be in flight from now on (any thread). A higher limit starts
        waiting rollouts at once; a lower one cancels none: no new rollout starts until fewer are in flight.

        Raises:
            ValueError: ``limit`` is not in [1, max_concurrent_rollouts].
        """
        self._check_limit(limit)
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._slots.set_limit, limit)
        else:  # not started (or stopped): nothing waits on the slots
            self._slots.set_limit(limit)

    @property
    def concurrency_limit(self) -> int:
        """The limit on rollouts in flight (the last one set reaches the loop soon after)."""
        return self._slots.limit

    def slot_counts(self) -> tuple[int, int]:
        """Rollouts holding a slot (in flight) and rollouts waiting for one, now."""
        return self._slots.held, self._slots.waiting

    def _check_limit(self, limit: int) -> int:
        ceiling = self.config.max_concurrent_rollouts
        if not (isinstance(limit, int) and 1 <= limit <= ceiling):
            raise ValueError(
                f"the concurrency limit must be in [1, max_concurrent_rollouts={ceiling}], got {limit!r}"
            )
        return limit

    def stop(self) -> None:
        """Stop admitting, close every live session, and wait (bounded) for the members to wind down. A
        second call does nothing."""
        if self._stopped:
            return
        self._stopped = True
        self._stopping.set()
        self._live.close_all()
        if self._thread.is_alive():
            future = asyncio.run_coroutine_threadsafe(self._drain(), self._loop)
            try:
                future.result(self.config.close_timeout_s)
            except (concurrent.futures.TimeoutError, Exception):
                logger.warning("rollouts did not wind down within %.0f s", self.config.close_timeout_s)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        else:  # the loop died (or never ran): nothing drained the members still in the pool's threads
            waiter = threading.Thread(
                target=self._pool.shutdown, kwargs={"wait": True, "cancel_futures": True}, daemon=True
            )
            waiter.start()
            waiter.join(self.config.close_timeout_s)
        self._live.close_all()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if not self._loop.is_running():
            self._loop.close()
        with self._cond:
            self._cond.notify_all()

    # -- the loop's side ---------------------------------------------------------------------------------

    def _run_loop(self) -> None:
        died: BaseException | None = None
        try:
            self._loop.run_forever()
        except BaseException as exc:  # the thread's end is silent otherwise: the trainer would wait forever
            died = exc
        if died is not None or not self._stopping.is_set():
            self._fail(_died("event loop thread", died))

    def _admission_ended(self, future: concurrent.futures.Future) -> None:
        if future.cancelled():
            return  # stop() cancels it
        error = future.exception()
        if error is not None or not self._stopping.is_set():
            self._fail(_died("admission task", error))

    def _group_ended(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            if not self._stopping.is_set():  # its group would never finish: the trainer would wait forever
                self._fail(_died(f"task of {task.get_name()}", asyncio.CancelledError("cancelled")))
        elif task.exception() is not None:
            self._fail(_died(f"task of {task.get_name()}", task.exception()))

    async def _admit(self) -> None:
        self._space = asyncio.Event()
        while not self._stopping.is_set():
            with self._cond:
                held = self._released if self.config.hold_taken else self.next_to_take
                in_system = self._next_to_admit - held
            if in_system >= self.config.admission_limit or self._admitted_all():
                self._space.clear()
                await self._space.wait()
                continue
            self._start_group(self._next_to_admit)
            self._next_to_admit += 1

    def _admitted_all(self) -> bool:
        limit = self.config.max_groups
        return limit is not None and self._next_to_admit - self._start_group_index >= limit

    def _start_group(self, index: int) -> None:
        if self.row_chooser is not None:
            position = self.row_chooser.choose(index)
        else:
            position = row_order(len(self.rows), index, seed=self.config.seed, shuffle=self.config.shuffle)
        harness = self._harness_for_group(index) if self._harness_for_group is not None else None
        group = Group(index, self.rows[position], self.config.seed + index, [], harness=harness)
        members = [Rollout(index, m) for m in range(self.config.num_generations)]
        group.rollouts = members
        task = asyncio.ensure_future(self._run_group(group))
        task.set_name(f"group {index}")
        self._tasks.add(task)
        task.add_done_callback(self._group_ended)

    async def _run_group(self, group: Group) -> None:
        # Every member ends before its group does, a failed one's siblings too: the stop waits for group
        # tasks only, and a sibling left running (its session made, not yet listed live) would be left
        # open when the loop stops.
        ended = await asyncio.gather(
            *(self._run_member(group, rollout) for rollout in group.rollouts), return_exceptions=True
        )
        for outcome in ended:
            if isinstance(outcome, BaseException):
                raise outcome
        with self._cond:
            self._finished[group.index] = group
            self._cond.notify_all()

    async def _run_member(self, group: Group, rollout: Rollout) -> None:
        async with self._slots:
            started = time.monotonic()
            try:
                rollout.policy_version = self.policy_version()
                if self._stopping.is_set():
                    raise RuntimeError("training stopped before this rollout started")
                await run_rollout(self.factory, group, rollout, self._settings, self._live, self._stopping)
            except Exception as exc:
                self._failed(group, rollout, exc)
            except asyncio.CancelledError as exc:
                task = asyncio.current_task()
                if task is None or task.cancelling():
                    raise
                self._failed(
                    group, rollout, exc
                )  # what it awaited was cancelled (its factory closing), not it
            else:
                self._unexpected_errors.rollout_succeeded()
                self._first_rollouts.succeeded()
            rollout.seconds = time.monotonic() - started
        if self.on_rollout_done is not None:
            # Off the loop (a long trace takes a while to write); a failure ends its group's task, which
            # stops the scheduler: a run that cannot keep its record does not go on.
            await self._loop.run_in_executor(None, self.on_rollout_done, group, rollout)

    def _failed(self, group: Group, rollout: Rollout, exc: BaseException) -> None:
        """Make ``rollout`` unscorable for ``exc``, and stop the scheduler when ``exc`` says so (module
        docstring)."""
        if isinstance(exc, RolloutUnscorable):
            rollout.capture_session_id = rollout.capture_session_id or exc.capture_session_id
        verdict = judge(exc, stopping=self._stopping.is_set())
        rollout.unscorable = verdict.reason
        if verdict.kind is FailureKind.FATAL:
            self._fail(exc)
        elif verdict.kind is FailureKind.UNEXPECTED:
            self._first_rollouts.succeeded()  # a bug is not the environment failing: judged apart
            self._unexpected(rollout, exc)
        elif not self._stopping.is_set():
            where = f"rollout {rollout.rollout_id} of task {group.row.get('task_name', '?')}"
            if (reason := self._first_rollouts.failed(where, exc)) is not None:
                error = RolloutSchedulerError(reason)
                error.__cause__ = exc
                self._fail(error)

    def _unexpected(self, rollout: Rollout, exc: BaseException) -> None:
        """Count a bug's exception (:mod:`.unexpected`), and stop the scheduler when that says so."""
        if self._stopping.is_set():
            return  # raised while the run stops (sessions closed under it): not counted
        where = f"rollout {rollout.rollout_id} (capture session {rollout.capture_session_id})"
        reason = self._unexpected_errors.add(where, exc)
        if reason is not None:
            error = RolloutSchedulerError(reason)
            error.__cause__ = exc
            self._fail(error)

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            if self._fatal is None:
                self._fatal = exc
        self._stopping.set()
        threading.Thread(target=self._live.close_all, name="close-sessions", daemon=True).start()
        with self._cond:
            self._cond.notify_all()

    async def _drain(self) -> None:
        if self._space is not None:
            self._space.set()
        if self._main is not None:
            self._main.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self.config.close_timeout_s)


def _died(what: str, error: BaseException | None) -> RolloutSchedulerError:
    """The trainer's error for a scheduler component that ended while the run was going on."""
    reason = f": {type(error).__name__}: {error}" if error is not None else " without an error"
    died = RolloutSchedulerError(f"the rollout scheduler's {what} died{reason}")
    died.__cause__ = error
    return died
