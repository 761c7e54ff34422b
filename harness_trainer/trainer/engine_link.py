"""The trainer's side of the inference engine: the client it pushes weights through, built from the config
(one engine, or an :class:`~harness_trainer.engines.EngineReplicas` over several) once the folder its
pushes go through is checked for room (:func:`check_weight_room`), and a weight push with its pause,
retries and resume.

Only rank 0 talks to the engine; the trainer decides when to push and what the rollouts are told after.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from harness_trainer.engines import (
    EngineReplicas,
    EngineUnavailable,
    PushRefused,
    detect_engine_kind,
    make_engine,
)
from harness_trainer.engines.kinds import ENGINE_KIND_FACTS, client_kind, kind_of
from harness_trainer.engines.weight_room import (
    adapter_need,
    check_room,
    full_weights_need,
    local_model_folder,
    served_model_root,
    weights_parent,
)
from harness_trainer.trainer.config.async_grpo import AsyncGRPOConfig
from harness_trainer.trainer.config.checks import ADAPTER_ON_REPLICAS

logger = logging.getLogger(__name__)


def engine_kind(engine: Any, url: str | None) -> str:
    """``engine='auto'`` resolved: the given client's kind, else the kind of the engine at ``url``."""
    if engine is not None:
        return client_kind(engine)
    assert url is not None  # the config refuses an engine kind other than 'none' without a URL
    return detect_engine_kind(url)


def engine_client(args: AsyncGRPOConfig, *, adapter_sync: bool, device: str) -> Any:
    """The engine client: one, or with ``vllm_replica_urls`` an :class:`EngineReplicas` over one client
    per replica (each with its own weight path), draining at ``replica_proxy_url`` when given.
    ``adapter_sync``: only a LoRA adapter travels; ``device``: the policy's (an NCCL push sends from it).

    Raises:
        NoRoomForWeights: the folder the pushes go through has too little room (:func:`check_weight_room`).
        ValueError: adapter pushes to replicas, or a replica of another kind than ``args.engine``.
    """
    assert args.vllm_server_base_url is not None
    if (room := check_weight_room(args, args.engine, adapter_sync=adapter_sync)) is not None:
        logger.warning("%s", room)
    if not args.vllm_replica_urls:
        return _client_at(args, args.vllm_server_base_url, adapter_sync, device)
    if adapter_sync:
        raise ValueError(ADAPTER_ON_REPLICAS)
    from capture_proxy.config import ADMIN_KEY_ENV

    urls = [args.vllm_server_base_url, *args.vllm_replica_urls]
    kinds = {url: detect_engine_kind(url) for url in args.vllm_replica_urls}
    if others := {url: kind for url, kind in kinds.items() if kind != args.engine}:
        raise ValueError(f"every replica must be a {args.engine} engine, as engine says; not: {others}")
    return EngineReplicas(
        [_client_at(args, url, adapter_sync, device) for url in urls], proxy_url=args.replica_proxy_url,
        admin_key=os.environ.get(ADMIN_KEY_ENV) or None, proxy_timeout_s=args.weight_sync_timeout,
    )  # fmt: skip


def _client_at(args: AsyncGRPOConfig, url: str, adapter_sync: bool, device: str) -> Any:
    kind = kind_of(args.engine)
    if kind.adapter_sync and adapter_sync:
        # Only the adapter travels; vLLM keeps the versions a rollout may still be finishing on.
        return make_engine(
            kind.name, url, timeout=args.weight_sync_timeout, lora=True,
            keep_adapters=args.max_staleness + 1, weight_sync_timeout=args.weight_sync_timeout,
        )  # fmt: skip
    if kind.weights_out_of_band:
        # A merged LoRA (or the full model) travels whole: vLLM serves one model name throughout.
        return make_engine(
            kind.name, url, timeout=args.weight_sync_timeout, pause_mode=args.vllm_pause_mode,
            weight_sync=weight_sync(args, url, device), weight_sync_timeout=args.weight_sync_timeout,
        )  # fmt: skip
    return make_engine(kind.name, url, timeout=args.weight_sync_timeout)


def weight_sync(args: AsyncGRPOConfig, url: str, device: str) -> Any:
    """How full weights reach the vLLM at ``url`` (``args.weight_sync``, ``auto`` resolved by where it
    runs), logged: files on this host, or NCCL from ``device``."""
    from harness_trainer.engines import FileWeightSync, NcclTransport, choose_weight_sync

    path = choose_weight_sync(args.weight_sync, url)
    logger.warning(
        "weight sync to vLLM at %s: %s%s", url, path,
        " (auto: vLLM is on this host)" if args.weight_sync == "auto" and path == "file"
        else " (auto: vLLM is on another host)" if args.weight_sync == "auto" else "",
    )  # fmt: skip
    if path == "file":
        return FileWeightSync(args.weight_sync_dir)
    return NcclTransport(device)


