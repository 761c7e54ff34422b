"""The engine kinds a run can name, each with its facts, and the ways weights can reach an engine: torch-free.

Each kind's facts are one :class:`EngineKind` in :data:`ENGINE_KIND_FACTS`; the trainer, its config, the
dev loop and the launchers ask them (:func:`kind_of`, :func:`syncs_adapters`), so no other module compares
an engine's name to a string, and a new kind is one entry here plus its client. The engine clients the
facts name (:mod:`.vllm`, :mod:`.dev`) sit beside this module and load only when asked for
(:meth:`EngineKind.client_class`): config never imports torch to check a value.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineKind:
    """What the trainer, the dev loop and the launchers need to know about one kind of inference engine."""

    name: str
    client: str
    """The client class, as ``module:Class`` (loaded by :meth:`client_class`, so this module stays light)."""
    adapter_sync: bool
    """It serves LoRA adapters by name, one loaded per version, so a LoRA run with ``lora_sync='adapter'``
    publishes the adapter alone (else the merged weights travel whole)."""
    weights_out_of_band: bool
    """Full weights reach it beside the control call, by a ``weight_sync`` path (NCCL, or a file on a shared
    disk; :data:`WEIGHT_SYNCS`), which its client takes and preflight checks it can serve; else they travel
    in the push call itself."""
    answers_weight_version: bool
    """It answers ``GET /weight_version`` with ``{"weight_version": ...}`` (the dev engine's own route):
    how ``engine='auto'`` tells the kinds apart."""
    own_python: bool
    """It runs on a python of its own (vLLM's venv: :func:`~harness_trainer.engines.vllm_process.vllm_python`,
    checked by :func:`~harness_trainer.engines.vllm_process.check_vllm_python`), and the dev loop starts it
    from there with vLLM's serve flags; else it runs on the trainer's interpreter
    (``python -m harness_trainer.dev_engine``)."""

    def client_class(self) -> type[Any]:
        """The client class :attr:`client` names (importing it loads torch)."""
        module, _, name = self.client.partition(":")
        return getattr(importlib.import_module(module), name)


ENGINE_KIND_FACTS: dict[str, EngineKind] = {
    "vllm": EngineKind(
        name="vllm",
        client="harness_trainer.engines.vllm:VLLMEngine",
        adapter_sync=True,
        weights_out_of_band=True,
        answers_weight_version=False,
        own_python=True,
    ),
    "dev": EngineKind(
        name="dev",
        client="harness_trainer.engines.dev:DevEngine",
        adapter_sync=False,
        weights_out_of_band=False,
        answers_weight_version=True,
        own_python=False,
    ),
}
"""The engine kinds by name: vLLM (control routes, weights by NCCL or a file) and the CPU dev engine
(weights in the HTTP body)."""

ENGINE_KINDS = ("auto", *ENGINE_KIND_FACTS, "none")
"""What a run's ``engine`` may be: a kind, ``auto`` (told by asking the engine), or ``none`` (no engine to
push weights to)."""
WEIGHT_SYNCS = ("auto", "nccl", "file")
"""How weights reach vLLM: NCCL from the trainer's GPU, or a safetensors file on a shared disk."""
PAUSE_MODES = ("wait", "keep")
"""How a weight push pauses vLLM, by the modes of its ``POST /pause`` (its third, ``abort``, would lose the
agents' calls): drain the generations in flight, or freeze them until the resume."""
PLAIN_KIND = next(name for name, kind in ENGINE_KIND_FACTS.items() if not kind.weights_out_of_band)
"""The kind whose weights travel in the push call itself (the dev engine): what a client of no registered
class is taken for."""


def kind_of(name: str) -> EngineKind:
    """The facts of engine kind ``name``.

    Raises:
        ValueError: ``name`` is no kind of engine (``auto`` and ``none`` are none).
    """
    try:
        return ENGINE_KIND_FACTS[name]
    except KeyError:
        known = ", ".join(sorted(ENGINE_KIND_FACTS))
        raise ValueError(f"unknown engine kind {name!r}; known kinds: {known}") from None


def syncs_adapters(engine: str) -> bool:
    """Whether the run's ``engine`` takes LoRA adapters by name (:attr:`EngineKind.adapter_sync`); False for
    ``auto`` (its kind is not told yet) and ``none``."""
    kind = ENGINE_KIND_FACTS.get(engine)
    return kind is not None and kind.adapter_sync


def client_kind(client: object) -> str:
    """The kind whose client class ``client`` is; any other client (a test's stand-in, one's own engine) is
    taken to receive weights in the push call, as :data:`PLAIN_KIND` does."""
    for name, kind in ENGINE_KIND_FACTS.items():
        if isinstance(client, kind.client_class()):
            return name
    return PLAIN_KIND
