"""The trainer-side engine contract: where to send requests, and how to pause, update and probe it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import torch


class EngineUnavailable(RuntimeError):
    """The engine cannot be reached, or refused a control call."""


@runtime_checkable
class InferenceEngine(Protocol):
    """What the trainer needs from an engine (vLLM on GPUs, the dev engine on CPU)."""

    base_url: str

    async def pause(self) -> None:
        """Stop starting generations; return once those in flight have finished."""

    async def resume(self) -> None:
        """Start generating again."""

    async def push_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> int:
        """Load (a subset of) the policy's weights as ``version``; return the version now served."""

    async def health(self) -> bool:
        """Whether the engine answers its health check."""
