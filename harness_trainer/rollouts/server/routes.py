"""The rollout server: rollouts of Harbor tasks over HTTP, with the capture proxy beside it.

``harness-trainer serve --dataset DIR_OR_HF_DATASET --port 8200 --capture-port 8300 --upstream ENGINE``.
At most ``max_concurrent_envs`` sessions (env ``MAX_CONCURRENT_ENVS``, default 8) are open at once; one
more is answered ``429`` with ``Retry-After``. A session holds one slot from ``POST /sessions`` until
``DELETE``; the :class:`~harness_trainer.rollouts.client.factory.HarborSessionFactory` keeps one open for task
metadata, so serve with ``MAX_CONCURRENT_ENVS >= max_concurrent_rollouts + 1``.

Routes (JSON):
- ``GET /health`` → status, open sessions, limit, served model, and ``engines``: every engine rollouts
  may name (``--upstream``, repeatable; the first is the default) with the models it serves; with
  ``--replicas``, also ``replicas``: the capture proxy's ``GET /replicas`` list (``index``, ``engine``,
  ``healthy``, ``drained``, ``sessions``, ``calls``, ``failures``).
- ``GET /splits`` → ``{"splits": ["DATASET:SPLIT", ...], "datasets": [{"name", "splits": [{"name",
  "split", "num_tasks"}]}]}`` (split names: :mod:`harness_trainer.tasks.catalog`);
  ``GET /splits/{split}/tasks`` → ``{"split": "DATASET:SPLIT", "tasks": [{"index", "name",
  "instruction", "agent_timeout_sec", "verifier_timeout_sec", "steps"}]}`` (``steps``: a multi-step
  task's step names, else empty; 404 naming the known splits).
- ``POST /sessions`` → 201 ``{"session_id"}`` (429 when full).
- ``POST /sessions/{id}/rollout`` with ``{"split", "index" | "instruction", **RolloutOptions}`` → 202
  (404 unknown task, 409 already started, 400 bad options, an ``llm_url`` this server was not allowed
  or a ``model`` that engine does not serve, or a sandbox backend that cannot run here: unknown, its
  credentials missing, or remote with no public URL for the capture proxy).
- ``GET /sessions/{id}?wait=SECONDS`` → ``{"status": "idle"|"running"|"done", "result": {...}}``; long
  polls up to ``wait`` (≤ 60) for the rollout to finish. ``result`` omits the trace.
- ``POST /sessions/{id}/stop`` → ends the agent as a timeout would (turns kept, ``timed_out``).
- ``GET /sessions/{id}/trace`` → the TrainingTrace (409 until done, or when the rollout was unscorable).
- ``DELETE /sessions/{id}`` → cancels a running rollout (sandbox and capture session closed) and frees
  the slot.
- ``PUT /policy {"model", "version"}`` → every later model call goes to that served model (``model`` null
  or absent: keeps its model) and records that version (the capture proxy's own ``PUT /policy``; 400 on a
  bad body).

White-box sessions (issue 23: the trainer samples the model and calls the sandbox's tools itself; the
contract: :mod:`~harness_trainer.rollouts.server.environment`; needs the ``openenv`` extra):

- ``POST /sessions/{id}/environment`` with ``{"split", "index" | "instruction", **EnvironmentOptions}``
  (``sandbox``, ``episode_timeout_sec``, ``reward_key``, ``tool_limits``, ``seed``, ``episode_id``) →
  201 once the task's sandbox is up, no agent and no capture session: ``{"session_id", "task": {"name",
  "split", "index", "instruction"}, "sandbox", "tools"}`` (404 unknown task, 409 already started, 400 bad
  options or a sandbox backend that cannot run here, 410 the sandbox failed to start).
- ``GET /sessions/{id}/tools`` → ``{"tools": [{"name", "description", "inputSchema"}]}`` (MCP's shape).
- ``POST /sessions/{id}/tools/call`` with ``{"name", "arguments"}`` (MCP's ``tools/call`` params) → 200
  ``{"data", "done", "metadata", "error"}``: the model's mistakes (an unknown tool, bad arguments, a
  missing file, a command past its timeout) are results with ``error`` set, counted as failed calls.
- ``POST /sessions/{id}/verify`` → the task's verifier run in the sandbox, as in a black-box rollout:
  an :class:`~harness_trainer.rollouts.result.EnvironmentVerdict` (reward, rewards, detail, the tool
  counters); it ends the episode and closes the sandbox; again: the same verdict.
- ``GET /sessions/{id}`` shows ``status`` ``running`` (starting, or a call in flight) | ``ready`` | ``done``
  and ``environment`` (the counters, the verdict, the error).

Tool calls and verify on one session run one at a time. A sandbox that died (or closed on its lifetime)
answers 410 from then on, its sandbox closed; a tool call after the verify 409; a session with no
environment 409. ``DELETE`` cancels the call in flight and closes the sandbox, as do the idle reaper and
shutdown.

Every error is ``{"error": {"message", "code"}}`` with a 4xx status (unknown routes and methods included);
a body over ``MAX_BODY_BYTES`` gets 413.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from pydantic import ValidationError

from capture_proxy.sessions import Policy
from harness_trainer.harnesses import make_harness
from harness_trainer.rollouts.result import EnvironmentOptions, RolloutOptions, RolloutResult
from harness_trainer.rollouts.server.environment import Environment, EnvironmentGone, EpisodeOver
from harness_trainer.rollouts.server.runtime import RolloutRuntime
from harness_trainer.sandboxes.base import SandboxError
from harness_trainer.tasks.catalog import TaskCatalog, as_catalog
from harness_trainer.tasks.sources import TaskSource
from harness_trainer.tasks.task import HarborTask

log = logging.getLogger(__name__)
MAX_WAIT_S = 60.0
MAX_BODY_BYTES = 4 * 1024 * 1024
"""Request bodies over this get 413 (a rollout request is options and at most one task instruction)."""


@dataclass
class Slot:
    id: str
    task: HarborTask | None = None
    job: asyncio.Task[RolloutResult] | None = None
    environment: Environment | None = None
    """A white-box session's sandbox and tools (then ``job`` stays None)."""
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    touched: float = field(default_factory=time.monotonic)
    """When a client last asked about this session (the idle reaper's clock)."""

    @property
    def status(self) -> str:
        if self.environment is not None:
            return self.environment.status
        if self.job is None:
            return "idle"
        return "done" if self.job.done() else "running"


