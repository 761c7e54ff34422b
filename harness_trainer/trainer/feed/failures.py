"""How the rollout scheduler judges a rollout that failed: pure functions of the exception.

- :data:`INFRASTRUCTURE_ERRORS` (the session's own :class:`RolloutUnscorable`, the rollout server refusing or
  gone, a sandbox, harness or capture error, a connection dropped or timed out, a cancellation): the rollout
  is unscorable, the run goes on;
- a :class:`CaptureContractError`, a :class:`RolloutConfigError` (a factory setting that cannot work, e.g.
  a reward key no verifier writes), or a ``rollout_reward_fn`` that returned a bool, a non-number, NaN or
  infinity: fatal, the run stops naming it;
- a :class:`RolloutServerBug` (the rollout code raised where the rollout ran: the rollout server, or the
  in-process runtime): unscorable, and a bug, counted as the next;
- anything else, a raising ``rollout_reward_fn`` included: unexpected (a bug), counted against
  ``max_unexpected_errors``; a white-box harness adapter's own bug comes as an :class:`AdapterError`
  (the scheduler stops at once when a second kind of adapter bug follows the first);
- whatever is raised once the run began stopping (sessions closed under it): unscorable, never counted.
"""

from __future__ import annotations

import enum
import traceback
from dataclasses import dataclass

from harness_trainer.rollouts.errors import RolloutConfigError, RolloutServerBug
from harness_trainer.rollouts.infrastructure import INFRASTRUCTURE_ERRORS
from harness_trainer.trace import CaptureContractError
from harness_trainer.trainer.step.outcome import RewardFunctionError

__all__ = [
    "INFRASTRUCTURE_ERRORS",
    "AdapterError",
    "FailureKind",
    "Verdict",
    "is_infrastructure",
    "judge",
    "origin_of",
]


class AdapterError(Exception):
    """What a white-box harness adapter raised that is none of the infrastructure's errors: a bug in the
    adapter (``adapter``: its class name), the original exception chained as ``__cause__``."""

    def __init__(self, adapter: str, exc: BaseException) -> None:
        super().__init__(f"harness adapter {adapter} raised {type(exc).__name__}: {exc}")
        self.adapter = adapter


class FailureKind(enum.Enum):
    INFRASTRUCTURE = "infrastructure"
    FATAL = "fatal"
    UNEXPECTED = "unexpected"


@dataclass(frozen=True)
class Verdict:
    kind: FailureKind
    reason: str
    """The rollout's ``unscorable`` text."""


def judge(exc: BaseException, *, stopping: bool) -> Verdict:
    """What a rollout that failed with ``exc`` is (see the module docstring)."""
    returned_badly = isinstance(exc, RewardFunctionError) and exc.__cause__ is None
    if isinstance(exc, (CaptureContractError, RolloutConfigError)) or returned_badly:
        return Verdict(FailureKind.FATAL, f"fatal: {exc}")
    if isinstance(exc, RewardFunctionError):
        return Verdict(FailureKind.UNEXPECTED, f"reward function failed: {exc}")
    if isinstance(exc, RolloutServerBug) and not stopping:
        return Verdict(FailureKind.UNEXPECTED, f"unexpected error where the rollout ran: {exc}")
    if isinstance(exc, INFRASTRUCTURE_ERRORS) or stopping:
        return Verdict(FailureKind.INFRASTRUCTURE, f"{type(exc).__name__}: {exc}")
    if isinstance(exc, AdapterError):
        return Verdict(FailureKind.UNEXPECTED, f"unexpected: {exc}")
    return Verdict(FailureKind.UNEXPECTED, f"unexpected {type(exc).__name__}: {exc}")


def is_infrastructure(exc: BaseException) -> bool:
    """Whether ``exc`` is not the white-box adapter's own bug: infrastructure, fatal, or a bug where the
    rollout ran (:class:`RolloutServerBug`, counted as itself). What an adapter passes on from its session or
    the engine stays that, never an adapter bug."""
    return isinstance(exc, RolloutServerBug) or judge(exc, stopping=False).kind is not FailureKind.UNEXPECTED


def origin_of(exc: BaseException) -> tuple[str, str, int]:
    """Where an exception comes from (its type and innermost frame; the chained original for a
    RewardFunctionError or an AdapterError), so that each bug's traceback is logged once."""
    wrapped = isinstance(exc, (RewardFunctionError, AdapterError)) and exc.__cause__ is not None
    inner = exc.__cause__ if wrapped else exc
    frames = traceback.extract_tb(inner.__traceback__)
    if not frames:
        return type(inner).__name__, "", 0
    return type(inner).__name__, frames[-1].filename, frames[-1].lineno or 0
