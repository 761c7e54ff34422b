"""The rollout contract between the trainer and a session factory: OpenEnv's loop-owning shape, as Protocols.

OpenEnv (``openenv.core.harness``) names the pieces: a ``ResourceSessionFactory`` makes one isolated
session per rollout with ``create(task, seed, episode_id)``; a ``TrainableSession`` (a
``LoopOwningSession`` whose capture is validated) is waited on (``wait_for_completion``: the agent owns its
loop) and asked for its ``TrainingTrace``; ``verify`` gives the ``VerifyResult`` and ``close`` releases it.
OpenEnv spreads these over an ABC and two Protocols; here they are one :class:`Session` and one
:class:`SessionFactory`, structural (``typing.Protocol``): a factory conforms by shape, without
subclassing anything, as OpenEnv's own factories and test doubles do.

:class:`AsyncSession` / :class:`AsyncSessionFactory` are the same contract for a caller on an event loop
(the trainer's scheduler): the in-process factories' coroutine twins (``acreate``, ``wait``,
``afetch_training_trace``, ``averify``, ``aclose``). A sync session also keeps a sync ``close`` callable
from any thread: the scheduler closes every live session at once when it stops, event loop or not.

:class:`SessionFactory` is generic over what it makes: the trainer's factories make :class:`Session` s;
the white-box factories make OpenEnv ``ResourceSession`` s (tools, not a loop), which
:class:`~harness_trainer.trainer.feed.whitebox.WhiteBoxRolloutFactory` turns into :class:`Session` s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel

from harness_trainer.trace import TrainingTrace

__all__ = [
    "AsyncSession",
    "AsyncSessionFactory",
    "CapturedTrace",
    "MixesHarnesses",
    "RolloutFactory",
    "Session",
    "SessionFactory",
    "Verification",
]

CapturedTrace = TrainingTrace | BaseModel | Mapping[str, Any] | str
"""What ``fetch_training_trace`` may return: our :class:`~harness_trainer.trace.TrainingTrace`, OpenEnv's
``TrainingTrace`` (a pydantic model of the same JSON), or that JSON (a dict, or text); the trainer
validates the last two itself."""

SessionT_co = TypeVar("SessionT_co", covariant=True)
AsyncSessionT_co = TypeVar("AsyncSessionT_co", bound="AsyncSession", covariant=True)


class Verification(Protocol):
    """What ``verify`` returns: ours (:class:`~harness_trainer.rollouts.client.session.VerifyResult`) or
    OpenEnv's ``VerifyResult``. ``env_reward`` None means ungraded, never 0."""

    env_reward: float | None
    done: bool
    metrics: dict[str, Any]
    artifacts: dict[str, Any]


@runtime_checkable
class Session(Protocol):
    """One loop-owning rollout, driven from a worker thread (OpenEnv's ``TrainableSession`` with
    ``ResourceSession``'s ``verify`` and ``close``); see :mod:`harness_trainer.rollouts.client.session` for
    what each call raises."""

    @property
    def session_id(self) -> str | None:
        """The id its errors and logs name (its capture session's, or its server's); None until known."""
        ...

    def wait_for_completion(self, timeout_s: float | None = None) -> int:
        """The agent's exit code once the rollout is done; ``TimeoutError`` past ``timeout_s`` (None: the
        session's own bound), the captured turns kept."""
        ...

    def fetch_training_trace(self) -> CapturedTrace:
        """The rollout's captured turns."""
        ...

    def verify(
        self, completion: list[dict[str, Any]] | None = None, /, final_state: Any = None
    ) -> Verification:
        """The task verifier's verdict on the finished rollout; ``completion`` (positional: implementations
        name it as they like) is the last request's messages and its reply."""
        ...

    def close(self) -> None:
        """Release the rollout (stop what still runs); idempotent, callable from any thread."""
        ...


@runtime_checkable
class AsyncSession(Protocol):
    """:class:`Session` for a caller on an event loop: the same calls as coroutines, and the sync ``close``
    (any thread, idempotent) for closing it from outside the loop."""

    @property
    def session_id(self) -> str | None:
        """As :attr:`Session.session_id`."""
        ...

    async def wait(self, timeout_s: float | None = None) -> int:
        """:meth:`Session.wait_for_completion` without blocking the loop."""
        ...

    async def afetch_training_trace(self) -> CapturedTrace:
        """:meth:`Session.fetch_training_trace` without blocking the loop."""
        ...

    async def averify(self, completion: list[dict[str, Any]] | None = None, /) -> Verification:
        """:meth:`Session.verify` without blocking the loop."""
        ...

    async def aclose(self) -> None:
        """:meth:`close` without blocking the loop."""
        ...

    def close(self) -> None:
        """As :meth:`Session.close`."""
        ...


@runtime_checkable
class SessionFactory(Protocol[SessionT_co]):
    """Makes one isolated session per rollout (OpenEnv's ``ResourceSessionFactory.create``)."""

    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> SessionT_co:
        """A session on ``task`` (a prompt row, its messages, an instruction or a task index), seeded with
        ``seed``; ``episode_id`` names the rollout in its capture's metadata."""
        ...


@runtime_checkable
class AsyncSessionFactory(Protocol[AsyncSessionT_co]):
    """:class:`SessionFactory` for a caller on an event loop."""

    async def acreate(
        self, task: Any, seed: int | None = None, episode_id: str | None = None
    ) -> AsyncSessionT_co:
        """:meth:`SessionFactory.create` without blocking the loop."""
        ...


@runtime_checkable
class MixesHarnesses(Protocol):
    """Optional, on a factory that deals several harnesses over GRPO groups
    (:mod:`harness_trainer.rollouts.harness_mix`): which harness a group's rollouts use, so the trainer
    can count and plot each harness apart. A factory of one harness need not have it."""

    def harness_for_group(self, group: int) -> str | None:
        """The harness group ``group``'s members run (its episode ids are ``group{group}-member{m}``);
        None when the factory runs one harness."""
        ...


RolloutFactory = SessionFactory[Session] | AsyncSessionFactory[AsyncSession]
"""What the trainer's scheduler takes: a factory of loop-owning sessions, sync or async."""
