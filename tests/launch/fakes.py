"""Fakes of an engine (vLLM or dev engine) and a rollout server over real HTTP on loopback, for preflight.

Each runs an aiohttp app on its own event loop in a daemon thread, so the launcher's synchronous httpx
client meets a real server. The engine's chat reply is vLLM 0.32's own (``tests/fixtures/vllm_cpu``), cut
to one token; ``reply_edit`` changes it to break one promise at a time. Both record every request as
``"METHOD /path"`` in ``requests``.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from harness_trainer.net import free_port

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_cpu"
MODEL = "tiny"


def vllm_reply() -> dict[str, Any]:
    """vLLM 0.32's answer to a non-streaming chat with logprobs and token ids, cut to one sampled token."""
    reply = json.loads((FIXTURES / "chat_nonstream.json").read_text())
    choice = reply["choices"][0]
    choice["token_ids"] = choice["token_ids"][:1]
    choice["logprobs"]["content"] = choice["logprobs"]["content"][:1]
    return reply


GOOD_SERVER_INFO = {
    "vllm_config": {
        "model_config": {"logprobs_mode": "processed_logprobs"},
        "weight_transfer_config": {"backend": "nccl"},
    }
}


@dataclass
class FakeEngine:
    """A vLLM (``kind="vllm"``) or dev engine (``kind="dev"``, which adds ``GET /weight_version``)."""

    kind: str = "vllm"
    reply_edit: Callable[[dict[str, Any]], None] | None = None
    chat_status: int = 200
    server_info: dict[str, Any] | None = field(default_factory=lambda: copy.deepcopy(GOOD_SERVER_INFO))
    """None: ``/server_info`` answers 404, as vLLM without ``VLLM_SERVER_DEV_MODE``."""
    requests: list[str] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_recorder(self.requests)])
        app.router.add_get("/health", _answer({}))
        app.router.add_get(
            "/v1/models", _answer({"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        )
        app.router.add_post("/v1/chat/completions", self.chat)
        if self.kind == "dev":
            app.router.add_get("/weight_version", _answer({"weight_version": 0}))
        elif self.server_info is not None:
            app.router.add_get("/server_info", _answer(self.server_info))
        return app

    async def chat(self, request: web.Request) -> web.Response:
        if self.chat_status != 200:
            error = {"message": '"auto" tool choice requires --enable-auto-tool-choice', "code": 400}
            return web.json_response({"error": error}, status=self.chat_status)
        reply = vllm_reply()
        if self.reply_edit is not None:
            self.reply_edit(reply)
        return web.json_response(reply)


@dataclass
class FakeRolloutServer:
    """``harness-trainer serve``'s read-only routes: ``/health`` and the task list; sessions are recorded."""

    max_concurrent_envs: int | None = 3
    sessions: int = 0
    model: str = MODEL
    tasks: list[str] = field(default_factory=lambda: ["add-slugify", "count-lines", "hello-file"])
    requests: list[str] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_recorder(self.requests)])
        app.router.add_get("/health", self.health)
        app.router.add_get("/splits/{split}/tasks", self.split_tasks)
        app.router.add_post("/sessions", _answer({"session_id": "x"}, status=201))
        return app

    async def health(self, request: web.Request) -> web.Response:
        body: dict[str, Any] = {"status": "ok", "sessions": self.sessions, "model": self.model}
        if self.max_concurrent_envs is not None:
            body["max_concurrent_envs"] = self.max_concurrent_envs
        return web.json_response(body)

    async def split_tasks(self, request: web.Request) -> web.Response:
        if request.match_info["split"] != "train":
            error = {"message": "no split 'nope'; splits: ['test', 'train']", "code": 404}
            return web.json_response({"error": error}, status=404)
        listed = [{"index": i, "name": name, "instruction": name} for i, name in enumerate(self.tasks)]
        return web.json_response({"tasks": listed})


def _answer(body: dict[str, Any], status: int = 200) -> Any:
    async def handler(request: web.Request) -> web.Response:
        return web.json_response(body, status=status)

    return handler


def _recorder(requests: list[str]) -> Any:
    @web.middleware
    async def record(request: web.Request, handler: Any) -> web.StreamResponse:
        requests.append(f"{request.method} {request.path}")
        return await handler(request)

    return record


@contextmanager
def serving(app: web.Application) -> Iterator[str]:
    """Serve ``app`` on a free loopback port in a daemon thread; yields its URL; stops it on exit."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    port = free_port()
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, name="fake-http", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
