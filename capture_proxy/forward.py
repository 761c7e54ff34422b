"""One agent model call: translate, forward, capture, journal, answer.

Order of work (the contract of this module):
1. the dialect parses the body; constrained decoding is refused (400) before any budget is spent;
2. a model call is reserved from the session's budget; if it is spent, the agent gets a terminal
   "step budget exhausted" reply in its dialect, journaled as ``budget_exhausted``, never trained on;
3. the call is forwarded (non-streaming, with the session's sampling policy and the capture flags) to the
   session's engine, or with replicas to its pinned replica, failing over to another when that one stops
   answering (:mod:`capture_proxy.replicas`);
4. ids and logprobs are captured and checked, the record is appended to the journal and fdatasync'd;
5. only then the agent gets its reply: JSON, or an SSE replay in its dialect (:mod:`capture_proxy.answer`).
Steps 3–4 run in their own task, so an agent that disconnects (or a cancelled handler) cannot lose or
duplicate the record.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

from aiohttp import web

from capture_proxy.answer import Outcome, done, render, respond
from capture_proxy.capture import MalformedReply, capture, normalise
from capture_proxy.constraints import refuse_constrained
from capture_proxy.dialects.base import ChatCall, Dialect, Reply
from capture_proxy.records import (
    BUDGET_EXHAUSTED,
    CONTEXT_EXHAUSTED,
    MODEL,
    UPSTREAM_ERROR,
    CallRecord,
    Finding,
)
from capture_proxy.sessions import Session
from capture_proxy.state import ProxyState
from capture_proxy.upstream import Upstream, UpstreamResult

log = logging.getLogger(__name__)
BUDGET_MESSAGE = "Step budget exhausted: this episode is over. Stop now."
CONTEXT_MESSAGE = "Context length exhausted: the conversation no longer fits the model. Stop now."
# With this many calls in flight or fewer, the event loop syncs a journal line itself. Measured on the
# proxy benchmark (2 cores): the sync helper's round trip costs more than it overlaps up to about 4 calls
# in flight (at 4 closed-loop agents, inline syncs gave 0.87 of the pass-through's req/s against 0.71;
# at 8, 0.81 against 0.89), and 64 paced agents rarely have more than 2 in flight.
QUIET_INFLIGHT = 4


async def model_call(
    request: web.Request, state: ProxyState, session: Session, dialect: Dialect, body: dict[str, Any]
) -> web.StreamResponse:
    started = time.perf_counter()
    call = dialect.parse_request(body)
    refuse_constrained(call.body)
    if not session.reserve():
        outcome = Outcome(reply=terminal_reply(BUDGET_MESSAGE))
        await journal_terminal(state, session, call, BUDGET_EXHAUSTED, outcome.reply, None)
        return await respond(request, state, dialect, call, done(outcome))
    # The policy current when the call is made picks the served model and is the call's dispatch version.
    policy = state.policy
    spec = session.spec
    upstream = state.upstream_of(spec)
    if policy is not None and policy.model is not None:
        model = policy.model
    else:
        model = spec.model or await state.model_name(call.model, upstream)
    upstream_body = session.spec.sampling.upstream_body(call, model)
    pending: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
    dispatch = policy.version if policy is not None else None
    work = forward(state, session, upstream, dialect, call, upstream_body, started, dispatch)
    state.track(asyncio.ensure_future(_settle(state, pending, work)))
    response = await respond(request, state, dialect, call, pending)
    added = time.perf_counter() - started - pending.result().upstream_ms / 1000
    state.metrics.added.observe(max(added, 0.0))
    return response


async def _settle(
    state: ProxyState, outcome: asyncio.Future[Outcome], work: Coroutine[Any, Any, Outcome]
) -> None:
    """Run ``work`` (in its own task) and hand its result to ``outcome`` from inside that task.

    The handler waiting on ``outcome`` then resumes at the next turn of the loop; waiting on the task
    itself (``asyncio.wait``) takes two. A cancelled handler cancels ``outcome``, never the work.
    """
    try:
        result = await work
    except asyncio.CancelledError:
        outcome.cancel()
        raise
    except Exception as exc:
        state.finished(asyncio.current_task())
        if outcome.done():
            log.error("a model call failed after its agent went away", exc_info=exc)
        else:
            outcome.set_exception(exc)
        return
    state.finished(asyncio.current_task())
    if not outcome.done():
        outcome.set_result(result)


async def forward(
    state: ProxyState,
    session: Session,
    upstream: Upstream,
    dialect: Dialect,
    call: ChatCall,
    body: dict[str, Any],
    started: float,
    dispatch_version: int | None = None,
) -> Outcome:
    """Steps 3–4; owns the budget reservation from here on. ``dispatch_version`` (the policy version when
    the call was sent) is recorded on the turn as it is; its ``weight_version`` is the engine reply's own,
    else the policy version when the reply came back (a push may have landed while the call ran)."""
    wall_start = time.time()
    result, engine = await send(state, session, upstream, body)
    returned = state.policy
    return_version = returned.version if returned is not None else None
    state.metrics.upstream.observe(result.upstream_ms / 1000)
    timings: dict[str, float] = {"upstream_ms": round(result.upstream_ms, 3), "attempts": result.attempts}
    if result.reply is None:
        session.release()
        state.metrics.error("context_exhausted" if result.context_exhausted else f"upstream_{result.status}")
        if result.context_exhausted:
            finding = Finding("context_exhausted", result.error or "the prompt exceeds the model's context")
            reply = terminal_reply(CONTEXT_MESSAGE)
            await journal_terminal(
                state, session, call, CONTEXT_EXHAUSTED, reply, finding, body, timings, engine
            )
            return Outcome(reply=reply, upstream_ms=result.upstream_ms)
        refused = 400 <= result.status < 500 and result.status not in (408, 429)
        # A refusal answers the agent's own request; anything else is the engine failing past retries,
        # which cut the agent's episode short (its reward then says nothing about the policy).
        code = "upstream_error" if refused else "engine_unavailable"
        status = 400 if refused else 502
        finding = Finding(code, result.error or "the engine failed")
        await journal_terminal(state, session, call, UPSTREAM_ERROR, None, finding, body, timings, engine)
        return Outcome(status=status, error=result.error, upstream_ms=result.upstream_ms)
    reply_json = result.reply
    try:
        reply = normalise(reply_json)
        captured = capture(reply_json, result.prompt_text, result.logprobs)
    except MalformedReply as exc:
        session.release()
        state.metrics.error("malformed_reply")
        finding = Finding("malformed_reply", str(exc))
        await journal_terminal(state, session, call, UPSTREAM_ERROR, None, finding, engine=engine)
        return Outcome(
            status=502, error=f"the engine's reply could not be used: {exc}", upstream_ms=result.upstream_ms
        )
    if captured.finding is not None:
        state.metrics.error(f"finding_{captured.finding.code}")
    timings["proxy_ms"] = round((time.perf_counter() - started) * 1000 - result.upstream_ms, 3)
    record = new_record(
        session,
        call,
        MODEL,
        body,
        wall_start,
        _without_capture(reply_json),
        prompt_text=captured.prompt_text,
        completion_token_ids=captured.completion_token_ids,
        logprobs=captured.logprobs,
        weight_version=captured.weight_version if captured.weight_version is not None else return_version,
        dispatch_version=dispatch_version,
        engine=engine,
        finding=captured.finding,
        timings=timings,
    )
    rendered: list[bytes] = []

    def render_meanwhile() -> None:
        # Rendered while the journal line goes to the disk, not after. A failure here would leave the
        # line written but not counted: the reply is rendered again when it is sent, and fails there.
        with contextlib.suppress(Exception):
            rendered.append(render(dialect, call, reply))

    await append(state, session, record, meanwhile=render_meanwhile)
    return Outcome(reply=reply, upstream_ms=result.upstream_ms, body=rendered[0] if rendered else None)


async def send(
    state: ProxyState, session: Session, upstream: Upstream, body: dict[str, Any]
) -> tuple[UpstreamResult, str]:
    """Step 3: the engine's result and the root of the engine that gave it.

    A session routed by replicas goes to its pinned replica; one that does not answer past its retries is
    taken out of rotation and the call is sent, whole, to the replica the session is pinned to next (each
    replica at most once). The result then counts every attempt and all the time spent waiting. With every
    replica stale (rule 8 of :mod:`capture_proxy.replicas`), the call is failed without being sent.
    """
    headers = session.spec.engine_headers or None
    replicas = state.routed(session.spec)
    if replicas is None:
        return await upstream.chat(body, headers), upstream.root
    tried: set[int] = set()
    attempts, waited = 0, 0.0
    while True:
        replica = replicas.pick(session.id)
        if replica.stale:  # every replica is: none is known to serve the current weights
            error = "no replica serves the current policy version (every one is stale: restarted)"
            return UpstreamResult(None, 503, error, attempts=0), replica.upstream.root
        result = await replica.upstream.chat(body, headers)
        replicas.observe(replica, result)
        tried.add(replica.index)
        attempts += result.attempts
        waited += result.upstream_ms
        # A session deleted meanwhile is not pinned again (its pin would never be released).
        failed = result.reply is None and result.unreachable and not session.closed
        if failed and replicas.pick(session.id).index not in tried:
            log.warning("session %s: failing over from replica %d", session.id, replica.index)
            continue
        result.attempts, result.upstream_ms = attempts, waited
        return result, replica.upstream.root


def new_record(
    session: Session,
    call: ChatCall,
    kind: str,
    body: dict[str, Any],
    started_at: float,
    response: dict[str, Any] | None,
    **fields: Any,
) -> CallRecord:
    """A record of ``call``, not yet journaled (:func:`append` assigns its seq and call id)."""
    return CallRecord(
        seq=-1,
        call_id="",
        kind=kind,
        dialect=call.dialect,
        has_tools=call.has_tools,
        started_at=started_at,
        finished_at=time.time(),
        upstream_request=body,
        agent_params=call.agent_params,
        sampling=session.sampling_json,
        response=response,
        **fields,
    )


async def append(
    state: ProxyState, session: Session, record: CallRecord, meanwhile: Callable[[], None] | None = None
) -> None:
    """Journal ``record`` under the session's lock, assigning its seq and stable call id.

    ``meanwhile`` runs while the line is on its way to the disk (not at all if the session was closed).
    """
    async with session.lock:
        if session.closed:
            return
        record.seq = session.journal.next_seq
        record.call_id = f"call-{record.seq:05d}"
        started = time.perf_counter()
        quiet = state.inflight <= QUIET_INFLIGHT
        written = await session.journal.append(record, quiet=quiet, meanwhile=meanwhile)
        state.metrics.journal.observe(time.perf_counter() - started)
    state.metrics.journal_bytes += written
    session.note(record)


async def journal_terminal(
    state: ProxyState,
    session: Session,
    call: ChatCall,
    kind: str,
    reply: Reply | None,
    finding: Finding | None,
    body: dict[str, Any] | None = None,
    timings: dict[str, float] | None = None,
    engine: str | None = None,
) -> None:
    """Journal a call that produced no trainable sample (budget, context, engine failure)."""
    now = time.time()
    response = None
    if reply is not None:
        response = {"proxy_reply": {"content": reply.content, "finish_reason": reply.finish_reason}}
    record = new_record(
        session,
        call,
        kind,
        body if body is not None else call.body,
        now,
        response,
        finding=finding,
        timings=timings or {},
        engine=engine,
    )
    await append(state, session, record)


def terminal_reply(message: str) -> Reply:
    """A final assistant message made by the proxy (no tool calls, so agents end their loop)."""
    return Reply(
        id=f"chatcmpl-proxy-{uuid.uuid4().hex[:24]}",
        created=int(time.time()),
        model="",
        content=message,
        tool_calls=[],
        finish_reason="stop",
        prompt_tokens=0,
        completion_tokens=0,
    )


def _without_capture(reply: dict[str, Any]) -> dict[str, Any]:
    """The reply as journaled: ids and logprobs are stored once, in their own fields."""
    response = {k: v for k, v in reply.items() if k != "prompt_token_ids"}
    choices = response.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        first = {k: v for k, v in choices[0].items() if k not in ("token_ids", "logprobs")}
        response["choices"] = [first, *choices[1:]]
    return response
