"""An in-process session factory: the same sessions as ``HarborSessionFactory``, without a server.

For the local dev loop and tests: a background thread runs a :class:`RolloutRuntime` (capture proxy,
sandboxes) in its own event loop; ``create`` submits a rollout to it and returns a session with the same
sync API, the same keywords' meanings and the same exceptions (one mapping,
:func:`~harness_trainer.rollouts.errors.error_for`) as a server-backed one: ``split`` names a dataset of
``tasks`` (:mod:`harness_trainer.tasks.catalog`), ``harness`` one harness or several dealt per GRPO
group (:mod:`harness_trainer.rollouts.harness_mix`; ``create(..., harness=NAME)`` runs that one of them
instead), ``harness_options`` the harness class's keyword options (checked here; keyed by harness name
for several), ``agent_timeout_sec`` None or 0 means each task's own, ``reward_key`` is a key or a
comma-separated preference list checked on the first verifier result, and a session's wait without a
timeout covers its agent, verifier and ``setup_timeout_sec``; ``group_setup=False`` sets up every GRPO group
member on its own (by default, on a backend that forks, each group once: :mod:`~harness_trainer.rollouts.
server.group_setup`).
``close()`` cancels what still runs and shuts the runtime down; the factory is also a context manager. With
``capture_url`` (and its ``admin_key``) the rollouts go through an already-running capture proxy
(``python -m capture_proxy``), which the factory neither starts nor stops.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from capture_proxy.sampling import SamplingPolicy
from harness_trainer.harnesses import make_harness
from harness_trainer.rollouts.client.servers import group_index
from harness_trainer.rollouts.client.session import (
    RewardKeyCheck,
    VerifyResult,
    exit_code_of,
    sampling_policy,
    task_reference,
    trace_of,
    verify_result,
)
from harness_trainer.rollouts.errors import RolloutConfigError
from harness_trainer.rollouts.harness_mix import HarnessMix, HarnessValue, harness_mix
from harness_trainer.rollouts.result import RolloutOptions, RolloutResult
from harness_trainer.rollouts.run_options import DEFAULT_RUN
from harness_trainer.rollouts.server.runtime import RolloutRuntime, RuntimeConfig
from harness_trainer.tasks.catalog import TaskCatalog, as_catalog
from harness_trainer.tasks.sources import TaskSource
from harness_trainer.trace import TrainingTrace


class LocalSessionFactory:
    """In-process rollouts (module docstring): a :class:`~harness_trainer.rollouts.client.contract.
    SessionFactory` and an :class:`~harness_trainer.rollouts.client.contract.AsyncSessionFactory` of
    :class:`LocalSession` s. ``sampling``: a :class:`~capture_proxy.sampling.SamplingPolicy`, or its JSON
    (validated here, once)."""

    def __init__(
        self,
        tasks: TaskSource | TaskCatalog | str,
        *,
        upstream: str,
        split: str = DEFAULT_RUN.split,
        harness: HarnessValue | HarnessMix = DEFAULT_RUN.harness,
        harness_options: dict[str, Any] | None = None,
        sandbox: str = "local",
        model: str | None = None,
        sampling: SamplingPolicy | Mapping[str, Any] | None = None,
        agent_timeout_sec: float | None = None,
        agent_step_limit: int = 0,
        reward_key: str = "",
        data_dir: str | Path | None = None,
        capture_port: int | None = None,
        capture_url: str | None = None,
        admin_key: str | None = None,
        sandbox_options: dict[str, dict[str, Any]] | None = None,
        setup_timeout_sec: float = 900.0,
        group_setup: bool = True,
    ) -> None:
        from harness_trainer.net import free_port

        if agent_timeout_sec is not None and agent_timeout_sec < 0:
            raise RolloutConfigError(
                f"agent_timeout_sec={agent_timeout_sec!r}: give seconds, or 0 for each task's own timeout"
            )
        self.tasks = as_catalog(tasks)
        try:
            self.tasks.resolve(split)
        except KeyError as exc:
            raise RolloutConfigError(str(exc.args[0])) from None
        self.split = split
        self.reward_key, self.setup_timeout_sec = reward_key, setup_timeout_sec
        self.check_reward_key = RewardKeyCheck(reward_key)
        """Called by each session's ``verify`` (checks once)."""
        try:
            self.harness_mix = harness_mix(harness)
            problems = self.harness_mix.options_problems(harness_options or {})
            if problems:
                raise ValueError("; ".join(problems))
            for name in self.harness_mix.names:
                make_harness(name, **self.harness_mix.options_for(harness_options or {}, name))
        except ValueError as exc:
            raise RolloutConfigError(str(exc)) from None
        self.harness_options = dict(harness_options or {})
        agent_timeout_sec = agent_timeout_sec or None
        policy = sampling_policy(sampling)
        self.options = RolloutOptions(
            harness=self.harness_mix.first, sandbox=sandbox,
            sampling=None if policy is None else policy.wire_json(), agent_timeout_sec=agent_timeout_sec,
            agent_step_limit=agent_step_limit, reward_key=reward_key,
        )  # fmt: skip
        self._tmp = None if data_dir is not None else tempfile.TemporaryDirectory(prefix="capture-")
        config = RuntimeConfig(
            upstream=upstream,
            data_dir=Path(data_dir) if data_dir is not None else Path(self._tmp.name),  # type: ignore[union-attr]
            capture_port=capture_port or free_port(),
            capture_url=capture_url,
            admin_key=admin_key,
            served_model=model,
            sandbox_options=sandbox_options or {},
            group_setup=group_setup,
        )
        self.runtime = RolloutRuntime(config)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollouts", daemon=True)
        self._thread.start()
        self._sessions: set[LocalSession] = set()
        self._closed = False
        try:
            self._call(self.runtime.start())
        except BaseException:
            self.close()
            raise

    def _call(self, coroutine: Any, timeout: float | None = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def open_capture_sessions(self) -> int:
        """Capture sessions still open (0 once every rollout has cleaned up)."""
        return self._call(self.runtime.open_capture_sessions())

    def prompt_rows(self) -> list[dict[str, Any]]:
        return self.tasks.prompt_rows(self.split)

    def set_policy(self, model: str, version: int) -> None:
        """Send every model call from now on to served model ``model``, recording ``version`` on its turn."""
        self._call(self.runtime.set_policy(model, version))

    def set_policy_version(self, version: int) -> None:
        """Record ``version`` on every model call from now on, their model unchanged (weights pushed in
        place)."""
        self._call(self.runtime.set_policy(None, version))

    def _task(self, task: Any) -> Any:
        ref = task_reference(task)
        return self.tasks.task(self.split, ref) if isinstance(ref, int) else self.tasks.find(self.split, ref)

    def create(
        self, task: Any, seed: int | None = None, episode_id: str | None = None, *, harness: str | None = None
    ) -> LocalSession:
        """A rollout of ``task``; ``harness`` (one of the mix) runs instead of the group's.

        Raises:
            RolloutConfigError: ``harness`` is not one of the factory's.
            RuntimeError: the factory is closed.
        """
        if self._closed:
            raise RuntimeError("the factory is closed")
        try:
            harness = self.harness_mix.chosen(harness, group_index(episode_id))
        except ValueError as exc:
            raise RolloutConfigError(str(exc)) from None
        harbor_task = self._task(task)
        options = self.options.model_copy(update={
            "seed": seed, "episode_id": episode_id, "harness": harness,
            "harness_options": self.harness_mix.options_for(self.harness_options, harness),
        })  # fmt: skip
        stop = asyncio.Event()
        future = asyncio.run_coroutine_threadsafe(
            self.runtime.rollout(harbor_task, options, stop), self._loop
        )
        agent = self.options.agent_timeout_sec or harbor_task.agent_timeout_sec
        bound = agent + harbor_task.verifier_timeout_sec + self.setup_timeout_sec
        session = LocalSession(self, future, stop, wait_timeout_s=bound)
        self._sessions.add(session)
        return session

    def harness_for_group(self, group: int) -> str | None:
        """The harness GRPO group ``group`` runs on when this factory mixes harnesses, else None."""
        return self.harness_mix.for_group(group) if self.harness_mix.mixed else None

    async def acreate(
        self, task: Any, seed: int | None = None, episode_id: str | None = None, *, harness: str | None = None
    ) -> LocalSession:
        """``create`` for a caller on another event loop (the trainer's scheduler): nothing blocks."""
        # A subclass's create of the older signature (no harness=) still serves a run of one harness.
        chosen = {} if harness is None else {"harness": harness}
        return self.create(task, seed=seed, episode_id=episode_id, **chosen)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for session in list(self._sessions):
            session.close()
        try:
            self._call(self.runtime.aclose(), timeout=180)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
            self._loop.close()
            if self._tmp is not None:
                self._tmp.cleanup()

    def __enter__(self) -> LocalSessionFactory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalSession:
    """One in-process rollout: a :class:`~harness_trainer.rollouts.client.contract.Session` and an
    :class:`~harness_trainer.rollouts.client.contract.AsyncSession`."""

    def __init__(
        self,
        factory: LocalSessionFactory,
        future: concurrent.futures.Future[RolloutResult],
        stop: asyncio.Event,
        wait_timeout_s: float,
    ) -> None:
        self.factory = factory
        self.wait_timeout_s = wait_timeout_s
        """The whole rollout's bound (agent, verifier, setup): the wait when no timeout is given."""
        self.future = future
        self.stop = stop
        self.timed_out = False

    @property
    def result(self) -> RolloutResult:
        return self.future.result()

    @property
    def session_id(self) -> str | None:
        """The rollout's capture session id once it has finished (errors then name it), else None."""
        if not self.future.done() or self.future.cancelled() or self.future.exception() is not None:
            return None
        return self.result.capture_session_id

    def wait_for_completion(self, timeout_s: float | None = None) -> int:
        try:
            self.future.result(self.wait_timeout_s if timeout_s is None else timeout_s)
        except concurrent.futures.TimeoutError:
            self.factory._loop.call_soon_threadsafe(self.stop.set)
            self.future.result()
            self.timed_out = True
            raise TimeoutError("agent timed out; its captured turns stay trainable") from None
        self.timed_out = self.result.timed_out
        return exit_code_of(self.result)

    def fetch_training_trace(self) -> TrainingTrace:
        return trace_of(self.result, self.session_id)

    def verify(self, completion: list[dict[str, Any]] | None = None, final_state: Any = None) -> VerifyResult:
        self.factory.check_reward_key(self.result)
        return verify_result(self.result)

    async def wait(self, timeout_s: float | None = None) -> int:
        """``wait_for_completion`` without blocking the caller's event loop."""
        running = asyncio.wrap_future(self.future)
        done, _ = await asyncio.wait(
            {running}, timeout=self.wait_timeout_s if timeout_s is None else timeout_s
        )
        if not done:
            self.factory._loop.call_soon_threadsafe(self.stop.set)
            await running
            self.timed_out = True
            raise TimeoutError("agent timed out; its captured turns stay trainable")
        self.timed_out = self.result.timed_out
        return exit_code_of(self.result)

    async def afetch_training_trace(self) -> TrainingTrace:
        return trace_of(await asyncio.wrap_future(self.future), self.session_id)

    async def averify(self, completion: list[dict[str, Any]] | None = None) -> VerifyResult:
        result = await asyncio.wrap_future(self.future)
        self.factory.check_reward_key(result)
        return verify_result(result)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        if not self.future.done():
            self.future.cancel()
            try:
                self.future.result(120)
            except (concurrent.futures.CancelledError, concurrent.futures.TimeoutError, Exception):
                pass  # cancelled on purpose; the rollout cleaned up after itself
        self.factory._sessions.discard(self)