def check_weight_room(
    args: AsyncGRPOConfig, kind: str, *, adapter_sync: bool, model: str | None = None
) -> str | None:
    """Check, before anything is pushed, that the folder the run's pushes to an engine of ``kind`` go
    through (:func:`~harness_trainer.engines.weight_room.weights_parent` of ``weight_sync_dir``, as they
    make it) has room for them: with ``adapter_sync`` the adapter folders (``max_staleness + 1`` kept and
    the next), else two full-weight versions per vLLM reached by the ``file`` path. Sized from ``model``
    (what the trainer loads: a folder, or a hub id in the cache), else from what vLLM at
    ``vllm_server_base_url`` serves (its ``/v1/models`` root), in the dtype the trainer loads it in.

    Returns what was checked, on one line; None when no push goes through a folder (the dev engine, or
    NCCL to every vLLM).

    Raises:
        NoRoomForWeights: the folder has less free space than the pushes need (the message says how much,
            how that was computed and what to do).
    """
    facts = ENGINE_KIND_FACTS.get(kind)
    if facts is None:  # 'none': nothing is pushed
        return None
    adapters, by_file = facts.adapter_sync and adapter_sync, []
    if not adapters and facts.weights_out_of_band:
        from harness_trainer.engines import choose_weight_sync

        urls = [url for url in (args.vllm_server_base_url, *args.vllm_replica_urls) if url]
        by_file = [url for url in urls if choose_weight_sync(args.weight_sync, url) == "file"]
    if not adapters and not by_file:
        return None
    folder = weights_parent(args.weight_sync_dir)
    source = local_model_folder(model) if model else None
    if source is None and args.vllm_server_base_url:
        root = served_model_root(args.vllm_server_base_url)
        source = local_model_folder(root) if root else None
    if source is None:
        which = f"neither {model!r} nor the model vLLM serves is" if model else "the model vLLM serves is not"
        return (
            f"room in {folder} for the weight pushes not checked: {which} a local folder of safetensors or "
            "complete in the Hugging Face cache"
        )
    if adapters:
        need = adapter_need(
            source, args.lora_r, args.lora_target_modules, folders=args.max_staleness + 2, folder=folder
        )
    else:
        need = full_weights_need(
            source, _loaded_dtype(args), versions=2 * len(by_file), folder=folder,
            remedies=_others(args, facts.adapter_sync),
        )  # fmt: skip
    return check_room(need)


def _loaded_dtype(args: AsyncGRPOConfig) -> str:
    """The dtype the trainer loads the policy in, as ``load_policy`` asks ``from_pretrained`` for it: a
    ``dtype`` in ``model_init_kwargs``, else ``args.dtype``, else their ``torch_dtype``, else ``"auto"``."""
    kwargs = dict(args.model_init_kwargs) if isinstance(args.model_init_kwargs, dict) else {}
    if args.dtype != "auto":
        kwargs.setdefault("dtype", args.dtype)
    return str(kwargs.get("dtype") or kwargs.get("torch_dtype") or "auto")


def _others(args: AsyncGRPOConfig, serves_adapters: bool) -> list[str]:
    """The ways around the ``file`` path's files that this run could take."""
    others = [
        """--weight-sync nccl with the trainer and vLLM on different GPUs (vLLM started with """
        """--weight-transfer-config '{"backend": "nccl"}'), which writes no file"""
    ]
    if args.use_peft and args.lora_sync == "merged" and serves_adapters:
        others.append("--lora-sync adapter, which writes the LoRA adapter alone")
    return others


def push_with_retries(
    engine: Any, weights: dict[str, torch.Tensor] | Path, version: int, retries: int
) -> tuple[int | None, Exception | None]:
    """Push ``weights`` (the tensors, or an adapter's folder) as ``version``, up to ``retries`` times with
    backoff: the version the engine serves after it, or None and the last error."""
    error: Exception | None = None
    for attempt in range(retries):
        try:
            return asyncio.run(_pause_push_resume(engine, weights, version)), None
        except EngineUnavailable as exc:
            error = exc
            logger.warning("weight push %d/%d failed: %s", attempt + 1, retries, exc)
            time.sleep(min(2.0**attempt, 10.0))
    return None, error


async def _pause_push_resume(engine: Any, weights: dict[str, torch.Tensor] | Path, version: int) -> int:
    # A failed push leaves the engine paused: better idle than sampling from half-updated weights; the
    # retry (or the run's stop) follows. A push the engine refused or rolled back left the old weights
    # whole, so it samples again meanwhile. What needs no pause (the file path's write) is done before it.
    if isinstance(weights, Path):  # an adapter's folder
        await engine.pause()
        served = await engine.push_adapter(weights, version)
        await engine.resume()
        return served
    if hasattr(engine, "stage_weights"):
        await engine.stage_weights(weights, version)
    await engine.pause()
    try:
        served = await engine.push_weights(weights, version)
    except PushRefused:
        await engine.resume()
        raise
    await engine.resume()
    return served
