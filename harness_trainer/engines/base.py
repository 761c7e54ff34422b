"""The trainer-side engine contract: where to send requests, and how to pause, update and probe it.

Also the one retry rule every engine client shares (:func:`retry_unreachable`): a control call whose
connection could not be opened is retried with exponential backoff a bounded number of times, then
raises :class:`EngineUnavailable`. Only connection failures are retried: the request never reached the
engine, so repeating it is safe for every call, even a weight push. A failure after the request left
(a read timeout, a dropped connection, a non-200 answer) is raised at once, because the engine may have
acted on it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar, runtime_checkable

import httpx
import torch

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineUnavailable(RuntimeError):
    """The engine cannot be reached, or refused a control call."""


class PushRefused(EngineUnavailable):
    """A weight push was refused before anything loaded, or undone: the engine serves the weights it
    served before, whole. It may sample again (nothing half-updated is served), but it does not have the
    new version."""


class MalformedReply(EngineUnavailable):
    """The engine answered a control call, but not in the shape its API promises (a missing or mistyped
    field): the client cannot tell what the engine did, so it treats the engine as unusable for now."""


@runtime_checkable
class InferenceEngine(Protocol):
    """What the trainer needs from an engine (vLLM on GPUs, the dev engine on CPU)."""

    base_url: str

    async def pause(self) -> None:
        """Stop starting generations; return once those in flight have finished (or, where the engine
        was asked to keep them, are frozen until :meth:`resume`)."""

    async def resume(self) -> None:
        """Start generating again."""

    async def push_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> int:
        """Load (a subset of) the policy's weights as ``version``; return the version now served."""

    async def health(self) -> bool:
        """Whether the engine answers its health check."""

    async def served_version(self) -> int | None:
        """The weight version the engine itself says it serves now (not what the client last pushed): the
        version of the last push it loaded, or None for the weights it started with. An engine that
        restarted after a push answers None.

        Raises:
            EngineUnavailable: the engine cannot be reached or refused the call;
                :class:`MalformedReply` when its answer does not say a version.
        """


@dataclass(frozen=True)
class RetryPolicy:
    """How a control call that cannot connect to the engine is retried before giving up."""

    attempts: int = 4
    """Tries in all, the first included (1 = no retry)."""
    backoff_s: float = 0.25
    """Wait before the second try; doubles after each failed try."""
    max_backoff_s: float = 4.0
    """Cap on one wait."""

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be at least 1, got {self.attempts}")
        if self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("RetryPolicy backoffs must not be negative")

    def delay(self, failed_attempt: int) -> float:
        """Seconds to wait after try number ``failed_attempt`` (1-based) failed to connect."""
        return min(self.backoff_s * 2 ** (failed_attempt - 1), self.max_backoff_s)


async def retry_unreachable(call: Callable[[], Awaitable[T]], policy: RetryPolicy, what: str) -> T:
    """Await ``call()``, retrying per ``policy`` while the engine cannot be connected to.

    Raises:
        EngineUnavailable: every try failed to connect; ``what`` names the call in the message.
    """
    attempt = 1
    while True:
        try:
            return await call()
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            if attempt >= policy.attempts:
                raise EngineUnavailable(
                    f"{what}: engine unreachable after {attempt} attempt(s): {exc!r}"
                ) from exc
            delay = policy.delay(attempt)
            logger.warning("%s: engine unreachable (%r); retry %d in %.2fs", what, exc, attempt, delay)
            await asyncio.sleep(delay)
            attempt += 1


async def answers_health(base_url: str, timeout: float = 10.0) -> bool:
    """Whether ``GET {base_url}/health`` answers 200 (False when unreachable)."""
    try:
        async with httpx.AsyncClient(timeout=timeout) as client:
            return (await client.get(f"{base_url}/health")).status_code == 200
    except httpx.TransportError:
        return False
