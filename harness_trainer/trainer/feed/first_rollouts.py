"""Fail in seconds: a run whose first rollouts all fail the same infrastructure way stops at once.

An environment that cannot work (an agent that cannot install in the task's image, an engine the sandboxes
cannot reach, a template that does not build) fails every rollout the same way. Left to the dropped-group
limit the run would burn 32 groups of sandboxes first; instead, when the run's first ``fail_fast_rollouts``
rollouts to end all failed with one kind of infrastructure error (the same exception type and, for a
:class:`~harness_trainer.rollouts.errors.RolloutUnscorable`, the same ``kind``: sandbox, harness, engine…),
the run stops with that error, naming the rollouts and their tasks. One success or one other kind among
them decides the run is not broken, and nothing is judged after them. A bug is not judged here (it counts
against ``max_unexpected_errors``).
"""

from __future__ import annotations


class FirstRollouts:
    """The first ``size`` rollouts of a scheduler to end (0: never judge); used on its loop only."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._failures: list[tuple[str, str]] = []
        self._decided = size <= 0

    def succeeded(self) -> None:
        """A rollout ended scored (or failed otherwise than the infrastructure's way): the run is not
        broken."""
        self._decided = True

    def failed(self, where: str, exc: BaseException) -> str | None:
        """Note an infrastructure failure of the rollout ``where`` names; why the run must stop now (the
        first ``size`` all failed this one way), or None."""
        if self._decided:
            return None
        self._failures.append((signature(exc), f"{where}: {type(exc).__name__}: {exc}"))
        if len(self._failures) < self.size:
            return None
        self._decided = True
        kinds = {kind for kind, _ in self._failures}
        if len(kinds) > 1:
            return None
        (kind,) = kinds
        first, last = self._failures[0][1], self._failures[-1][1]
        return (
            f"the run's first {self.size} rollouts all failed the same way ({kind}), so every later one "
            f"would too: stopping now instead of after many groups of them. The first: {first}. The last: "
            f"{last}. (fail_fast_rollouts=0 turns this check off.)"
        )


def signature(exc: BaseException) -> str:
    """One kind of infrastructure failure: the exception's type, and its ``kind`` where it has one."""
    kind = getattr(exc, "kind", None)
    return f"{type(exc).__name__}, kind {kind}" if isinstance(kind, str) else type(exc).__name__
