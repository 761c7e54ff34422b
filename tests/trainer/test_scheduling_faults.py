"""The rollout scheduler's faults: what is infrastructure, what is a bug, and what happens when a part of the
scheduler itself dies. Sessions are hand-made, or the real server and in-process session classes over
results already in hand; every wait is bounded, so a scheduler that would hang fails instead."""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from capture_proxy.admin_client import CaptureError
from harness_trainer.harnesses.base import HarnessError
from harness_trainer.rollouts.client.factory import HarborSession, RolloutServerError
from harness_trainer.rollouts.client.local_factory import LocalSession
from harness_trainer.rollouts.client.session import RolloutUnscorable
from harness_trainer.rollouts.errors import RolloutServerBug, error_for
from harness_trainer.rollouts.result import RolloutResult
from harness_trainer.sandboxes.base import SandboxError
from harness_trainer.trainer.feed import rollout_run, scheduling
from harness_trainer.trainer.feed.scheduling import RolloutScheduler, RolloutSchedulerError, SchedulerConfig
from harness_trainer.trainer.step.groups import Group
from harness_trainer.trainer.step.outcome import RewardFunctionError
from tests.trainer.handmade import HandmadeFactory, chain_trace

PROMPT_S = 10.0
"""How long a failing scheduler may take to raise: far above what it needs, far below a hang."""


def make(factory: Any, *, reward_fn: Any = None, **overrides: Any) -> RolloutScheduler:
    settings = dict(
        num_generations=4, max_concurrent_rollouts=4, admission_limit=1, rollout_timeout=30.0, seed=0,
        close_timeout_s=10.0,
    )  # fmt: skip
    settings.update(overrides)
    scheduler = RolloutScheduler(
        factory, factory.prompt_rows(), SchedulerConfig(**settings), reward_fn=reward_fn
    )
    scheduler.start()
    return scheduler


def take(scheduler: RolloutScheduler, n: int) -> list[Group]:
    """``n`` groups; each must come within PROMPT_S (None from next_group is a hang, and fails here)."""
    groups = []
    for _ in range(n):
        group = scheduler.next_group(timeout=PROMPT_S)
        assert group is not None, "the scheduler neither gave a group nor raised"
        groups.append(group)
    return groups


# -- the ids each rollout carries, through the real session classes -----------------------------------------


def result_of(member: int) -> RolloutResult:
    """Member 0 scored, 1 unscorable after its capture session was minted, 2 unscorable before, 3 scored."""
    common = dict(task_name="t0", harness="opencode", sandbox="local", exit_code=0)
    capture = None if member == 2 else f"cs_member{member}"
    if member in (1, 2):
        return RolloutResult(**common, capture_session_id=capture, error="SandboxError: sandbox died")
    return RolloutResult(**common, capture_session_id=capture, reward=float(member % 2),
                         trace=chain_trace(0, member))  # fmt: skip


def member_of(episode_id: str | None) -> int:
    assert episode_id is not None and episode_id.startswith("group0-member")
    return int(episode_id.removeprefix("group0-member"))


class FinishedLocalFactory:
    """In-process sessions (the real ``LocalSession``) whose rollouts have already finished."""

    def __init__(self, *, asynchronous: bool = False) -> None:
        self._sessions: set[LocalSession] = set()
        self._loop = None  # a finished rollout is never stopped for a timeout
        if asynchronous:
            self.acreate = self._acreate

    def prompt_rows(self) -> list[dict[str, Any]]:
        return [{"prompt": [{"role": "user", "content": "task 0"}], "task_index": 0, "task_name": "t0"}]

    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> LocalSession:
        future: concurrent.futures.Future[RolloutResult] = concurrent.futures.Future()
        future.set_result(result_of(member_of(episode_id)))
        session = LocalSession(self, future, asyncio.Event(), wait_timeout_s=60)  # type: ignore[arg-type]
        self._sessions.add(session)
        return session

    async def _acreate(
        self, task: Any, seed: int | None = None, episode_id: str | None = None
    ) -> LocalSession:
        return self.create(task, seed, episode_id)

    def check_reward_key(self, result: RolloutResult) -> None:
        """No ``reward_key`` was given: nothing to check (what the real factories do then)."""


