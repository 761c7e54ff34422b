"""In-process white-box sessions: OpenEnv ``ResourceSession`` s over local sandboxes, without a server.

:class:`LocalWhiteBoxSessionFactory` is to :class:`~harness_trainer.rollouts.client.whitebox_session.
WhiteBoxSessionFactory` what :class:`~harness_trainer.rollouts.client.local_factory.LocalSessionFactory` is
to ``HarborSessionFactory``: the same sessions, run in this process. A background thread runs an event loop
that owns the sandbox backend and each session's
:class:`~harness_trainer.rollouts.server.environment.Environment` (the rollout server's own white-box
environment: the task's sandbox as tools, its verifier); the sessions' sync methods submit work to that loop
and wait for it, so an adapter may drive them from any other thread::

    with LocalWhiteBoxSessionFactory("tasks/", split="train") as factory:
        session = factory.create(factory.prompt_rows()[0])  # a row, its messages, an instruction or an index
        session.initial_messages()                          # [{"role": "user", "content": instruction}]
        session.call_tool("bash", {"command": "ls"})        # OpenEnv ToolResult
        session.verify(transcript).env_reward               # the task's verifier; None = ungraded
        session.close()

Keywords mean what they mean for ``WhiteBoxSessionFactory``: ``split`` names a dataset of ``tasks``
(:mod:`harness_trainer.tasks.catalog`), ``sandbox`` a registered backend (``local`` by default; its
constructor options in ``sandbox_options[name]``), ``episode_timeout_sec`` the episode's length (the sandbox
closes itself after it plus the verifier's timeout; default: the task's own), ``reward_key`` which score of
``reward.json`` is the reward, ``tool_limits`` the tools'
:class:`~harness_trainer.sandboxes.tools.ToolLimits`.

Session semantics, as the HTTP session's: a tool result with ``error`` set is the model's mistake, never an
exception; a sandbox that failed to start, died, or did not answer within its bound raises
:class:`~harness_trainer.rollouts.errors.RolloutUnscorable` (``kind="sandbox"``); ``verify`` runs the task's
verifier, closes the sandbox and is idempotent (its ``VerifyResult`` carries the same metrics and artifacts
as ``WhiteBoxSession.verify``); a tool call after it raises
:class:`~harness_trainer.rollouts.server.environment.EpisodeOver`, one after ``close`` a RuntimeError;
``close`` is idempotent and never raises. ``factory.close()`` closes every open session's sandbox, the
backend, and stops the loop; the factory is also a context manager.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

from pydantic import ValidationError

from harness_trainer.rollouts.client.session import task_reference
from harness_trainer.rollouts.errors import RolloutConfigError, RolloutUnscorable
from harness_trainer.rollouts.result import EnvironmentOptions, EnvironmentVerdict
from harness_trainer.rollouts.server.environment import Environment, EnvironmentGone
from harness_trainer.sandboxes import SandboxSupervisor, backend_class, make_backend, missing_credentials
from harness_trainer.sandboxes.base import SandboxError
from harness_trainer.tasks.catalog import TaskCatalog, as_catalog
from harness_trainer.tasks.sources import TaskSource
from harness_trainer.tasks.task import HarborTask

try:
    from openenv.core.env_server.mcp_types import Tool
    from openenv.core.harness import ResourceSession, ResourceSessionFactory, ToolResult, VerifyResult
except ImportError as exc:  # an optional extra: only white-box sessions need it
    raise ImportError(
        "white-box sessions need the `openenv` extra: pip install 'harness-trainer[openenv]'"
    ) from exc

from harness_trainer.rollouts.client.whitebox_session import verify_result
from harness_trainer.rollouts.run_options import DEFAULT_RUN
from harness_trainer.sandboxes.tools import ToolLimits

log = logging.getLogger(__name__)
T = TypeVar("T")
ANSWER_SLACK_S = 60.0
"""How long past its own timeout a tool call or the verifier may take before the sandbox counts as gone
(the HTTP session's request timeout has the same slack)."""
CLOSE_TIMEOUT_S = 120.0


class LocalWhiteBoxSession(ResourceSession):
    """One white-box episode in a local sandbox (module docstring); made by the factory's ``create``."""

    session_id: str
    """Names the session in logs and in ``verify``'s metrics, as a server's session id does."""

    def __init__(self, factory: LocalWhiteBoxSessionFactory, environment: Environment) -> None:
        self.factory = factory
        self.environment = environment
        self.session_id = f"local-{uuid.uuid4().hex}"
        task = environment.task
        self.task: dict[str, Any] = {
            "name": task.name, "split": task.split, "index": task.index, "instruction": task.instruction,
        }  # fmt: skip
        """``name``, ``split``, ``index`` and ``instruction`` of the episode's task."""
        self.verdict: EnvironmentVerdict | None = None
        self._closed = False

    def initial_messages(self) -> list[dict[str, Any]]:
        """The task's instruction as the user's message (the tools go to the model separately)."""
        return [{"role": "user", "content": self.task["instruction"]}]

    def list_tools(self) -> list[Tool]:
        """The tool manifest (copies; no sandbox call)."""
        assert self.environment.tools is not None  # started before the session was made
        return self.environment.tools.list_tools()

    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        """Run tool ``name`` in the sandbox; the model's mistakes are error results (module docstring)."""
        bound = self.environment.limits.max_timeout_s + ANSWER_SLACK_S
        return self._run(self.environment.call_tool(name, arguments), bound, f"tool {name}")

    def verify(self, transcript: list[dict[str, Any]] | None = None, final_state: Any = None) -> VerifyResult:
        """Run the task's verifier in the sandbox (once; again: the same verdict) and close the sandbox.
        ``env_reward`` None means ungraded; ``metrics`` carry the tool counters as the trainer reads them."""
        if self.verdict is None:
            task = self.environment.task
            bound = max(task.verifier_timeout_sec, self.environment.limits.max_timeout_s) + ANSWER_SLACK_S
            self.verdict = self._run(self.environment.verify(), bound, "the verifier")
        return verify_result(self.verdict, self.session_id)

    def close(self) -> None:
        """Cancel the call in flight and close the sandbox; idempotent, never raises."""
        if self._closed:
            return
        self._closed = True
        self.factory._forget(self)
        loop = self.factory._loop
        if loop.is_closed():
            return  # the factory closed first: its backend closed every sandbox
        future = asyncio.run_coroutine_threadsafe(self.environment.close(), loop)
        try:
            future.result(CLOSE_TIMEOUT_S)
        except Exception:  # closing is best effort; the backend's close-all is the backstop
            log.warning("closing white-box session %s failed", self.session_id, exc_info=True)

    def __enter__(self) -> LocalWhiteBoxSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, work: Coroutine[Any, Any, T], timeout_s: float, what: str) -> T:
        """``work`` run on the factory's loop and waited for here, its failures mapped (module docstring)."""
        if self._closed:
            work.close()
            raise RuntimeError(f"white-box session {self.session_id} is closed")
        if threading.current_thread() is self.factory._thread:
            work.close()
            raise RuntimeError("a LocalWhiteBoxSession blocks: call it from another thread than its loop's")
        future = asyncio.run_coroutine_threadsafe(work, self.factory._loop)
        try:
            return future.result(timeout_s)
        except EnvironmentGone as exc:
            raise RolloutUnscorable(f"{what}: {exc}", kind="sandbox") from exc
        except TimeoutError:
            if future.done():
                raise  # the work's own TimeoutError, not our wait's
            future.cancel()  # the environment kills the command that hangs
            raise RolloutUnscorable(
                f"{what}: the sandbox did not answer within {timeout_s:g} s", kind="sandbox"
            ) from None
        except BaseException:
            future.cancel()  # interrupted while waiting (KeyboardInterrupt): stop the call
            raise


