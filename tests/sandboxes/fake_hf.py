"""A fake Hugging Face Hub for the hf backend, at the lowest level ``huggingface_hub`` allows: an HTTP server
on loopback standing in for the Hub's Jobs API (``/api/whoami-v2``, ``/api/jobs/{namespace}…``) **and** for
the ``sbx-server`` (protocol 3) each sandbox job runs, so the library's own client code (``HfApi``,
``Sandbox``, ``SandboxPool``, ``httpx2``) runs in the tests. :meth:`FakeHub.use` points the library at it
(``huggingface_hub.constants.ENDPOINT``, ``HF_HOME`` for the pool cache, ``HF_TOKEN``).

Jobs: a job runs the sandbox bootstrap command (checked), in its image's filesystem: a mount + PID namespace
chrooted into an overlay of the image exported from the Docker daemon, as the fake E2B cloud's sandboxes
(:mod:`tests.sandboxes.fake_rootfs`, so it needs root and Docker). ``run_job`` answers ``SCHEDULING`` with
the job's exposed URL; the job is ``RUNNING`` and its server answers ``/health`` once its root is up.
``cancel_job`` kills every process in it (a job that has ended keeps its stage). :meth:`FakeHub.end_job`
ends a job as its VM failing would (``ERROR``) or its time running out (``COMPLETED``): the Jobs API reports
that stage and message, its requests in flight lose their connection, and its server no longer answers
(502, as the Jobs proxy for a job that is gone), nor do the pooled sandboxes it held. The exposed URL is ``http://127.0.0.1:<port>/<job>--49983.fake``:
the Jobs proxy's URLs are ``https://<job>--49983.<domain>``, which loopback cannot serve, and the library
checks only the ``--49983.`` part when it boots a job (its host adoption checks, which want https, are off
in the backend: ``adopt_hosts="never"``).

Sandbox servers: a dedicated job's routes are ``/v1/…``, run as root with absolute paths; a pool host
(``SBX_HOST_MODE=1``) makes sandboxes (``POST /v1/sandboxes``, at most ``SBX_CAPACITY``), each a uid of its
own and a home (``/home/sbx-<n>``) in the host's root, whose routes are ``/v1/sandboxes/<id>/…``, whose
commands run as that uid and whose file API is rooted at its home. The real server confines a pooled
sandbox with Landlock; here plain file permissions stand in (the uid owns only its home; ``/tmp`` stays
world-writable, which Landlock may not allow). Tokens are checked as the server checks them: the HF bearer
on every request, the job's derived token (``X-Sandbox-Token``) for the job's or host's routes, a pooled
sandbox's own token for its routes.

Every request is recorded (``requests``). Besides the Jobs routes, the library fetches the Hub's public
registry of agent harnesses (``/api/agent-harnesses``, for its user agent): an empty one here. A request
the fake does not implement answers **500 naming the method and path** (and is recorded in ``unknown``),
so that a library that starts calling something new fails loudly. Faults: ``fail_run_jobs`` (the next
``run_job`` calls answer these statuses), ``fail_list_jobs`` (the same for ``list_jobs``), another token
than ``token`` (401), ``forbidden`` (403 on the Jobs routes). Latencies (for benchmarks): ``job_start_s``
(a job is ``RUNNING`` that long after ``run_job`` at the earliest: scheduling, the image's pull, the server's
start) and ``create_rate_per_s`` (pooled sandboxes are made at most that fast, Hub-wide, each create waiting
for its turn).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import json
import os
import posixpath
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from harness_trainer.sandboxes.processes import exit_status, spawn
from tests.sandboxes.fake_rootfs import RootFs, cloud_env, image_env, image_rootfs

PORT = 49983
PROTOCOL = 3
USER = {"id": "fake-user-id", "name": "fake-user", "type": "user"}


def derive(hf_token: str, nonce: str) -> str:
    """The sandbox token a job's server expects (the library's derivation, redone independently)."""
    return hmac.new(hf_token.encode(), f"hf-sandbox:{nonce}".encode(), hashlib.sha256).hexdigest()


@dataclass
class PooledBox:
    """One sandbox of a pool host: a uid, a home in the host's root, a token."""

    local_id: str
    uid: int
    home: str
    token: str
    env: dict[str, str]
    idle_timeout_secs: int | None