class FinishedServer:
    """A rollout server's answers to ``HarborSession`` (the real client session), rollouts already done.
    Its session ids (``srv-…``) are not capture session ids: the log must name the capture ones."""

    def __init__(self) -> None:
        self.results: dict[str, RolloutResult] = {}
        self.deleted: list[str] = []

    def prompt_rows(self) -> list[dict[str, Any]]:
        return FinishedLocalFactory().prompt_rows()

    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> HarborSession:
        session_id = f"srv-{len(self.results)}"
        self.results[session_id] = result_of(member_of(episode_id))
        return HarborSession(self, session_id, wait_timeout_s=60)  # type: ignore[arg-type]

    def check_reward_key(self, result: RolloutResult) -> None:
        """No ``reward_key`` was given: nothing to check (what the real factories do then)."""

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        session_id = path.split("/")[2]
        if method == "DELETE":
            self.deleted.append(session_id)
            return {}
        if path.endswith("/trace"):
            return self.results[session_id].trace
        return {"status": "done", "result": self.results[session_id].model_dump(mode="json")}


@pytest.mark.parametrize("kind", ["in-process", "in-process, async", "rollout server"])
def test_every_rollout_carries_its_rollout_id_and_capture_session_id_unscorable_ones_too(kind: str) -> None:
    factory: Any = {
        "in-process": FinishedLocalFactory(),
        "in-process, async": FinishedLocalFactory(asynchronous=True),
        "rollout server": FinishedServer(),
    }[kind]
    scheduler = make(factory, max_unexpected_errors=0)  # any unexpected error would stop it
    try:
        (group,) = take(scheduler, 1)
    finally:
        scheduler.stop()
    assert [r.rollout_id for r in group.rollouts] == [f"group0-member{m}" for m in range(4)]
    assert [r.capture_session_id for r in group.rollouts] == ["cs_member0", "cs_member1", None, "cs_member3"]
    assert [r.unscorable is None for r in group.rollouts] == [True, False, False, True]
    assert "sandbox died" in (group.rollouts[1].unscorable or "")
    assert [r.reward for r in group.scored] == [0.0, 1.0]
    if isinstance(factory, FinishedServer):
        assert sorted(factory.deleted) == sorted(factory.results)  # every server session closed


# -- infrastructure failures and bugs ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "error",
    [
        RolloutUnscorable("sandbox would not start"),
        RolloutServerError("rollout server unreachable"),
        SandboxError("sandbox gone"),
        HarnessError("install failed"),
        CaptureError("capture proxy unreachable"),
        ConnectionResetError("connection reset"),
        concurrent.futures.CancelledError(),
    ],
    ids=lambda error: type(error).__name__,
)
def test_infrastructure_failures_make_rollouts_unscorable_without_counting_as_bugs(error: Exception) -> None:
    factory = HandmadeFactory(fail_wait=lambda n: error if n % 4 != 0 else None)
    scheduler = make(factory, max_unexpected_errors=0)
    try:
        groups = take(scheduler, 2)
    finally:
        scheduler.stop()
    for group in groups:
        assert [r.unscorable is None for r in group.rollouts].count(True) == 1
        assert all(r.unscorable.startswith(type(error).__name__) for r in group.rollouts if r.unscorable)
    assert not factory.live


def test_the_first_rollouts_all_failing_one_infrastructure_way_stop_the_run_at_once() -> None:
    """Every start refused the same way (an image the agent cannot install in): the 8th failure stops the
    run, naming the kind and the rollouts, instead of dropping group after group."""
    error = RolloutUnscorable(
        "rollout of t0 is unscorable: installing the agent exited with 127", kind="harness"
    )
    factory = HandmadeFactory(fail_wait=lambda n: error)
    scheduler = make(factory, fail_fast_rollouts=8, admission_limit=4)
    began = time.monotonic()
    try:
        with pytest.raises(
            RolloutSchedulerError, match=r"first 8 rollouts all failed the same way"
        ) as raised:
            take(scheduler, 10)
    finally:
        scheduler.stop()
    assert time.monotonic() - began < PROMPT_S
    message = str(raised.value)
    assert "RolloutUnscorable, kind harness" in message and "agent exited with 127" in message
    assert re.search(r"The first: rollout group\d+-member\d+ of task t\d", message)  # in order of ending
    assert raised.value.__cause__ is error
    assert len(factory.created) < 8 + 4 * 4  # stopped at the 8th failure: nothing near 32 groups
    assert not factory.live


