"""Why a Hugging Face sandbox call failed, and whether another try can help: pure functions of the exception.

``huggingface_hub`` (2.4) raises three families, which the kinds follow:

- the Hub's Jobs API (``run_job``, ``inspect_job``, ``cancel_job``, ``list_jobs``, ``whoami``) raises
  ``HfHubHTTPError`` with the answer in ``.response`` (401: the token is not valid; 403: it has no right to
  run Jobs in the namespace; 429: rate limited; 5xx: the Hub is unavailable);
- the ``sbx-server`` in a job (and the client's own checks: a job that died while booting, a server whose
  protocol is too old, a pool at ``max_hosts``) raises ``huggingface_hub.errors.SandboxError``, whose
  ``status_code`` is the server's answer, or None for the client's own checks;
- a connection that fails or drops is an ``httpx2.HTTPError`` (the library's HTTP client), let through.

====================  ===========  ==========================================================================
kind                  tries        raised as
====================  ===========  ==========================================================================
transport             all          ``httpx2.TransportError`` (connect, read, write, protocol, timeouts)
rate limited          all, slower  status 429
unavailable           all          status >= 500
authentication        1            status 401, or no token at all
forbidden             1            status 403 (the token cannot run Jobs in that namespace)
refused               1            any other 4xx
did not boot          1            ``SandboxError`` without a status (the job died or never became ready)
unknown               2            anything else
====================  ===========  ==========================================================================
"""

from __future__ import annotations

import random
from collections.abc import Callable
from enum import StrEnum

from harness_trainer.sandboxes import create_retry


class Kind(StrEnum):
    TRANSPORT = "transport error"
    RATE_LIMITED = "rate limited"
    UNAVAILABLE = "unavailable"
    AUTHENTICATION = "authentication"
    FORBIDDEN = "forbidden"
    REFUSED = "refused"
    DID_NOT_BOOT = "did not boot"
    UNKNOWN = "unknown"


RETRIED = frozenset({Kind.TRANSPORT, Kind.RATE_LIMITED, Kind.UNAVAILABLE})


def status_of(exc: BaseException) -> int | None:
    """The HTTP status behind ``exc`` (a Hub API answer's, or the sandbox server's), if it has one."""
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    if isinstance(status, int):
        return status
    status = getattr(exc, "status_code", None)
    return status if isinstance(status, int) else None


def classify(exc: BaseException) -> Kind:
    """The kind of a failed create (see the module docstring's table)."""
    import httpx2  # huggingface_hub's HTTP client, there whenever the library is
    from huggingface_hub.errors import SandboxError

    if isinstance(exc, httpx2.TransportError):
        return Kind.TRANSPORT
    status = status_of(exc)
    if status is None:
        if isinstance(exc, SandboxError):
            return Kind.AUTHENTICATION if "token is required" in str(exc) else Kind.DID_NOT_BOOT
        return Kind.UNKNOWN
    if status == 401:
        return Kind.AUTHENTICATION
    if status == 403:
        return Kind.FORBIDDEN
    if status == 429:
        return Kind.RATE_LIMITED
    if status >= 500:
        return Kind.UNAVAILABLE
    return Kind.REFUSED if status >= 400 else Kind.UNKNOWN


def tries_allowed(kind: Kind, attempts: int) -> int:
    """How many tries in all a create whose latest try failed with ``kind`` may take, of ``attempts``."""
    return create_retry.tries_allowed(kind, attempts, retried=RETRIED)


def retry_delay_s(
    kind: Kind, attempt: int, *, base_s: float, draw: Callable[[], float] = random.random
) -> float:
    """Seconds to wait after failed try ``attempt`` (1-based): ``base_s`` (five times it after a 429) doubled
    per try, capped at :data:`~.create_retry.MAX_DELAY_S`, times a jitter in [0.5, 1)."""
    base = base_s * (5 if kind is Kind.RATE_LIMITED else 1)
    return create_retry.backoff_s(base, attempt, draw)


def access_problem(exc: BaseException, variable: str) -> str:
    """One line for a failed access check (``whoami``, then listing the namespace's Jobs) with the token
    from ``variable``."""
    kind = classify(exc)
    if kind is Kind.AUTHENTICATION:
        return f"the hf backend: {variable} is not a valid Hugging Face token (the Hub answered 401)"
    if kind is Kind.FORBIDDEN:
        return (
            f"the hf backend: {variable} may not run Hugging Face Jobs in this namespace (the Hub answered "
            "403): give the token the Jobs write permission, or pick a namespace it may use"
        )
    return f"the hf backend cannot reach the Hugging Face Jobs API ({kind}): {exc}"
