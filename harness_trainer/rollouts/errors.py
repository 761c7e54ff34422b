"""Why a rollout failed, as a typed kind on the wire, and the one mapping from kind to exception.

A failed rollout's :class:`~harness_trainer.rollouts.result.RolloutResult` carries ``error`` (the text)
and ``error_kind`` (one of :data:`ERROR_KINDS`). Both session factories, the server-backed
``HarborSessionFactory`` and the in-process ``LocalSessionFactory``, turn a failed result into an
exception only through :func:`error_for`, so the same fault behaves the same through either:

- ``capture_contract``: a malformed capture, a bug in the capture path →
  :class:`~harness_trainer.trace.CaptureContractError`, which stops training;
- ``sandbox``, ``harness``, ``capture``, ``engine``, ``cancelled`` → :class:`RolloutUnscorable` with that
  ``kind``: the rollout is left out of its group, the run goes on;
- ``unexpected`` (an exception in the rollout code itself, logged with its traceback where it ran) →
  :class:`RolloutServerBug`, a :class:`RolloutUnscorable` the trainer counts as a bug
  (``max_unexpected_errors``).

:class:`RolloutConfigError` is the other side's mistake, known before or at the first rollout (an unknown
split, an engine the server was not allowed, a reward key no verifier writes): it stops the run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from harness_trainer.trace import CaptureContractError

if TYPE_CHECKING:
    from harness_trainer.rollouts.result import RolloutResult

ErrorKind = Literal["sandbox", "harness", "capture", "engine", "capture_contract", "cancelled", "unexpected"]
ERROR_KINDS: tuple[str, ...] = ErrorKind.__args__  # type: ignore[attr-defined]


class RolloutUnscorable(RuntimeError):
    """The rollout could not be scored (sandbox or install failure, server gone): train nothing from it.

    ``kind`` says why (:data:`ERROR_KINDS`); ``capture_session_id`` names the rollout's capture session
    when it had one (None otherwise).
    """

    def __init__(
        self, message: str, *, kind: str = "unexpected", capture_session_id: str | None = None
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.capture_session_id = capture_session_id


class RolloutServerBug(RolloutUnscorable):
    """The rollout code itself raised where the rollout ran (the rollout server, or the in-process runtime
    of ``LocalSessionFactory``): ``error_kind="unexpected"``, logged with its traceback there. Unscorable
    like the others, but a bug: the trainer counts it against ``max_unexpected_errors``."""


class RolloutConfigError(ValueError):
    """A session factory's setting that cannot work (the message names the value and the allowed ones)."""


def error_for(result: RolloutResult) -> Exception:
    """The exception a failed ``result`` raises in the trainer (rules in the module docstring)."""
    message = f"rollout of {result.task_name} is unscorable: {result.error}"
    if result.error_kind == "capture_contract":
        return CaptureContractError(
            f"rollout of {result.task_name}: malformed capture: {result.error}",
            rules=list(result.error_rules) or ["capture_contract"],
            session_id=result.capture_session_id,
        )
    kind = RolloutServerBug if result.error_kind == "unexpected" else RolloutUnscorable
    return kind(message, kind=result.error_kind or "unexpected", capture_session_id=result.capture_session_id)