class RolloutServer:
    def __init__(
        self,
        runtime: RolloutRuntime,
        tasks: TaskSource | TaskCatalog,
        max_concurrent_envs: int = 8,
        idle_timeout_s: float | None = 3600.0,
    ) -> None:
        """``idle_timeout_s``: a session no client asked about for this long, and not running a rollout,
        is closed (a crashed trainer's sessions would otherwise hold their slots until a restart)."""
        self.runtime = runtime
        self.tasks = as_catalog(tasks)
        self.limit = max_concurrent_envs
        self.idle_timeout_s = idle_timeout_s
        self.slots: dict[str, Slot] = {}
        self.reaped = 0

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY_BYTES)
        app.cleanup_ctx.append(self._lifecycle)
        app.router.add_get("/health", self.health)
        app.router.add_get("/splits", self.splits)
        app.router.add_get("/splits/{split:.+}/tasks", self.split_tasks)  # Hub ids hold a "/"
        app.router.add_post("/sessions", self.open_session)
        app.router.add_get("/sessions/{id}", self.session_status)
        app.router.add_post("/sessions/{id}/rollout", self.start_rollout)
        app.router.add_post("/sessions/{id}/stop", self.stop_rollout)
        app.router.add_get("/sessions/{id}/trace", self.session_trace)
        app.router.add_post("/sessions/{id}/environment", self.start_environment)
        app.router.add_get("/sessions/{id}/tools", self.list_tools)
        app.router.add_post("/sessions/{id}/tools/call", self.call_tool)
        app.router.add_post("/sessions/{id}/verify", self.verify)
        app.router.add_delete("/sessions/{id}", self.close_session)
        app.router.add_put("/policy", self.put_policy)
        return app

    async def _lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        await self.runtime.start()
        reaper = asyncio.ensure_future(self._reap_idle()) if self.idle_timeout_s else None
        yield
        if reaper is not None:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
        for slot in list(self.slots.values()):
            await self._close(slot)
        await self.runtime.aclose()

    async def _reap_idle(self) -> None:
        assert self.idle_timeout_s
        while True:
            await asyncio.sleep(min(60.0, self.idle_timeout_s / 4))
            now = time.monotonic()
            for slot in list(self.slots.values()):
                if slot.status != "running" and now - slot.touched > self.idle_timeout_s:
                    log.warning(
                        "closing session %s: no client asked about it for %.0f s", slot.id, now - slot.touched
                    )
                    self.reaped += 1
                    await self._close(slot)

    async def health(self, request: web.Request) -> web.Response:
        body = {"status": "ok", "sessions": len(self.slots), "max_concurrent_envs": self.limit}
        body["reaped_idle_sessions"] = self.reaped
        body["capture_sessions"] = await self.runtime.open_capture_sessions()
        engines = [{"url": url, "models": models} for url, models in self.runtime.engines.items()]
        if (replicas := await self.runtime.replicas()) is not None:
            body["replicas"] = replicas
        return web.json_response({**body, "model": self.runtime.model, "engines": engines})

    async def put_policy(self, request: web.Request) -> web.Response:
        """``PUT /policy {"model", "version"}``: the capture proxy's policy, for every later model call."""
        try:
            policy = Policy.model_validate_json(await request.read() or b"{}")
        except ValidationError as exc:
            raise _error(400, f"invalid policy: {exc.errors(include_url=False)}") from exc
        await self.runtime.set_policy(policy.model, policy.version)
        return web.json_response({"policy": policy.model_dump()})

    async def splits(self, request: web.Request) -> web.Response:
        datasets = [
            {
                "name": name,
                "splits": [
                    {"name": f"{name}:{own}", "split": own, "num_tasks": len(source.tasks(own))}
                    for own in source.splits()
                ],
            }
            for name, source in self.tasks.datasets.items()
        ]
        return web.json_response({"splits": self.tasks.splits(), "datasets": datasets})

    async def split_tasks(self, request: web.Request) -> web.Response:
        split = request.match_info["split"]
        try:
            canonical, tasks = self.tasks.canonical(split), self.tasks.tasks(split)
        except KeyError as exc:
            raise _error(404, str(exc.args[0])) from exc
        listed = [
            {
                "index": t.index,
                "name": t.name,
                "instruction": t.instruction,
                "agent_timeout_sec": t.agent_timeout_sec,
                "verifier_timeout_sec": t.verifier_timeout_sec,
                "steps": [step.name for step in t.steps],
            }
            for t in tasks
        ]
        return web.json_response({"split": canonical, "tasks": listed})

    async def open_session(self, request: web.Request) -> web.Response:
        if len(self.slots) >= self.limit:
            message = (
                f"all {self.limit} sessions are open (MAX_CONCURRENT_ENVS); a session factory keeps one for "
                "metadata, so serve with MAX_CONCURRENT_ENVS >= max_concurrent_rollouts + 1"
            )
            raise _error(429, message, headers={"Retry-After": "1"})
        slot = Slot(secrets.token_urlsafe(16))
        self.slots[slot.id] = slot
        return web.json_response({"session_id": slot.id}, status=201)

    def _slot(self, request: web.Request) -> Slot:
        slot = self.slots.get(request.match_info["id"])
        if slot is None:
            raise _error(404, "no such session (closed, idle too long, or the server restarted)")
        slot.touched = time.monotonic()
        return slot

    async def start_rollout(self, request: web.Request) -> web.Response:
        slot = self._slot(request)
        _not_started(slot)
        body = await _json(request)
        task = self._find_task(body)
        try:
            options = RolloutOptions.model_validate(_options(body))
        except ValidationError as exc:
            raise _error(400, f"invalid rollout options: {exc.errors(include_url=False)}") from exc
        if problem := self.runtime.sandbox_problem(options.sandbox):
            raise _error(400, problem)
        try:
            make_harness(options.harness, **options.harness_options)
        except ValueError as exc:
            raise _error(400, str(exc)) from None
        if problem := await self.runtime.engine_problem(options.llm_url, options.model):
            raise _error(400, problem)
        slot.task = task
        slot.job = asyncio.ensure_future(self.runtime.rollout(task, options, slot.stop))
        return web.json_response({"status": "running", "task": task.name}, status=202)

    def _find_task(self, body: dict[str, Any]) -> HarborTask:
        split, index, instruction = body.get("split", ""), body.get("index"), body.get("instruction")
        if not isinstance(split, str):
            raise _error(400, "'split' must be a string")
        if index is not None and (isinstance(index, bool) or not isinstance(index, (int, str))):
            raise _error(400, "'index' must be an integer")
        if instruction is not None and not isinstance(instruction, str):
            raise _error(400, "'instruction' must be a string")
        try:
            if index is not None:
                return self.tasks.task(split, int(index))
            if instruction is not None:
                return self.tasks.find(split, instruction)
        except (KeyError, IndexError, LookupError, ValueError) as exc:
            raise _error(404, f"no such task: {exc}") from exc
        raise _error(400, "say which task: 'index' or 'instruction' (and 'split')")

    async def session_status(self, request: web.Request) -> web.Response:
        slot = self._slot(request)
        try:
            wait = min(float(request.query.get("wait", 0) or 0), MAX_WAIT_S)
        except ValueError:
            wait = math.nan
        if math.isnan(wait):
            raise _error(400, f"'wait' must be a number of seconds (at most {MAX_WAIT_S:g})")
        if slot.job is not None and wait > 0:
            await asyncio.wait({slot.job}, timeout=wait)
        body: dict[str, Any] = {"session_id": slot.id, "status": slot.status}
        if slot.environment is not None:
            body["environment"] = slot.environment.summary()
        elif slot.status == "done":
            body["result"] = _result(slot).model_dump(exclude={"trace"})
        return web.json_response(body)

    async def stop_rollout(self, request: web.Request) -> web.Response:
        slot = self._slot(request)
        slot.stop.set()
        return web.json_response({"session_id": slot.id, "status": slot.status})

    async def session_trace(self, request: web.Request) -> web.Response:
        slot = self._slot(request)
        if slot.environment is not None:
            raise _error(409, "a white-box session has no trace: its caller sampled the model")
        if slot.status != "done":
            raise _error(409, f"the rollout is {slot.status}; wait for it first")
        result = _result(slot)
        if result.trace is None:
            raise _error(409, f"the rollout was unscorable: {result.error}")
        body = await asyncio.to_thread(orjson.dumps, result.trace)
        return web.Response(body=body, content_type="application/json")

    async def close_session(self, request: web.Request) -> web.Response:
        slot = self._slot(request)
        await self._close(slot)
        return web.json_response({"session_id": slot.id, "closed": True})

    async def _close(self, slot: Slot) -> None:
        self.slots.pop(slot.id, None)
        if slot.environment is not None:
            await slot.environment.close()
        if slot.job is not None and not slot.job.done():
            slot.job.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await slot.job

    async def start_environment(self, request: web.Request) -> web.Response:
        """A white-box session: the task's sandbox and tools, no agent (module docstring)."""
        slot = self._slot(request)
        _not_started(slot)
        body = await _json(request)
        task = self._find_task(body)
        try:
            options = EnvironmentOptions.model_validate(_options(body))
            if problem := self.runtime.sandbox_problem(options.sandbox, for_agent=False):
                raise _error(400, problem)
            environment = Environment(task, options, self.runtime.backend(options.sandbox))
        except ValidationError as exc:
            raise _error(400, f"invalid environment options: {exc.errors(include_url=False)}") from exc
        except (ValueError, ImportError) as exc:  # tool limits ToolLimits refuses; no `openenv` extra
            raise _error(400, str(exc)) from exc
        slot.task, slot.environment = task, environment
        try:
            await environment.start()
        except (SandboxError, EnvironmentGone) as exc:
            raise _error(410, f"the sandbox did not start: {exc}") from exc
        finally:
            slot.touched = time.monotonic()  # the idle clock starts when the start ends
        described = {"name": task.name, "split": task.split, "index": task.index}
        body = {
            "session_id": slot.id,
            "task": {**described, "instruction": task.instruction},
            "sandbox": options.sandbox,
            "tools": _tool_specs(environment),
        }
        return web.json_response(body, status=201)

    async def list_tools(self, request: web.Request) -> web.Response:
        environment = _environment(self._slot(request))
        return web.json_response({"tools": _tool_specs(environment)})

    async def call_tool(self, request: web.Request) -> web.Response:
        slot = self._slot(request)
        environment = _environment(slot)
        body = await _json(request)
        name, arguments = body.get("name"), body.get("arguments", {})
        if not isinstance(name, str) or set(body) - {"name", "arguments"}:
            raise _error(400, 'give {"name": TOOL, "arguments": {...}} (MCP\'s tools/call params)')
        try:
            result = await environment.call_tool(name, arguments)
        except EnvironmentGone as exc:
            raise _error(410, f"the session's sandbox is gone: {exc}") from exc
        except EpisodeOver as exc:
            raise _error(409, str(exc)) from exc
        finally:
            slot.touched = time.monotonic()  # and again when a (long) call ends
        body = {"data": result.data, "done": result.done, "metadata": result.metadata, "error": result.error}
        return web.json_response(body)

    async def verify(self, request: web.Request) -> web.Response:
        slot = self._slot(request)
        environment = _environment(slot)
        try:
            verdict = await environment.verify()
        except EnvironmentGone as exc:
            raise _error(410, f"the session's sandbox is gone: {exc}") from exc
        finally:
            slot.touched = time.monotonic()
        return web.json_response(verdict.model_dump())