@pytest.mark.parametrize(
    "fail",
    [
        lambda n: RolloutUnscorable("sandbox", kind="sandbox" if n % 2 else "harness"),  # two kinds
        lambda n: (
            None if n == 5 else RolloutUnscorable("sandbox would not start", kind="sandbox")
        ),  # a success
    ],
    ids=["two-kinds", "one-success"],
)
def test_a_run_whose_first_rollouts_fail_in_more_than_one_way_or_once_succeed_goes_on(fail: Any) -> None:
    factory = HandmadeFactory(fail_wait=fail)
    scheduler = make(factory, fail_fast_rollouts=8, max_concurrent_rollouts=1)
    try:
        groups = take(scheduler, 4)  # 16 rollouts, past the first 8: no stop
    finally:
        scheduler.stop()
    assert sum(r.unscorable is not None for g in groups for r in g.rollouts) >= 15


@pytest.mark.parametrize(("kind", "counted"), [("unexpected", True), ("sandbox", False), ("harness", False)])
def test_a_bug_where_the_rollout_ran_counts_against_max_unexpected_errors(kind: str, counted: bool) -> None:
    """The rollout server (or the in-process runtime) reports its own bug as ``error_kind="unexpected"``:
    the trainer counts it as a bug, not as the infrastructure failing."""
    failed = RolloutResult(
        task_name="t1", harness="toy", sandbox="local", error="KeyError: 'x'", error_kind=kind
    )
    error = error_for(failed)
    assert isinstance(error, RolloutServerBug) is counted and error.kind == kind
    factory = HandmadeFactory(fail_wait=lambda n: error if n % 4 == 1 else None)
    scheduler = make(factory, max_unexpected_errors=0)
    try:
        if counted:
            with pytest.raises(RolloutSchedulerError, match=r"max_unexpected_errors=0") as raised:
                take(scheduler, 2)
            assert raised.value.__cause__ is error
        else:
            assert all(g.rollouts[1].unscorable for g in take(scheduler, 2))
    finally:
        scheduler.stop()
    assert not factory.live


