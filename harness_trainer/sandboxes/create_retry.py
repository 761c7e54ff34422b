"""How often and how long a remote backend retries a failed sandbox create: one schedule for every backend.

A create that failed for a passing reason (a kind the backend lists as retried: transport, 429, 5xx, …) may
take every try allowed; one that failed for a reason nobody recognised (``unknown``) at most
:data:`UNKNOWN_TRIES`; any other (refused, forbidden) one. Between tries the wait doubles from a base, is
capped at :data:`MAX_DELAY_S` and scaled by a jitter in [0.5, 1), so creates refused together do not come
back together. Each backend's error module (:mod:`.e2b_errors`, :mod:`.hf_errors`) classifies its SDK's
errors into kinds and picks the base.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection

MAX_DELAY_S = 60.0
UNKNOWN_TRIES = 2


def tries_allowed(kind: str, attempts: int, *, retried: Collection[str]) -> int:
    """How many tries in all a create whose latest try failed with ``kind`` may take, of ``attempts``."""
    if kind in retried:
        return attempts
    return min(attempts, UNKNOWN_TRIES) if kind == "unknown" else 1


def backoff_s(base_s: float, attempt: int, draw: Callable[[], float] = random.random) -> float:
    """Seconds to wait after failed try ``attempt`` (1-based): ``base_s`` doubled per try, capped at
    :data:`MAX_DELAY_S`, times a jitter in [0.5, 1) from ``draw``."""
    return min(MAX_DELAY_S, base_s * 2 ** (attempt - 1)) * (0.5 + 0.5 * draw())


def failure_text(head: str, tries: int, kind: str, exc: Exception) -> str:
    """A failed create's start error: ``head`` (who failed to start what), how many tries, the last error's
    kind and its text."""
    count = "1 try" if tries == 1 else f"{tries} tries"
    return f"{head} after {count}; last error: {kind} ({type(exc).__name__}): {exc}"
