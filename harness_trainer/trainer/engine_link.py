"""The trainer's side of the inference engine: the client it pushes weights through, built from the config
(one engine, or an :class:`~harness_trainer.engines.EngineReplicas` over several), and a weight push with
its pause, retries and resume.

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
from harness_trainer.engines.kinds import client_kind, kind_of
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
        ValueError: adapter pushes to replicas, or a replica of another kind than ``args.engine``.
    """
    assert args.vllm_server_base_url is not None
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
            kind.name, url, timeout=args.weight_sync_timeout,
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
