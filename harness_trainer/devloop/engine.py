"""The local inference engine the dev loop and ``harness-trainer eval`` start on a model folder: the CPU dev
engine, or a real vLLM from its own venv (with the capture flags, the tool parser and dev mode)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from harness_trainer.engines.kinds import kind_of


def start_local_engine(
    kind: str,
    model_dir: Path,
    *,
    seed: int,
    output: IO[bytes],
    vllm_python: Path,
    lora_rank: int | None = None,
    max_loras: int = 1,
    started: Callable[[Any], None] | None = None,
) -> Any:
    """Start engine ``kind`` (``dev`` or ``vllm``) serving ``model_dir`` as ``tiny``, seeded; returns once it
    answers, as an object with ``url`` and ``stop()``. An engine on a python of its own
    (:attr:`~harness_trainer.engines.kinds.EngineKind.own_python`: vLLM) starts from ``vllm_python``.
    ``lora_rank``: vLLM takes adapters up to that rank (``max_loras`` of them at once). ``started`` gets it
    as soon as its process exists.

    Raises:
        ValueError: ``kind`` is no kind of engine.
    """
    if kind_of(kind).own_python:
        from harness_trainer.engines.vllm_process import serve_env, serve_flags, start_vllm

        flags = serve_flags(served_model_name="tiny", lora_rank=lora_rank, max_loras=max_loras)
        return start_vllm(
            model_dir, [*flags, "--seed", str(seed)], python=vllm_python,
            env=serve_env(lora=lora_rank is not None), output=output, started=started,
        )  # fmt: skip
    from harness_trainer.dev_engine.process import start_engine

    return start_engine(model_dir, "--seed", str(seed), output=output, own_session=True, started=started)
