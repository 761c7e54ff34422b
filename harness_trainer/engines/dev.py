"""The dev engine seen from the trainer: an ``InferenceEngine`` over its HTTP control routes.

Weights travel in the request body as a safetensors state dict (``safetensors.torch.save``), or as a path
when trainer and engine share a disk (``push_weights_file``). A call that cannot connect is retried per the
client's :class:`~harness_trainer.engines.base.RetryPolicy`, then raises ``EngineUnavailable``.
:meth:`DevEngine.served_version` reads ``GET /weight_version``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import httpx
import torch

from harness_trainer.engines.base import (
    EngineUnavailable,
    MalformedReply,
    RetryPolicy,
    answers_health,
    retry_unreachable,
)


class DevEngine:
    """Client for ``harness-trainer engine`` at ``base_url`` (e.g. ``http://127.0.0.1:8000``)."""

    def __init__(self, base_url: str, timeout: float = 300.0, *, retry: RetryPolicy | None = None) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self._timeout = timeout
        self._retry = retry or RetryPolicy()

    async def _post(self, path: str, **kwargs) -> dict:
        return await self._call("POST", path, **kwargs)

    async def _call(self, method: str, path: str, **kwargs) -> dict:
        async def send() -> httpx.Response:
            async with httpx.AsyncClient(base_url=self.base_url, timeout=self._timeout) as client:
                return await client.request(method, path, **kwargs)

        try:
            reply = await retry_unreachable(send, self._retry, f"dev engine {self.base_url}{path}")
        except httpx.TransportError as exc:
            raise EngineUnavailable(f"dev engine at {self.base_url} failed on {path}: {exc!r}") from exc
        if reply.status_code != 200:
            raise EngineUnavailable(f"dev engine refused {path} ({reply.status_code}): {reply.text}")
        try:
            return reply.json()
        except ValueError as exc:
            raise MalformedReply(
                f"dev engine {self.base_url}{path} answered no JSON: {reply.text[:200]!r}"
            ) from exc

    async def pause(self) -> None:
        await self._post("/pause", params={"mode": "wait"})

    async def resume(self) -> None:
        await self._post("/resume")

    async def push_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> int:
        from safetensors.torch import save

        payload = save(_unshared(named_tensors))
        reply = await self._post(
            "/update_weights",
            params={"version": version},
            content=payload,
            headers={"content-type": "application/octet-stream"},
        )
        return int(reply["weight_version"])

    async def push_weights_file(self, path: str | Path, version: int) -> int:
        reply = await self._post("/update_weights", json={"path": str(path), "version": version})
        return int(reply["weight_version"])

    async def health(self) -> bool:
        return await answers_health(self.base_url)

    async def served_version(self) -> int | None:
        """``GET /weight_version``: the engine counts from 0 (its start-up weights, reported as None) and
        takes only pushes that advance its version, so any other value is a pushed version."""
        reply = await self._call("GET", "/weight_version")
        version = reply.get("weight_version") if isinstance(reply, dict) else None
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise MalformedReply(f"dev engine {self.base_url}/weight_version answered {reply!r}: no version")
        return version or None


def _unshared(named_tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU tensors safetensors can serialise: a storage already seen (tied weights) is copied, not shared."""
    seen: set[int] = set()
    own: dict[str, torch.Tensor] = {}
    for name, tensor in named_tensors.items():
        tensor = tensor.detach().to("cpu").contiguous()
        storage = tensor.untyped_storage().data_ptr()
        own[name] = tensor.clone() if storage in seen else tensor
        seen.add(storage)
    return own