_TASK_KEYS = ("split", "index", "instruction")


def _options(body: dict[str, Any]) -> dict[str, Any]:
    """A start request's options: its body without the task's keys."""
    return {k: v for k, v in body.items() if k not in _TASK_KEYS}


def _not_started(slot: Slot) -> None:
    if slot.job is not None or slot.environment is not None:
        raise _error(409, "this session already started its rollout or environment; open a new session")


def _environment(slot: Slot) -> Environment:
    """The slot's environment once started; 409 otherwise."""
    environment = slot.environment
    if environment is None:
        raise _error(409, "this session has no environment: POST /sessions/{id}/environment first")
    if environment.tools is None and environment.status == "running":
        raise _error(409, "this session's environment is still starting")
    return environment


def _tool_specs(environment: Environment) -> list[dict[str, Any]]:
    """The tools as MCP lists them (``inputSchema``, camel-cased); none when the sandbox never started."""
    tools = environment.tools.list_tools() if environment.tools is not None else []
    return [{"name": t.name, "description": t.description, "inputSchema": t.input_schema} for t in tools]


def _result(slot: Slot) -> RolloutResult:
    assert slot.job is not None and slot.task is not None
    if slot.job.cancelled():
        return RolloutResult(
            task_name=slot.task.name, harness="", sandbox="", error="cancelled", error_kind="cancelled"
        )
    exc = slot.job.exception()
    if exc is not None:  # run_rollout turns every failure into a result: this is a bug of the server's
        error = f"{type(exc).__name__}: {exc}"
        return RolloutResult(
            task_name=slot.task.name, harness="", sandbox="", error=error, error_kind="unexpected"
        )
    return slot.job.result()


