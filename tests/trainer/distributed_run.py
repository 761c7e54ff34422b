"""A training run for the distributed test, launched on every rank by ``torchrun``.

``torchrun --standalone --nproc_per_node 2 -m tests.trainer.distributed_run MODEL_DIR OUTPUT_DIR`` (with
``ACCELERATE_USE_CPU=true`` on a CPU host: gloo). Three phases with hand-made sessions, each pushing its
weights to a :class:`RecordingEngine` every step: train :data:`FIRST_STEPS` steps into ``OUTPUT_DIR/full``;
resume from its latest checkpoint to :data:`TOTAL_STEPS`; train a LoRA adapter for :data:`FIRST_STEPS`
steps into ``OUTPUT_DIR/lora``. Each rank writes ``OUTPUT_DIR/rank{R}.json`` (factories built, sessions
created / closed / live, steps, the last loss, the versions pushed and whether the last push held the final
weights) and each phase's final weights to ``OUTPUT_DIR/{full,lora}-rank{R}.safetensors``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from harness_trainer import AsyncGRPOConfig, HarnessAsyncGRPOTrainer
from harness_trainer.trainer.policy import engine_weights
from tests.trainer.handmade import HandmadeFactory

FIRST_STEPS = 2
TOTAL_STEPS = 3


def run_config(output_dir: str | Path, **overrides: Any) -> AsyncGRPOConfig:
    """The run both the two processes and the single-process reference train.

    Five rollouts of one row each per step and a budget of one row per micro-batch: five micro-batches,
    so two ranks get three each, one of them padding.
    """
    settings: dict[str, Any] = dict(
        output_dir=str(output_dir), engine="none", num_generations=5, max_concurrent_rollouts=5,
        max_steps=TOTAL_STEPS, save_steps=1, learning_rate=1e-4, disable_tqdm=True, seed=0, token_budget=16,
    )  # fmt: skip
    settings.update(overrides)
    return AsyncGRPOConfig(**settings)


def trained_alone(model_dir: str | Path, output_dir: Path) -> HarnessAsyncGRPOTrainer:
    """The single-process reference: :func:`run_config`'s run in one process, trained to its end. Checks that
    training moved the weights by more than 1e-4, far over the tolerances the comparisons use."""
    from transformers import AutoModelForCausalLM

    single = HarnessAsyncGRPOTrainer(
        str(model_dir), lambda sampling: HandmadeFactory(sampling=sampling), run_config(output_dir)
    )
    single.train()
    initial = dict(AutoModelForCausalLM.from_pretrained(model_dir).named_parameters())
    assert single.model is not None
    moved = max((p.detach() - initial[n]).abs().max().item() for n, p in single.model.named_parameters())
    assert moved > 1e-4
    return single


class RecordingEngine:
    """An engine that takes every push and keeps the versions and the last weights."""

    base_url = "http://127.0.0.1:9"

    def __init__(self) -> None:
        self.versions: list[int] = []
        self.last: dict[str, torch.Tensor] = {}

    async def pause(self) -> None:
        return None

    async def resume(self) -> None:
        return None

    async def push_weights(self, weights: dict[str, torch.Tensor], version: int) -> int:
        self.versions.append(version)
        self.last = {name: tensor.clone() for name, tensor in weights.items()}
        return version

    async def served_version(self) -> int | None:
        return self.versions[-1] if self.versions else None


def main(model_dir: str, output_dir: str) -> None:
    out = Path(output_dir)
    factories: list[HandmadeFactory] = []
    engine = RecordingEngine()

    def build(sampling: dict[str, Any] | None = None) -> HandmadeFactory:
        factories.append(HandmadeFactory(sampling=sampling))
        return factories[-1]

    def phase(directory: Path, **overrides: Any) -> HarnessAsyncGRPOTrainer:
        trainer = HarnessAsyncGRPOTrainer(model_dir, build, run_config(directory, **overrides), engine=engine)
        trainer.train()
        return trainer

    first = phase(out / "full", max_steps=FIRST_STEPS)
    resumed = phase(out / "full", resume_from_checkpoint="latest")
    pushed_final = bool(engine.last) and all(
        torch.equal(engine.last[name], tensor) for name, tensor in engine_weights(resumed.model).items()
    )
    lora = phase(out / "lora", max_steps=FIRST_STEPS, use_peft=True, learning_rate=1e-3)
    rank = resumed.collective.rank
    summary = {
        "factories": len(factories),
        "created": sum(len(f.created) for f in factories),
        "closed": sum(f.closed for f in factories),
        "live": sum(len(f.live) for f in factories),
        "steps": [first.state.step, resumed.state.step, lora.state.step],
        "loss": resumed.last_metrics.get("loss"),
        "pushed": engine.versions,
        "pushed_final": pushed_final,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(summary))
    for name, trainer in (("full", resumed), ("lora", lora)):
        assert trainer.model is not None
        # Cloned: the tied embeddings share storage, which safetensors refuses.
        weights = {key: tensor.detach().clone() for key, tensor in trainer.model.state_dict().items()}
        save_file(weights, str(out / f"{name}-rank{rank}.safetensors"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
