"""The rollouts' unexpected errors (bugs, :mod:`.failures`): counted, logged, and when to stop for them.

Each is logged with its traceback the first time it comes from its place (its type and innermost frame),
in one line after that. Past ``max_unexpected_errors`` of them the run stops; and a white-box harness
adapter's bug (:class:`.failures.AdapterError`) followed, by the next rollout to end, by another kind of
adapter bug (another type or place) stops it at once: two different bugs in a row are an adapter to fix,
not bad luck.
"""

from __future__ import annotations

import logging
import traceback

from harness_trainer.trainer.feed.failures import AdapterError, origin_of

logger = logging.getLogger(__name__)


class UnexpectedErrors:
    """The count of one scheduler's unexpected rollout errors (module docstring); used on its loop only."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        """Unexpected errors tolerated; one more stops the run."""
        self.count = 0
        self._logged_origins: set[tuple[str, str, int]] = set()
        self._last_adapter_bug: tuple[str, str, int] | None = None
        """Where the last rollout to end failed in the adapter (None: it did not)."""

    def rollout_succeeded(self) -> None:
        """The last rollout to end did not fail: an adapter bug before it is no longer one in a row."""
        self._last_adapter_bug = None

    def add(self, where: str, exc: BaseException) -> str | None:
        """Count ``exc``, raised by the rollout ``where`` names, and log it; why the run must stop now, or
        None."""
        self.count += 1
        origin = origin_of(exc)
        previous, self._last_adapter_bug = self._last_adapter_bug, None
        if isinstance(exc, AdapterError):
            self._last_adapter_bug = origin
            if previous is not None and previous != origin:
                reason = (
                    f"harness adapter {exc.adapter} failed with a second kind of bug in a row: "
                    f"{_place(previous)}, then {_place(origin)} ({where}: {exc}); fix the adapter"
                )
                logger.error("%s:\n%s", reason, "".join(traceback.format_exception(exc)))
                return reason
        if origin not in self._logged_origins:
            self._logged_origins.add(origin)
            logger.error(
                "%s failed unexpectedly (%d of %d tolerated, max_unexpected_errors); it is unscorable:\n%s",
                where, self.count, self.limit, "".join(traceback.format_exception(exc)),
            )  # fmt: skip
        else:
            logger.error(
                "%s failed unexpectedly again (%d of %d tolerated): %r", where, self.count, self.limit, exc
            )
        if self.count > self.limit:
            return (
                f"{self.count} rollouts failed with unexpected errors, more than max_unexpected_errors="
                f"{self.limit}; the last, {where}: {type(exc).__name__}: {exc}"
            )
        return None


def _place(origin: tuple[str, str, int]) -> str:
    """An exception's origin as ``Type at file:line``."""
    kind, filename, line = origin
    return f"{kind} at {filename}:{line}" if filename else kind