_ERRORS: dict[int, type[web.HTTPException]] = {
    400: web.HTTPBadRequest,
    404: web.HTTPNotFound,
    409: web.HTTPConflict,
    410: web.HTTPGone,
    413: web.HTTPRequestEntityTooLarge,
    429: web.HTTPTooManyRequests,
}


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.HTTPException:
    body = json.dumps({"error": {"message": message, "code": status}})
    if status == 413:
        return web.HTTPRequestEntityTooLarge(
            MAX_BODY_BYTES, 0, headers=headers, text=body, content_type="application/json"
        )
    return _ERRORS[status](headers=headers, text=body, content_type="application/json")


async def _json(request: web.Request) -> dict[str, Any]:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise _error(413, f"request body exceeds the server's limit of {MAX_BODY_BYTES} bytes") from exc
    try:
        body = orjson.loads(raw)  # orjson refuses nesting deeper than 1024 (json.loads would recurse)
    except orjson.JSONDecodeError as exc:
        raise _error(400, f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise _error(400, "request body must be a JSON object")
    return body


def _allow(exc: web.HTTPException) -> dict[str, str]:
    return {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else {}


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise
        # aiohttp's own rejections (unknown route, wrong method): the same JSON error shape as ours
        message = f"{exc.reason}: {request.method} {request.path}"
        body = {"error": {"message": message, "code": exc.status}}
        return web.json_response(body, status=exc.status, headers=_allow(exc))
    except Exception:  # answer and log, never kill the server
        log.exception("error on %s %s", request.method, request.path)
        return web.json_response({"error": {"message": "internal error", "code": 500}}, status=500)