@dataclass
class FakeJob:
    id: str
    namespace: str
    spec: dict[str, Any]
    stage: str = "SCHEDULING"
    message: str | None = None
    rootfs: RootFs | None = None
    env: dict[str, str] = field(default_factory=dict)
    boxes: dict[str, PooledBox] = field(default_factory=dict)
    logs: list[str] = field(default_factory=list)
    in_flight: set[asyncio.BaseTransport] = field(default_factory=set)  # of its server's requests

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.spec.get("labels") or {})

    @property
    def host_mode(self) -> bool:
        return self.spec["environment"].get("SBX_HOST_MODE") == "1"

    def info(self, base_url: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "createdAt": "2026-01-01T00:00:00.000Z",
            "dockerImage": self.spec.get("dockerImage"),
            "spaceId": self.spec.get("spaceId"),
            "owner": {"id": USER["id"], "name": self.namespace, "type": "user"},
            "initiator": {"type": "user", "id": USER["id"], "name": USER["name"]},
            "command": self.spec["command"],
            "arguments": self.spec.get("arguments", []),
            "environment": self.spec["environment"],
            "secrets": sorted(self.spec.get("secrets") or {}),
            "flavor": self.spec.get("flavor"),
            "labels": self.labels,
            "status": {"stage": self.stage, "message": self.message, "exposeUrls": [self.url(base_url)]},
        }

    def url(self, base_url: str) -> str:
        return f"{base_url}/{self.id}--{PORT}.fake"


