"""Why an E2B sandbox create failed, and whether another try can help: pure functions of the exception.

:func:`classify` names what ``AsyncSandbox.create`` raised (a :class:`Kind`), :func:`tries_allowed` says how
many tries a create failing that way may take, :func:`retry_delay_s` how long to wait before the next.

How the SDK (2.x) raises, which the kinds follow: an API answer >= 300 goes through
``e2b.api.handle_api_exception``: 401 is ``AuthenticationException``, 429 ``RateLimitException``, 503
``ServiceBusyException`` (not a ``SandboxException``), any other status a ``SandboxException`` whose
``status_code`` is the status. E2B answers an unknown template with 404 "template 'x' not found", and a
template whose build is still running (or failed: E2B cannot tell them apart) with 404 "template 'x' has
no ready build". A connection that fails or drops is an ``httpx.TransportError``, let through unwrapped
(the SDK's pyqwest transport maps its errors to httpx's). ``InvalidArgumentException`` is raised before any
request; ``TemplateException`` when the template's envd is too old for the SDK. Before raising, the SDK has
already retried 429/502/503/504 answers (``retries``, 3 by default, waiting as ``Retry-After`` says) and
failed connects (``E2B_CONNECTION_RETRIES``): what reaches :func:`classify` outlasted those.

====================  ===========  ==========================================================================
kind                  tries        raised as
====================  ===========  ==========================================================================
transport             all          ``httpx.TransportError`` (connect, read, write, protocol errors, timeouts)
rate limited          all, slower  ``RateLimitException``, status 429
unavailable           all          ``ServiceBusyException``, ``GuestUnresponsiveException``,
                                   ``TimeoutException`` (and ``SandboxUnreachableException``), status >= 500
template not ready    all          status 404 "… has no ready build"
authentication        1            ``AuthenticationException``, status 401
invalid argument      1            ``InvalidArgumentException``, status 400 or 422
template not found    1            ``NotFoundException``, status 404 (other than "no ready build")
template unusable     1            ``TemplateException``
not enough space      1            ``NotEnoughSpaceException``, status 507
refused               1            any other 4xx (403: no access to the template, 409…)
unknown               2            anything else
====================  ===========  ==========================================================================

An **unknown** exception gets one more try, not all: the SDK's create raises a bare ``Exception`` or a
``SandboxException`` without a status for an answer it could not read, a glitch a second try usually
clears; but an exception nobody classified is as likely a bug (here, or a changed SDK) that repeats, and
every rollout of a run waiting out all tries and their backoff would hide it behind minutes of retries.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from enum import StrEnum

import httpx

from harness_trainer.sandboxes import create_retry

"""No wait between two tries is longer, however many tries are allowed."""
"""Tries in all for a create whose last error is unknown (one retry)."""


class Kind(StrEnum):
    TRANSPORT = "transport error"
    RATE_LIMITED = "rate limited"
    UNAVAILABLE = "unavailable"
    TEMPLATE_NOT_READY = "template not ready"
    AUTHENTICATION = "authentication"
    INVALID_ARGUMENT = "invalid argument"
    TEMPLATE_NOT_FOUND = "template not found"
    TEMPLATE_UNUSABLE = "template unusable"
    NOT_ENOUGH_SPACE = "not enough space"
    REFUSED = "refused"
    UNKNOWN = "unknown"


RETRIED = frozenset({Kind.TRANSPORT, Kind.RATE_LIMITED, Kind.UNAVAILABLE, Kind.TEMPLATE_NOT_READY})
_BUSY = ("ServiceBusyException", "GuestUnresponsiveException")  # newer 2.x SDKs; before, a 503 or 409 status
_BY_STATUS = {
    400: Kind.INVALID_ARGUMENT,
    401: Kind.AUTHENTICATION,
    422: Kind.INVALID_ARGUMENT,
    429: Kind.RATE_LIMITED,
    507: Kind.NOT_ENOUGH_SPACE,
}


def classify(exc: BaseException) -> Kind:
    """The kind of a failed ``AsyncSandbox.create`` (see the module docstring's table)."""
    import e2b  # an optional extra; only asked about once a create (which needs it) has failed

    busy = tuple(getattr(e2b, name) for name in _BUSY if hasattr(e2b, name))
    if isinstance(exc, httpx.TransportError):
        return Kind.TRANSPORT
    if isinstance(exc, e2b.AuthenticationException):
        return Kind.AUTHENTICATION
    if isinstance(exc, e2b.InvalidArgumentException):
        return Kind.INVALID_ARGUMENT
    if isinstance(exc, e2b.NotEnoughSpaceException):
        return Kind.NOT_ENOUGH_SPACE
    if isinstance(exc, e2b.TemplateException):
        return Kind.TEMPLATE_UNUSABLE
    if isinstance(exc, e2b.RateLimitException):
        return Kind.RATE_LIMITED
    if isinstance(exc, (*busy, e2b.TimeoutException)):
        return Kind.UNAVAILABLE
    status = getattr(exc, "status_code", None) if isinstance(exc, e2b.SandboxException) else None
    if isinstance(exc, e2b.NotFoundException) or status == 404:
        # The API's only distinction between a template that is not there and one still building.
        return Kind.TEMPLATE_NOT_READY if "no ready build" in str(exc) else Kind.TEMPLATE_NOT_FOUND
    if not isinstance(status, int):
        return Kind.UNKNOWN
    if status in _BY_STATUS:
        return _BY_STATUS[status]
    if status >= 500:
        return Kind.UNAVAILABLE
    return Kind.REFUSED if status >= 400 else Kind.UNKNOWN


def tries_allowed(kind: Kind, attempts: int) -> int:
    """How many tries in all a create whose latest try failed with ``kind`` may take, of ``attempts``."""
    return create_retry.tries_allowed(kind, attempts, retried=RETRIED)


def retry_delay_s(
    kind: Kind,
    attempt: int,
    *,
    base_s: float,
    rate_limit_base_s: float,
    draw: Callable[[], float] = random.random,
) -> float:
    """Seconds to wait after failed try ``attempt`` (1-based): the base (``rate_limit_base_s`` after a
    429, else ``base_s``) as :func:`~.create_retry.backoff_s` backs off from it (doubled per try, capped,
    jittered).

    The SDK does not expose a 429's ``Retry-After`` (``RateLimitException`` carries only the status and
    text); its own transport already waited as that header said before giving up, so after a 429 this
    backs off from the longer ``rate_limit_base_s`` instead."""
    base = rate_limit_base_s if kind is Kind.RATE_LIMITED else base_s
    return create_retry.backoff_s(base, attempt, draw)


def create_failure(task_name: str, source: str, tries: int, kind: Kind, exc: Exception) -> str:
    """A failed create's start error text (``source``: ``template 'x'`` or ``snapshot 'y'``): how many
    tries, the last error's kind and its text."""
    if kind in RETRIED or kind is Kind.UNKNOWN:
        head = f"E2B sandbox for {task_name} ({source}) did not start"
    else:
        head = f"E2B refused to create a sandbox for {task_name} ({source})"
    return create_retry.failure_text(head, tries, kind, exc)
