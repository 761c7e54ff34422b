"""What the trainer needs from an inference engine, and the engines that provide it.

``InferenceEngine`` is the contract (docs/design.md § Engine); each kind's facts are an
:class:`~harness_trainer.engines.kinds.EngineKind` in ``ENGINE_KIND_FACTS`` (:mod:`.kinds`, torch-free);
``ENGINES`` maps a kind to its client class and ``make_engine`` builds one. ``dev`` is the CPU dev engine
(weights in the HTTP body); ``vllm`` is vLLM's control routes with weights over a
:class:`~harness_trainer.engines.nccl.WeightTransport` (NCCL) or through vLLM's in-place reload from a file
(:mod:`harness_trainer.engines.weight_sync`).
:class:`~harness_trainer.engines.replicas.EngineReplicas` is one engine over several replicas of one kind.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harness_trainer.engines.base import InferenceEngine

# Names load on first use: the torch-free kinds (:mod:`.kinds`) are read by the trainer's config, and
# importing this package must not pull torch in behind them.
_EXPORTS = {
    "EngineUnavailable": "harness_trainer.engines.base",
    "InferenceEngine": "harness_trainer.engines.base",
    "MalformedReply": "harness_trainer.engines.base",
    "PushRefused": "harness_trainer.engines.base",
    "RetryPolicy": "harness_trainer.engines.base",
    "DevEngine": "harness_trainer.engines.dev",
    "NcclTransport": "harness_trainer.engines.nccl",
    "WeightTransport": "harness_trainer.engines.nccl",
    "WeightTransportError": "harness_trainer.engines.nccl",
    "EngineReplicas": "harness_trainer.engines.replicas",
    "VLLMEngine": "harness_trainer.engines.vllm",
    "WEIGHT_SYNCS": "harness_trainer.engines.kinds",
    "FileWeightSync": "harness_trainer.engines.weight_sync",
    "choose_weight_sync": "harness_trainer.engines.weight_sync",
}


def __getattr__(name: str) -> Any:
    if name == "ENGINES":
        from harness_trainer.engines.kinds import ENGINE_KIND_FACTS

        return {kind: facts.client_class() for kind, facts in ENGINE_KIND_FACTS.items()}
    if name not in _EXPORTS:
        raise AttributeError(f"module 'harness_trainer.engines' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def detect_engine_kind(base_url: str, timeout_s: float = 30.0) -> str:
    """The kind of the engine at ``base_url``: the one that answers ``GET /weight_version`` (the dev
    engine's route, :attr:`~harness_trainer.engines.kinds.EngineKind.answers_weight_version`) when it does,
    else the one that does not (vLLM).

    Raises:
        EngineUnavailable: nothing answers at ``base_url``.
    """
    import httpx

    from harness_trainer.engines.base import EngineUnavailable
    from harness_trainer.engines.kinds import ENGINE_KIND_FACTS

    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        reply = httpx.get(root + "/weight_version", timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise EngineUnavailable(f"no engine answers at {root} (to tell its kind): {exc!r}") from exc
    try:
        answers = reply.status_code == 200 and "weight_version" in reply.json()
    except ValueError:
        answers = False
    return next(kind for kind, facts in ENGINE_KIND_FACTS.items() if facts.answers_weight_version == answers)


def make_engine(kind: str, base_url: str, **kwargs: Any) -> InferenceEngine:
    """The ``kind`` engine client for ``base_url``; ``kwargs`` go to its constructor.

    Raises:
        ValueError: ``kind`` is not a key of ``ENGINES``.
    """
    from harness_trainer.engines.kinds import kind_of

    return kind_of(kind).client_class()(base_url, **kwargs)


__all__ = [
    "ENGINES",
    "WEIGHT_SYNCS",
    "DevEngine",
    "EngineReplicas",
    "EngineUnavailable",
    "FileWeightSync",
    "InferenceEngine",
    "MalformedReply",
    "NcclTransport",
    "PushRefused",
    "RetryPolicy",
    "VLLMEngine",
    "WeightTransport",
    "WeightTransportError",
    "choose_weight_sync",
    "detect_engine_kind",
    "make_engine",
]