class FakeHub:
    """The fake Hub and its jobs' servers, served from a thread of its own (its own event loop)."""

    def __init__(self, root: Path, *, token: str = "hf_fake_token") -> None:
        self.root = root
        self.token = token
        self.forbidden = False
        self.fail_run_jobs: list[int] = []
        self.fail_list_jobs: list[int] = []
        self.job_start_s = 0.0
        self.create_rate_per_s: float | None = None
        self._next_create = 0.0  # the loop's time of the next pooled create's turn
        self.jobs: dict[str, FakeJob] = {}
        self.requests: list[tuple[str, str]] = []
        self.unknown: list[str] = []
        self._ids = itertools.count(1)
        self._uids = itertools.count(21000)
        self._tasks: set[asyncio.Future[Any]] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="fake-hf-hub", daemon=True)
        self.base_url = ""

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> FakeHub:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the fake Hub did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        self._runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.base_url = f"http://127.0.0.1:{port}"
        self._ready.set()
        self._loop.run_forever()

    async def _shutdown(self) -> None:
        for job in list(self.jobs.values()):
            await self._stop(job, "CANCELED")
        await self._runner.cleanup()

    @contextmanager
    def use(self, monkeypatch: Any) -> Iterator[FakeHub]:
        """Point ``huggingface_hub`` (and the backend) at this Hub for the test."""
        from huggingface_hub import constants

        monkeypatch.setattr(constants, "ENDPOINT", self.base_url)
        monkeypatch.setattr(constants, "HF_HOME", str(self.root / "hf-home"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the tests' default; this Hub is local
        monkeypatch.setenv("HF_TOKEN", self.token)
        yield self

    def running(self, **labels: str) -> list[FakeJob]:
        """Jobs not yet ended, with these labels."""
        return [
            job
            for job in self.jobs.values()
            if job.stage in ("SCHEDULING", "RUNNING")
            and all(job.labels.get(k) == v for k, v in labels.items())
        ]

    def end_job(self, job_id: str, stage: str = "ERROR", message: str | None = None) -> None:
        """End job ``job_id`` from the Hub's side (see the module docstring), as of when this returns."""
        job = self.jobs[job_id]
        asyncio.run_coroutine_threadsafe(self._end(job, stage, message), self._loop).result(60)

    async def _end(self, job: FakeJob, stage: str, message: str | None) -> None:
        job.message = message
        job.stage = stage  # first: from now on its server answers nothing
        for transport in list(job.in_flight):
            transport.abort()  # type: ignore[attr-defined]
        await self._stop(job, stage)

    def boxes(self) -> list[PooledBox]:
        return [box for job in self.running() for box in job.boxes.values()]

    # ------------------------------------------------------------------ routing

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        self.requests.append((request.method, path))
        if (request.method, path) == ("GET", "/api/agent-harnesses"):  # public: the library's user agent
            return web.json_response({"standardEnvVars": [], "harnesses": {}})
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return _error(401, "Invalid credentials in Authorization header")
        parts = path.strip("/").split("/")
        if parts[0] == "api":
            return await self._hub(request, parts[1:])
        if parts[0].endswith(f"--{PORT}.fake"):
            job = self.jobs.get(parts[0].split("--", 1)[0])
            if job is None or job.stage not in ("SCHEDULING", "RUNNING"):
                return _error(502, "no such job behind the proxy")
            transport = request.transport
            if transport is not None:
                job.in_flight.add(transport)
            try:
                return await self._server(request, job, parts[1:])
            finally:
                job.in_flight.discard(transport)  # type: ignore[arg-type]
        return self._unknown(request)

    def _unknown(self, request: web.Request) -> web.Response:
        what = f"{request.method} {request.path}"
        self.unknown.append(what)
        return _error(500, f"fake Hub: unknown route {what}")

    async def _hub(self, request: web.Request, parts: list[str]) -> web.StreamResponse:
        method = request.method
        if parts == ["whoami-v2"] and method == "GET":
            return web.json_response({**USER, "auth": {"type": "access_token"}})
        if parts[0] != "jobs" or len(parts) < 2:
            return self._unknown(request)
        if self.forbidden:
            return _error(403, "This token may not use Jobs")
        namespace, rest = parts[1], parts[2:]
        if not rest and method == "POST":
            return await self._run_job(request, namespace)
        if not rest and method == "GET":
            if self.fail_list_jobs:
                status = self.fail_list_jobs.pop(0)
                return _error(status, f"fake Hub: list_jobs refused ({status})")
            stages = request.query.getall("stage", [])
            wanted = dict(label.split("=", 1) for label in request.query.getall("label", []))
            found = [
                job.info(self.base_url)
                for job in self.jobs.values()
                if job.namespace == namespace
                and (not stages or job.stage in stages)
                and all(job.labels.get(k) == v for k, v in wanted.items())
            ]
            return web.json_response(found)
        job = self.jobs.get(rest[0])
        if job is None or job.namespace != namespace:
            return _error(404, f"job {rest[0]} not found")
        if len(rest) == 1 and method == "GET":
            return web.json_response(job.info(self.base_url))
        if rest[1:] == ["cancel"] and method == "POST":
            if job.stage in ("SCHEDULING", "RUNNING"):
                await self._stop(job, "CANCELED")
            return web.json_response({})
        if rest[1:] == ["logs"] and method == "GET":
            body = "".join(
                f"data: {json.dumps({'data': line, 'timestamp': '2026'})}\n\n" for line in job.logs
            )
            return web.Response(text=body, content_type="text/event-stream")
        return self._unknown(request)

    async def _run_job(self, request: web.Request, namespace: str) -> web.Response:
        from huggingface_hub._sandbox import _bootstrap_command

        spec = await request.json()
        if self.fail_run_jobs:
            status = self.fail_run_jobs.pop(0)
            return _error(status, f"fake Hub: run_job refused ({status})")
        if spec.get("command") != _bootstrap_command():
            return _error(400, "fake Hub: only sandbox jobs run here (not the bootstrap command)")
        if spec.get("expose", {}).get("ports") != [PORT] or not (spec.get("secrets") or {}).get("SBX_TOKEN"):
            return _error(400, f"fake Hub: a sandbox job exposes {PORT} and carries SBX_TOKEN")
        job = FakeJob(f"job{next(self._ids):04d}", namespace, spec)
        self.jobs[job.id] = job
        self._keep(asyncio.ensure_future(self._boot(job)))
        return web.json_response(job.info(self.base_url))

    async def _boot(self, job: FakeJob) -> None:
        image = job.spec["dockerImage"]
        started = self._loop.time()
        try:
            base = await asyncio.to_thread(image_rootfs, image)
            job.env = {**image_env(base), **cloud_env()}
            job.rootfs = RootFs([base], self.root / "jobs" / job.id)
            await job.rootfs.start()
        except Exception as exc:  # the job errors out, as one whose image cannot be pulled
            job.logs.append(f"cannot start {image}: {exc}")
            job.stage = "ERROR"
            return
        await asyncio.sleep(self.job_start_s - (self._loop.time() - started))
        if job.stage == "SCHEDULING":
            job.stage = "RUNNING"
        else:  # cancelled while booting
            await job.rootfs.stop()

    async def _stop(self, job: FakeJob, stage: str) -> None:
        job.stage = stage
        job.boxes.clear()
        if job.rootfs is not None and job.rootfs.namespace is not None:
            await job.rootfs.stop()

    def _keep(self, future: asyncio.Future[Any]) -> None:
        self._tasks.add(future)
        future.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ the sandbox server

    async def _server(self, request: web.Request, job: FakeJob, parts: list[str]) -> web.StreamResponse:
        if parts == ["health"]:
            if job.stage != "RUNNING":
                return _error(503, "starting")
            return web.json_response({"status": "ok", "protocol": PROTOCOL, "version": "fake"})
        if job.stage != "RUNNING" or parts[:1] != ["v1"]:
            return self._unknown(request)
        job_token = derive(self.token, job.labels["hf-sandbox-nonce"])
        given = request.headers.get("X-Sandbox-Token")
        if job.host_mode and parts[1:2] == ["sandboxes"]:
            if len(parts) == 2:
                if given != job_token:
                    return _error(403, "wrong host token")
                return await self._host_sandboxes(request, job)
            box = job.boxes.get(parts[2])
            if box is None:
                return _error(404, f"sandbox {parts[2]} not found")
            if parts[3:] == ["token"] and request.method == "GET" and given == job_token:
                return web.json_response({"token": box.token})
            if given != box.token:
                return _error(403, "wrong sandbox token")
            if len(parts) == 3 and request.method == "DELETE":
                await self._delete_box(job, box)
                return web.json_response({"deleted": True})
            return await self._sandbox_route(request, job, box, parts[3:])
        if job.host_mode or given != job_token:
            return _error(403, "wrong sandbox token") if given != job_token else self._unknown(request)
        return await self._sandbox_route(request, job, None, parts[1:])

    async def _host_sandboxes(self, request: web.Request, job: FakeJob) -> web.Response:
        if request.method == "GET":
            return web.json_response([{"id": box.local_id} for box in job.boxes.values()])
        if request.method != "POST":
            return self._unknown(request)
        body = await request.json()
        for _ in range(int(body.get("count", 1))):
            await self._create_turn()
        capacity = int(job.spec["environment"]["SBX_CAPACITY"])
        made, rejected = [], 0
        for _ in range(int(body.get("count", 1))):
            if len(job.boxes) >= capacity:
                rejected += 1
                continue
            uid = next(self._uids)
            env = dict(body.get("env") or {})
            box = PooledBox(
                f"s{uid}", uid, f"/home/sbx-{uid}", os.urandom(16).hex(), env, body.get("idle_timeout_secs")
            )
            assert job.rootfs is not None
            home = job.rootfs.host(box.home)
            home.mkdir(parents=True)
            os.chown(home, uid, uid)
            job.boxes[box.local_id] = box
            made.append({"id": box.local_id, "token": box.token})
        return web.json_response({"sandboxes": made, "rejected": rejected})

    async def _create_turn(self) -> None:
        """Wait for the next pooled create's turn under ``create_rate_per_s`` (none without one)."""
        if not self.create_rate_per_s:
            return
        now = self._loop.time()
        turn = max(now, self._next_create)
        self._next_create = turn + 1 / self.create_rate_per_s
        await asyncio.sleep(turn - now)

    async def _delete_box(self, job: FakeJob, box: PooledBox) -> None:
        del job.boxes[box.local_id]
        assert job.rootfs is not None and job.rootfs.namespace is not None
        namespace = os.readlink(f"/proc/{job.rootfs.namespace.init_pid}/ns/pid")
        for entry in Path("/proc").iterdir():  # the box's own processes, by pid: its uid in this job
            with suppress(OSError, ValueError):
                if not entry.name.isdigit() or os.readlink(entry / "ns" / "pid") != namespace:
                    continue
                uid = int((entry / "status").read_text().split("\nUid:\t", 1)[1].split()[0])
                if uid == box.uid:
                    os.kill(int(entry.name), signal.SIGKILL)
        shutil.rmtree(job.rootfs.host(box.home), ignore_errors=True)

    def _host_path(self, job: FakeJob, box: PooledBox | None, path: str) -> Path:
        assert job.rootfs is not None
        clean = posixpath.normpath("/" + path.lstrip("/"))
        return job.rootfs.host(box.home + clean if box is not None else clean)

    async def _sandbox_route(
        self, request: web.Request, job: FakeJob, box: PooledBox | None, parts: list[str]
    ) -> web.StreamResponse:
        route, method, query = "/".join(parts), request.method, request.query
        if route == "exec" and method == "POST":
            return await self._exec(request, job, box, await request.json())
        if route.startswith("files/"):
            target = self._host_path(job, box, query.get("path", ""))
            if route == "files/write" and method == "PUT":
                data = await request.read()
                target.parent.mkdir(parents=True, exist_ok=True)
                offset = int(query.get("offset", 0))
                with open(target, "r+b" if target.exists() and offset else "wb") as handle:
                    handle.seek(offset)
                    handle.write(data)
                    if "truncate_to" in query:
                        handle.truncate(int(query["truncate_to"]))
                if box is not None:
                    os.chown(target, box.uid, box.uid)
                return web.json_response({"path": query["path"], "size": target.stat().st_size})
            if not target.exists():
                return _error(404, f"{query.get('path')}: no such file or directory")
            if route == "files/stat" and method == "GET":
                stat = target.stat()
                kind = "dir" if target.is_dir() else "file"
                return web.json_response({"name": target.name, "path": query["path"], "type": kind,
                                          "size": stat.st_size, "mtime_ms": int(stat.st_mtime * 1000),
                                          "mode": oct(stat.st_mode & 0o7777)})  # fmt: skip
            if route == "files/read" and method == "GET":
                offset, length = int(query.get("offset", 0)), query.get("length")
                with open(target, "rb") as handle:
                    handle.seek(offset)
                    data = handle.read(int(length)) if length is not None else handle.read()
                return web.Response(body=data, content_type="application/octet-stream")
        return self._unknown(request)

    async def _exec(
        self, request: web.Request, job: FakeJob, box: PooledBox | None, payload: dict[str, Any]
    ) -> web.StreamResponse:
        assert job.rootfs is not None and job.rootfs.namespace is not None
        cmd = payload["cmd"]
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        env = {**job.env, "HOME": "/root"}
        cwd = payload.get("cwd") or "/root"
        if box is not None:
            env |= {**box.env, "HOME": box.home, "USER": f"sbx-{box.uid}"}
            cwd = payload.get("cwd") or box.home
            argv = ["setpriv", f"--reuid={box.uid}", f"--regid={box.uid}", "--clear-groups", *argv]
        env |= {k: str(v) for k, v in (payload.get("env") or {}).items()}
        began = time.monotonic()
        spawned = await spawn(job.rootfs.namespace.enter_argv(argv, cwd=cwd), env=env, new_session=True)
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        lock = asyncio.Lock()

        async def send(event: dict[str, Any]) -> None:
            async with lock:
                with suppress(ConnectionError):
                    await response.write((json.dumps(event) + "\n").encode())

        async def pump(stream: asyncio.StreamReader | None, name: str) -> None:
            assert stream is not None
            while chunk := await stream.read(1 << 16):
                await send({"event": name, "data": chunk.decode(errors="replace")})

        pumps = [asyncio.ensure_future(pump(spawned.process.stdout, "stdout")),
                 asyncio.ensure_future(pump(spawned.process.stderr, "stderr"))]  # fmt: skip
        timed_out = False
        try:
            await asyncio.wait_for(asyncio.shield(spawned.exited), payload.get("timeout"))
        except TimeoutError:  # the server kills the command's whole process group
            timed_out = True
            with suppress(ProcessLookupError):
                os.killpg(spawned.process.pid, signal.SIGKILL)
            await spawned.exited
        await asyncio.wait(pumps, timeout=0.5)  # the exit, not the end of pipes a background child holds
        for task in pumps:
            task.cancel()
        spawned.close_pipes()
        code = None if timed_out else exit_status(spawned.returncode or 0)
        duration = int((time.monotonic() - began) * 1000)
        await send({"event": "exit", "exit_code": code, "timed_out": timed_out, "duration_ms": duration})
        with suppress(ConnectionError):
            await response.write_eof()
        return response


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)