def test_an_unexpected_error_is_logged_with_its_traceback_and_leaves_its_rollout_unscorable(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = rollout_run.build_rows

    def buggy(trace: Any, **kwargs: Any) -> Any:
        if trace.turns[0].completion_token_ids[0] == 101:  # member 1's trace
            raise ZeroDivisionError("a bug in row building")
        return real(trace, **kwargs)

    monkeypatch.setattr(rollout_run, "build_rows", buggy)
    factory = HandmadeFactory()
    scheduler = make(factory, max_unexpected_errors=3, max_concurrent_rollouts=1)  # session n: member n % 4
    try:
        groups = take(scheduler, 3)  # three bugs, all tolerated
    finally:
        scheduler.stop()
    for group in groups:
        assert [r.unscorable is None for r in group.rollouts] == [True, False, True, True]
        broken = group.rollouts[1]
        assert broken.unscorable == "unexpected ZeroDivisionError: a bug in row building"
        assert broken.capture_session_id is not None and broken.capture_session_id.startswith("cs-hand-")
    logged = [r.getMessage() for r in caplog.records if "failed unexpectedly" in r.getMessage()]
    assert len(logged) == 3
    first, *again = logged
    assert "rollout group0-member1 (capture session cs-hand-" in first
    assert "Traceback" in first and "in buggy" in first and "(1 of 3 tolerated" in first
    assert all("Traceback" not in line and "failed unexpectedly again" in line for line in again)
    assert not factory.live


@pytest.mark.parametrize("allowed", [0, 2])
def test_one_unexpected_error_more_than_allowed_stops_the_scheduler_with_it_as_the_cause(
    allowed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Members 1 and 3 of each group fail; the others hang until closed, so only the stop can end them.
    factory = HandmadeFactory(
        fail_wait=lambda n: KeyError(f"bug {n}") if n % 2 else None, hang=lambda n: n % 2 == 0,
    )  # fmt: skip
    scheduler = make(factory, max_unexpected_errors=allowed, admission_limit=2)
    started = time.monotonic()
    try:
        with pytest.raises(RolloutSchedulerError) as raised:
            take(scheduler, 1)
    finally:
        scheduler.stop()
    assert time.monotonic() - started < PROMPT_S
    assert (
        f"{allowed + 1} rollouts failed with unexpected errors, more than max_unexpected_errors={allowed}"
        in (str(raised.value))
    )
    assert isinstance(raised.value.__cause__, KeyError)
    assert raised.value.__cause__.__traceback__ is not None  # the bug's own traceback, chained
    assert not factory.live and factory.closed == len(factory.created)


def test_a_reward_function_that_raises_counts_as_a_bug_and_stops_the_run_past_the_limit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken_reward(outcome: Any) -> float:
        return outcome.no_such_field

    factory = HandmadeFactory()
    scheduler = make(factory, reward_fn=broken_reward, max_unexpected_errors=2, max_concurrent_rollouts=1)
    try:
        with pytest.raises(RolloutSchedulerError, match="broken_reward raised AttributeError") as raised:
            take(scheduler, 1)
    finally:
        scheduler.stop()
    reward_error = raised.value.__cause__
    assert isinstance(reward_error, RewardFunctionError)
    assert isinstance(reward_error.__cause__, AttributeError)  # the user's own exception, chained
    tracebacks = [r.getMessage() for r in caplog.records if "Traceback" in r.getMessage()]
    assert len(tracebacks) == 1 and "outcome.no_such_field" in tracebacks[0]  # logged once, from its line
    assert not factory.live


# -- a part of the scheduler dies --------------------------------------------------------------------------


def test_admission_that_dies_is_raised_from_next_group_instead_of_waiting_forever(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = scheduling.row_order

    def broken(num_rows: int, group: int, **kwargs: Any) -> int:
        if group >= 2:
            raise IndexError("a bug in admission")
        return real(num_rows, group, **kwargs)

    monkeypatch.setattr(scheduling, "row_order", broken)
    factory = HandmadeFactory(hang=lambda n: n >= 4)  # group 1 runs until closed
    scheduler = make(factory, admission_limit=2)
    try:
        take(scheduler, 1)  # taking group 0 lets admission go on, to group 2
        started = time.monotonic()
        with pytest.raises(RolloutSchedulerError, match="admission task died: IndexError") as raised:
            take(scheduler, 1)
    finally:
        scheduler.stop()
    assert time.monotonic() - started < PROMPT_S
    assert isinstance(raised.value.__cause__, IndexError)
    assert not factory.live and factory.closed == len(factory.created) == 8


def test_a_group_task_that_dies_is_raised_from_next_group(monkeypatch: pytest.MonkeyPatch) -> None:
    factory = HandmadeFactory()
    scheduler = RolloutScheduler(
        factory, factory.prompt_rows(),
        SchedulerConfig(num_generations=2, max_concurrent_rollouts=2, admission_limit=1, rollout_timeout=None,
                        seed=0, close_timeout_s=10.0),
    )  # fmt: skip

    async def broken_member(group: Group, rollout: Any) -> None:
        raise AssertionError("a bug outside any rollout's own handling")

    monkeypatch.setattr(scheduler, "_run_member", broken_member)
    scheduler.start()
    try:
        with pytest.raises(RolloutSchedulerError, match="task of group 0 died: AssertionError"):
            take(scheduler, 1)
    finally:
        scheduler.stop()


def kill_the_loop(scheduler: RolloutScheduler, after_s: float = 0.0) -> None:
    """Queue a BaseException (which leaves ``run_forever``) on ``scheduler``'s loop, raised ``after_s`` in."""

    def die() -> None:
        time.sleep(after_s)
        raise SystemExit("the loop's thread ends")

    scheduler._loop.call_soon_threadsafe(die)


def take_after_the_loop_died(scheduler: RolloutScheduler) -> tuple[BaseException, float]:
    """What ``take`` raised once the loop died, and the seconds the stop after it took."""
    try:
        with pytest.raises(RolloutSchedulerError, match="event loop thread died: SystemExit") as raised:
            take(scheduler, 1)
    finally:
        started = time.monotonic()
        scheduler.stop()
    return raised.value, time.monotonic() - started


def test_an_event_loop_thread_that_dies_is_raised_and_its_sessions_are_closed() -> None:
    factory = HandmadeFactory(hang=lambda n: True)
    scheduler = make(factory)
    deadline = time.monotonic() + PROMPT_S
    while len(factory.live) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)

    kill_the_loop(scheduler)
    raised, stop_s = take_after_the_loop_died(scheduler)
    assert stop_s < PROMPT_S
    assert isinstance(raised.__cause__, SystemExit)
    assert not factory.live and factory.closed == len(factory.created)


def test_a_session_made_just_before_the_event_loop_died_is_closed_by_the_stop() -> None:
    # The loop dies with the made session's hand-over queued behind its death: the caller never resumes to
    # register it, so only the thread that made it can, for the stop to close it.
    holder: list[RolloutScheduler] = []
    made = threading.Event()  # the first create may run before make() returns the scheduler

    def queue_death(n: int) -> bool:
        if n == 0 and made.wait(PROMPT_S):
            kill_the_loop(holder[0], after_s=0.3)  # the maker's thread is past its stop check by then
        return False

    factory = HandmadeFactory(hang=lambda n: True, fail_start=queue_death)
    holder.append(scheduler := make(factory))
    made.set()
    take_after_the_loop_died(scheduler)
    assert factory.created and not factory.live and factory.closed == len(factory.created)


# -- through the trainer -----------------------------------------------------------------------------------


def train_bounded(trainer: Any) -> BaseException | None:
    """``trainer.train()`` in a thread, which must end within a minute; what it raised."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            trainer.train()
        except BaseException as exc:  # handed to the test
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "train() did not end: the scheduler's failure never reached it"
    return raised[0] if raised else None


def trainer_for(factory: HandmadeFactory, tmp_path: Path, tiny_model_dir: Path, **overrides: Any) -> Any:
    from harness_trainer import AsyncGRPOConfig, HarnessAsyncGRPOTrainer

    def build(sampling: Any = None) -> HandmadeFactory:
        return factory

    settings = dict(
        output_dir=str(tmp_path / "out"), engine="none", num_generations=4, max_concurrent_rollouts=4,
        max_steps=3, learning_rate=1e-3, disable_tqdm=True, seed=0, token_budget=64,
    )  # fmt: skip
    settings.update(overrides)
    return HarnessAsyncGRPOTrainer(str(tiny_model_dir), build, AsyncGRPOConfig(**settings))


def test_train_raises_promptly_when_admission_dies_and_closes_everything(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = scheduling.row_order

    def broken(num_rows: int, group: int, **kwargs: Any) -> int:
        if group >= 2:  # once step 1 has taken group 0
            raise ZeroDivisionError("a bug in admission")
        return real(num_rows, group, **kwargs)

    monkeypatch.setattr(scheduling, "row_order", broken)
    factory = HandmadeFactory(hang=lambda n: n >= 4)  # group 1 runs until closed
    trainer = trainer_for(factory, tmp_path, tiny_model_dir)
    error = train_bounded(trainer)
    assert isinstance(error, RolloutSchedulerError) and "admission task died" in str(error)
    assert isinstance(error.__cause__, ZeroDivisionError)
    assert trainer.state.step == 1 and len(factory.created) == 8
    assert not factory.live and factory.closed == 8 and factory.factory_closed


def test_train_stops_at_the_first_unexpected_error_when_none_are_allowed(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    factory = HandmadeFactory(fail_wait=lambda n: TypeError("a bug") if n == 5 else None)
    error = train_bounded(trainer_for(factory, tmp_path, tiny_model_dir, max_unexpected_errors=0))
    assert isinstance(error, RolloutSchedulerError) and isinstance(error.__cause__, TypeError)
    assert "max_unexpected_errors=0" in str(error) and "TypeError: a bug" in str(error)
    assert not factory.live and factory.factory_closed
