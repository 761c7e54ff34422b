"""What the trainer needs from an inference engine, and the engines that provide it.

``InferenceEngine`` is the contract (DESIGN.md § Engine); ``ENGINES`` maps a kind to its client class and
``make_engine`` builds one. ``dev`` is the CPU dev engine (weights in the HTTP body); ``vllm`` is vLLM's
control routes with weights over a :class:`~harness_trainer.engines.nccl.WeightTransport`.
"""

from __future__ import annotations

from typing import Any

from harness_trainer.engines.base import EngineUnavailable, InferenceEngine, RetryPolicy
from harness_trainer.engines.dev import DevEngine
from harness_trainer.engines.nccl import NcclTransport, WeightTransport, WeightTransportError
from harness_trainer.engines.vllm import VLLMEngine

ENGINES: dict[str, type] = {"dev": DevEngine, "vllm": VLLMEngine}


def make_engine(kind: str, base_url: str, **kwargs: Any) -> InferenceEngine:
    """The ``kind`` engine client for ``base_url``; ``kwargs`` go to its constructor.

    Raises:
        ValueError: ``kind`` is not a key of ``ENGINES``.
    """
    try:
        engine_class = ENGINES[kind]
    except KeyError:
        raise ValueError(f"unknown engine kind {kind!r}; known kinds: {', '.join(sorted(ENGINES))}") from None
    return engine_class(base_url, **kwargs)


__all__ = [
    "ENGINES",
    "DevEngine",
    "EngineUnavailable",
    "InferenceEngine",
    "NcclTransport",
    "RetryPolicy",
    "VLLMEngine",
    "WeightTransport",
    "WeightTransportError",
    "make_engine",
]
