"""Weight control for the trainer: pause, resume, and versioned weight updates.

``POST /pause`` (mode ``wait``: stop starting generations, return once the one in flight finished),
``POST /resume``, ``GET /is_paused``, ``GET /weight_version``, ``POST /update_weights`` (see
:mod:`harness_trainer.dev_engine.weights` for the body). Updates run as worker jobs, after every
generation queued before them, so in-flight requests finish on the weights that started them.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from harness_trainer.dev_engine.protocol import EngineError
from harness_trainer.dev_engine.state import STATE
from harness_trainer.dev_engine.weights import read_weight_update
from harness_trainer.dev_engine.worker import Job, WeightUpdateError, event_emitter


async def pause(request: web.Request) -> web.Response:
    mode = request.query.get("mode", "wait")
    if mode != "wait":
        raise EngineError(400, f"pause mode {mode!r} is not supported: the dev engine drains (mode=wait)")
    await asyncio.to_thread(request.app[STATE].worker.pause)
    return web.json_response({"status": "paused"})


async def resume(request: web.Request) -> web.Response:
    request.app[STATE].worker.resume()
    return web.json_response({"status": "resumed"})


async def is_paused(request: web.Request) -> web.Response:
    return web.json_response({"is_paused": request.app[STATE].worker.paused})


async def weight_version(request: web.Request) -> web.Response:
    return web.json_response({"weight_version": request.app[STATE].worker.weight_version})


async def update_weights(request: web.Request) -> web.Response:
    state = request.app[STATE]
    tensors, version = await read_weight_update(request)
    queue: asyncio.Queue = asyncio.Queue()
    try:
        state.worker.check_weights(tensors, version)
        state.worker.submit(
            Job(
                run=lambda job: state.worker.load_weights(tensors, version),
                emit=event_emitter(asyncio.get_running_loop(), queue),
                is_generation=False,
            )
        )
        kind, payload = await queue.get()
        if kind == "error":
            raise payload
    except WeightUpdateError as exc:
        raise EngineError(exc.status, str(exc)) from exc
    return web.json_response({"weight_version": payload, "tensors": len(tensors)})


def add_control_routes(app: web.Application) -> None:
    app.router.add_post("/pause", pause)
    app.router.add_post("/resume", resume)
    app.router.add_get("/is_paused", is_paused)
    app.router.add_get("/weight_version", weight_version)
    app.router.add_post("/update_weights", update_weights)
