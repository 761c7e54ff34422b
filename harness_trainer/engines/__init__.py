"""What the trainer needs from an inference engine, and the engines that provide it.

``InferenceEngine`` is the contract (DESIGN.md § Engine); ``ENGINES`` maps a name to its implementation.
The vLLM implementation (HTTP control endpoints + NCCL weight transfer) lands with the trainer.
"""

from __future__ import annotations

from harness_trainer.engines.base import EngineUnavailable, InferenceEngine
from harness_trainer.engines.dev import DevEngine

ENGINES: dict[str, type] = {"dev": DevEngine}

__all__ = ["ENGINES", "DevEngine", "EngineUnavailable", "InferenceEngine"]