class LocalWhiteBoxSessionFactory(ResourceSessionFactory[LocalWhiteBoxSession]):
    """OpenEnv's session factory for white-box episodes of one split of ``tasks``, run in this process
    (module docstring): a :class:`~harness_trainer.rollouts.client.contract.SessionFactory` of OpenEnv
    ``ResourceSession`` s, which :mod:`harness_trainer.trainer.feed.whitebox` turns into rollouts.

    Raises (on construction) :class:`RolloutConfigError` for a split ``tasks`` does not have, an unknown
    sandbox backend, one whose credentials are missing from the environment, or an ``episode_timeout_sec``
    that is not positive; ValueError for ``tool_limits`` that ``ToolLimits`` refuses.
    """

    def __init__(
        self,
        tasks: TaskSource | TaskCatalog | str,
        *,
        split: str = DEFAULT_RUN.split,
        sandbox: str = "local",
        episode_timeout_sec: float | None = None,
        reward_key: str = "",
        tool_limits: ToolLimits | None = None,
        sandbox_options: dict[str, dict[str, Any]] | None = None,
        setup_timeout_sec: float = 900.0,
    ) -> None:
        self.tasks = as_catalog(tasks)
        try:
            self.tasks.resolve(split)
            backend_class(sandbox)
        except KeyError as exc:
            raise RolloutConfigError(str(exc.args[0])) from None
        except ValueError as exc:
            raise RolloutConfigError(str(exc)) from None
        if missing := missing_credentials(sandbox, os.environ):
            raise RolloutConfigError(f"sandbox {sandbox} needs {' and '.join(missing)} in the environment")
        try:
            self.options = EnvironmentOptions(
                sandbox=sandbox, episode_timeout_sec=episode_timeout_sec, reward_key=reward_key,
                tool_limits=dataclasses.asdict(tool_limits or ToolLimits()),
            )  # fmt: skip
        except ValidationError as exc:
            reason = exc.errors(include_url=False)
            raise RolloutConfigError(f"invalid environment options: {reason}") from None
        self.split, self.setup_timeout_sec = split, setup_timeout_sec
        # Behind a supervisor, as the rollout server's backends are: it tracks every live sandbox and
        # closes them all on close(), whatever a session did.
        self.backend = SandboxSupervisor(make_backend(sandbox, **(sandbox_options or {}).get(sandbox, {})))
        self._sessions: set[LocalWhiteBoxSession] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="local-whitebox", daemon=True)
        self._thread.start()

    def prompt_rows(self) -> list[dict[str, Any]]:
        """Dataset rows, one per task: ``prompt`` (a user message), ``task_index``, ``task_name``."""
        return self.tasks.prompt_rows(self.split)

    def create(
        self, task: Any, seed: int | None = None, episode_id: str | None = None
    ) -> LocalWhiteBoxSession:
        """A session on ``task`` (a task index, a prompt row, its messages, or the instruction), its sandbox
        started. Raises RolloutUnscorable when the sandbox does not start (within ``setup_timeout_sec``),
        KeyError / IndexError for a task the split does not have, RuntimeError once the factory is closed."""
        if self._closed:
            raise RuntimeError("the factory is closed")
        options = self.options.model_copy(update={"seed": seed, "episode_id": episode_id})
        future = asyncio.run_coroutine_threadsafe(_open(self._task(task), options, self.backend), self._loop)
        try:
            environment = future.result(self.setup_timeout_sec)
        except (SandboxError, EnvironmentGone) as exc:
            raise RolloutUnscorable(f"the sandbox did not start: {exc}", kind="sandbox") from exc
        except TimeoutError:
            if future.done():
                raise
            future.cancel()  # _open closes what it started
            raise RolloutUnscorable(
                f"the sandbox did not start within {self.setup_timeout_sec:g} s", kind="sandbox"
            ) from None
        except BaseException:
            future.cancel()
            raise
        session = LocalWhiteBoxSession(self, environment)
        with self._lock:
            closed = self._closed
            if not closed:
                self._sessions.add(session)
        if closed:  # the factory closed while the sandbox started
            session.close()
            raise RuntimeError("the factory is closed")
        return session

    def close(self) -> None:
        """Close every open session's sandbox and the backend, then stop the loop; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sessions = list(self._sessions)
        for session in sessions:
            session.close()
        try:
            asyncio.run_coroutine_threadsafe(self.backend.aclose(), self._loop).result(CLOSE_TIMEOUT_S)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
            self._loop.close()

    def __enter__(self) -> LocalWhiteBoxSessionFactory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _forget(self, session: LocalWhiteBoxSession) -> None:
        with self._lock:
            self._sessions.discard(session)

    def _task(self, task: Any) -> HarborTask:
        ref = task_reference(task)
        return self.tasks.task(self.split, ref) if isinstance(ref, int) else self.tasks.find(self.split, ref)


async def _open(task: HarborTask, options: EnvironmentOptions, backend: SandboxSupervisor) -> Environment:
    """A started environment; on any failure (cancellation included) what it started is closed."""
    environment = Environment(task, options, backend)
    try:
        await environment.start()
    except BaseException:
        await environment.close()
        raise
    return environment
