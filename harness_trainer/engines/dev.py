"""The dev engine seen from the trainer: an ``InferenceEngine`` over its HTTP control routes.

Weights travel in the request body as a safetensors state dict (``safetensors.torch.save``), or as a path
when trainer and engine share a disk (``push_weights_file``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import httpx
import torch

from harness_trainer.engines.base import EngineUnavailable


class DevEngine:
    """Client for ``harness-trainer engine`` at ``base_url`` (e.g. ``http://127.0.0.1:8000``)."""

    def __init__(self, base_url: str, timeout: float = 300.0) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self._timeout = timeout

    async def _post(self, path: str, **kwargs) -> dict:
        try:
            async with httpx.AsyncClient(base_url=self.base_url, timeout=self._timeout) as client:
                reply = await client.post(path, **kwargs)
        except httpx.TransportError as exc:
            raise EngineUnavailable(f"dev engine at {self.base_url} unreachable: {exc}") from exc
        if reply.status_code != 200:
            raise EngineUnavailable(f"dev engine refused {path} ({reply.status_code}): {reply.text}")
        return reply.json()

    async def pause(self) -> None:
        await self._post("/pause", params={"mode": "wait"})

    async def resume(self) -> None:
        await self._post("/resume")

    async def push_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> int:
        from safetensors.torch import save

        payload = save({name: t.detach().to("cpu").contiguous() for name, t in named_tensors.items()})
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
        try:
            async with httpx.AsyncClient(timeout=10) as client:
                return (await client.get(f"{self.base_url}/health")).status_code == 200
        except httpx.TransportError:
            return False
