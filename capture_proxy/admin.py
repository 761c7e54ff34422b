"""Admin routes: mint, list, read, export and delete capture sessions (``Authorization: Bearer <admin>``).

``POST /sessions`` → 201 ``{"session_id", "base_url", "root_url", "prefixed_base_url"}`` (400 for an
``upstream`` the proxy was not allowed: it is no open relay);
``GET /sessions``; ``GET /sessions/{id}`` (status, call count, errors, findings);
``GET /sessions/{id}/trace`` → TrainingTrace JSON, or 409 with the reason when nothing is trainable;
``GET /sessions/{id}/calls`` → the journal records, expanded; ``DELETE /sessions/{id}``.
``PUT /policy {"model", "version"}`` → every call from then on goes to that served model (``model`` null
or absent: calls keep their model), its turn recorded with that version (``dispatch_version`` when sent,
``weight_version`` when answered, unless the engine names its own); ``GET /policy`` → it (``{"policy":
null}`` before any);
``DELETE /policy`` → back to the configured or discovered model name.
With replicas (``--replicas``): ``GET /replicas`` → ``{"replicas": [{"index", "engine", "healthy",
"drained", "stale", "sessions", "calls", "failures"}, …]}``; ``POST /replicas/{i}/drain`` takes replica ``i``
out of rotation (its sessions move on their next call), ``POST /replicas/{i}/enable`` puts it back (and clears
``stale``: a replica that may have restarted since a policy version was set); both answer the replica (404
for no such replica or a proxy without replicas).
Without a configured admin key (loopback only) the admin routes are open.
"""

from __future__ import annotations

import asyncio
import hmac
from dataclasses import asdict
from typing import Any

import orjson
from aiohttp import web
from pydantic import ValidationError

from capture_proxy.assembly import UntrainableSession, assemble_trace
from capture_proxy.config import engine_root
from capture_proxy.journal import JournalError
from capture_proxy.replicas import ReplicaSet
from capture_proxy.sessions import Policy, Session, SessionSpec
from capture_proxy.state import STATE, ProxyState


class AdminError(Exception):
    """An admin-route error, answered as ``{"error": {"message", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def response(self) -> web.Response:
        return _json({"error": {"message": self.message, "code": self.status}}, self.status)


def check_admin(request: web.Request) -> ProxyState:
    state = request.app[STATE]
    key = state.config.admin_key
    if key is None:
        return state
    given = request.headers.get("Authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise AdminError(401, "admin routes need 'Authorization: Bearer <admin key>'")
    return state


def _session(request: web.Request) -> tuple[ProxyState, Session]:
    state = check_admin(request)
    session = state.store.get(request.match_info["session_id"])
    if session is None:
        raise AdminError(404, "no such session")
    return state, session


def _urls(state: ProxyState, session: Session) -> dict[str, str]:
    root = state.config.base_url
    return {"base_url": f"{root}/v1", "root_url": root, "prefixed_base_url": f"{root}/s/{session.id}/v1"}


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json")


async def create_session(request: web.Request) -> web.Response:
    state = check_admin(request)
    raw = await request.read()
    try:
        spec = SessionSpec.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        raise AdminError(400, f"invalid session spec: {exc.errors(include_url=False)}") from exc
    if spec.upstream is not None:  # one spelling from here on: each call then looks it up as is
        spec = spec.model_copy(update={"upstream": engine_root(spec.upstream)})
    if spec.upstream is not None and spec.upstream not in state.upstreams:
        allowed = ", ".join(state.upstreams)
        message = f"engine {spec.upstream!r} is not one this proxy forwards to; allowed: {allowed}"
        raise AdminError(400, message)
    try:  # what the session file will hold: refuse it here, before anything is written
        orjson.dumps(spec.model_dump(mode="json"))
    except orjson.JSONEncodeError as exc:
        raise AdminError(400, f"invalid session spec: {exc} (integers must fit in 64 bits)") from exc
    session = await asyncio.get_running_loop().run_in_executor(state.executor, state.store.create, spec)
    return _json({"session_id": session.id, **_urls(state, session)}, status=201)


async def list_sessions(request: web.Request) -> web.Response:
    state = check_admin(request)
    sessions = [s.summary(_urls(state, s)["base_url"]) for s in state.store.sessions.values() if not s.closed]
    return _json({"sessions": sessions})


async def get_session(request: web.Request) -> web.Response:
    state, session = _session(request)
    return _json(session.summary(_urls(state, session)["base_url"]))


async def session_calls(request: web.Request) -> web.Response:
    state, session = _session(request)
    records = await _records(state, session)
    return _json({"calls": [_record_json(r) for r in records]})


async def session_trace(request: web.Request) -> web.Response:
    state, session = _session(request)

    def export() -> bytes:
        return orjson.dumps(assemble_trace(state.store.records(session)))

    try:
        body = await asyncio.get_running_loop().run_in_executor(state.executor, export)
    except UntrainableSession as exc:
        raise AdminError(409, f"nothing trainable in this session: {exc.reason}") from exc
    except JournalError as exc:
        raise AdminError(500, f"the session's journal cannot be read: {exc}") from exc
    return web.Response(body=body, content_type="application/json")


async def delete_session(request: web.Request) -> web.Response:
    state, session = _session(request)
    if state.replicas is not None:
        state.replicas.release(session.id)
    await state.store.delete(session)
    return _json({"session_id": session.id, "deleted": True})


async def _records(state: ProxyState, session: Session) -> list[Any]:
    try:
        return await asyncio.get_running_loop().run_in_executor(state.executor, state.store.records, session)
    except JournalError as exc:
        raise AdminError(500, f"the session's journal cannot be read: {exc}") from exc


def _record_json(record: Any) -> dict[str, Any]:
    data = asdict(record)
    data["finding"] = record.finding.to_json() if record.finding else None
    return data


async def get_policy(request: web.Request) -> web.Response:
    state = check_admin(request)
    return _json({"policy": state.policy.model_dump() if state.policy else None})


async def put_policy(request: web.Request) -> web.Response:
    state = check_admin(request)
    try:
        policy = Policy.model_validate_json(await request.read() or b"{}")
    except ValidationError as exc:
        raise AdminError(400, f"invalid policy: {exc.errors(include_url=False)}") from exc
    state.policy = policy
    return _json({"policy": policy.model_dump()})


async def delete_policy(request: web.Request) -> web.Response:
    state = check_admin(request)
    state.policy = None
    return _json({"policy": None})


def _replica_set(state: ProxyState) -> ReplicaSet:
    if state.replicas is None:
        raise AdminError(404, "this proxy has no replicas (start it with --replicas)")
    return state.replicas


async def list_replicas(request: web.Request) -> web.Response:
    replicas = _replica_set(check_admin(request))
    return _json({"replicas": [replica.to_json() for replica in replicas.replicas]})


async def set_replica(request: web.Request) -> web.Response:
    replicas = _replica_set(check_admin(request))
    index, action = request.match_info["index"], request.match_info["action"]
    if not index.isdigit() or int(index) >= len(replicas.replicas):
        raise AdminError(404, f"no replica {index}: this proxy has {len(replicas.replicas)}")
    replica = replicas.drain(int(index)) if action == "drain" else replicas.enable(int(index))
    return _json(replica.to_json())


def add_routes(app: web.Application) -> None:
    app.router.add_get("/replicas", list_replicas)
    app.router.add_post("/replicas/{index}/{action:drain|enable}", set_replica)
    app.router.add_get("/policy", get_policy)
    app.router.add_put("/policy", put_policy)
    app.router.add_delete("/policy", delete_policy)
    app.router.add_post("/sessions", create_session)
    app.router.add_get("/sessions", list_sessions)
    app.router.add_get("/sessions/{session_id}", get_session)
    app.router.add_delete("/sessions/{session_id}", delete_session)
    app.router.add_get("/sessions/{session_id}/trace", session_trace)
    app.router.add_get("/sessions/{session_id}/calls", session_calls)
