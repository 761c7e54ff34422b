"""Training runs for the FSDP2 tests, launched on every rank by ``torchrun`` with the FSDP2 environment.

``torchrun --standalone --nproc_per_node 2 -m tests.trainer.fsdp2_run MODE MODEL_DIR OUTPUT_DIR`` (with
``ACCELERATE_USE_CPU=true`` and :data:`harness_trainer.jobs.gpus.FSDP2_ENV`: gloo, the trainer's own
FSDP2). Modes:

- ``train``: the phases of :mod:`tests.trainer.distributed_run` (full weights for ``FIRST_STEPS`` steps,
  resumed to ``TOTAL_STEPS``, then LoRA for ``FIRST_STEPS``), each pushing to a :class:`RecordingEngine`
  every step. Each rank writes ``OUTPUT_DIR/rank{R}.json`` (steps, versions pushed, a layer weight's local
  and full rows, the bytes of parameters, gradients and optimizer state it holds); rank 0 writes the last
  weights pushed in each phase (``{full,lora}-pushed.safetensors``) and the gathered final full weights
  (``full-final.safetensors``).
- ``variants``: :func:`tests.trainer.distributed_run.run_config`'s run to its end twice, with gradient
  checkpointing into ``OUTPUT_DIR/checkpointing``, then with a KL reference (:data:`KL`) into
  ``OUTPUT_DIR/kl``: ``FIRST_STEPS`` steps, then resumed from its checkpoint to the end. Each rank writes
  ``OUTPUT_DIR/variants-rank{R}.json`` (the steps of each run, whether large allocations were mapped, and
  for the reference: whether every parameter is a DTensor after training and after a forward, a layer
  weight's local and full rows); rank 0 writes each run's gathered final weights
  (``{checkpointing,kl}-final.safetensors``) and the reference's logprobs of :data:`PROBE`
  (``kl-reference-logprobs.safetensors``).
- ``kill``: train up to :data:`KILL_STEPS` steps (bf16 mixed precision) into ``OUTPUT_DIR/kill``, rank 1
  killing itself with SIGKILL as it starts step :data:`KILLED_AT` (checkpoints 1 to ``KILLED_AT - 1``
  written).
- ``resume``: resume that run from its latest checkpoint to :data:`KILL_STEPS`; rank 0 writes
  ``OUTPUT_DIR/resumed.json`` (the step it resumed from, the steps at the end).
- ``prefix``: a GRPO group's micro-batch forwarded by prefix against the packed forward, both sharded
  (:func:`prefix`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from harness_trainer import HarnessAsyncGRPOTrainer
from harness_trainer.trainer.fsdp2 import gathered_state, local_bytes, map_large_allocations
from tests.trainer.distributed_run import FIRST_STEPS, RecordingEngine, run_config
from tests.trainer.handmade import HandmadeFactory

KILL_STEPS = 4
KILLED_AT = 3
LAYER_WEIGHT = "model.layers.0.mlp.gate_proj.weight"
KL = {"beta": 0.5}
"""The KL run's overrides: a coefficient large enough for the KL term to weigh in the gradient. (A larger
learning rate drives the KL to 3 nats in three steps, where Adam turns float rounding into 1e-4 updates.)"""
PROBE = [[1, 2, 3, 4, 5, 6]]
"""Tokens the reference scores after the KL run."""


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """The bytes of parameters, gradients and optimizer state this rank holds (local shards), the
    gradients filled by one backward pass (collective under FSDP: every rank calls it)."""
    model.zero_grad(set_to_none=True)
    model(torch.tensor([[1, 2, 3, 4]])).logits.float().square().mean().backward()
    params = [p for p in model.parameters()]
    held = {
        "params": local_bytes(params),
        "grads": local_bytes([p.grad for p in params if p.grad is not None]),
        "optimizer": local_bytes([v for s in optimizer.state.values() for v in s.values() if v.dim() > 0]),
    }
    model.zero_grad(set_to_none=True)
    return held


def _clone(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # Cloned: the tied embeddings share storage, which safetensors refuses.
    return {name: tensor.detach().clone().contiguous() for name, tensor in weights.items()}


def train(model_dir: str, out: Path) -> None:
    engine = RecordingEngine()

    def phase(directory: Path, **overrides: Any) -> HarnessAsyncGRPOTrainer:
        config = run_config(directory, **overrides)
        trainer = HarnessAsyncGRPOTrainer(
            model_dir, lambda sampling: HandmadeFactory(sampling=sampling), config, engine=engine
        )
        trainer.train()
        return trainer

    first = phase(out / "full", max_steps=FIRST_STEPS)
    resumed = phase(out / "full", resume_from_checkpoint="latest")
    rank = resumed.collective.rank
    full_pushed = _clone(engine.last)
    final = gathered_state(resumed._trained)  # type: ignore[arg-type]
    layer = dict(resumed.model.named_parameters())[LAYER_WEIGHT]  # type: ignore[union-attr]
    summary: dict[str, Any] = {
        "sharded": type(layer).__name__ == "DTensor",
        "local_rows": layer.to_local().shape[0] if hasattr(layer, "to_local") else layer.shape[0],
        "full_rows": layer.shape[0],
        "held": held_bytes(resumed._trained, resumed.optimizer),  # type: ignore[arg-type]
    }
    lora = phase(out / "lora", max_steps=FIRST_STEPS, use_peft=True, learning_rate=1e-3)
    summary.update(steps=[first.state.step, resumed.state.step, lora.state.step], pushed=engine.versions)
    (out / f"rank{rank}.json").write_text(json.dumps(summary))
    if rank == 0:
        save_file(full_pushed, str(out / "full-pushed.safetensors"))
        save_file(_clone(engine.last), str(out / "lora-pushed.safetensors"))
        save_file(_clone(final), str(out / "full-final.safetensors"))


def handmade(sampling: dict[str, Any] | None) -> HandmadeFactory:
    return HandmadeFactory(sampling=sampling)


def all_dtensors(module: nn.Module) -> bool:
    return all(type(p).__name__ == "DTensor" for p in module.parameters())


@torch.no_grad()
def reference_logprobs(trainer: HarnessAsyncGRPOTrainer) -> torch.Tensor:
    """The log-softmax of the reference's logits for :data:`PROBE` (collective under FSDP2)."""
    assert trainer.reference is not None
    with trainer.reference.model() as reference:
        return torch.log_softmax(reference(torch.tensor(PROBE)).logits.float(), dim=-1)


def variants(model_dir: str, out: Path) -> None:
    def run(name: str, **overrides: Any) -> HarnessAsyncGRPOTrainer:
        trainer = HarnessAsyncGRPOTrainer(model_dir, handmade, run_config(out / name, **overrides))
        trainer.train()
        return trainer

    checkpointing = run("checkpointing", gradient_checkpointing=True)
    checkpointing_final = gathered_state(checkpointing._trained)  # type: ignore[arg-type]
    first = run("kl", max_steps=FIRST_STEPS, **KL)
    kl = run("kl", resume_from_checkpoint="latest", **KL)  # its reference rebuilt from the initial weights
    kl_final = gathered_state(kl._trained)  # type: ignore[arg-type]
    assert kl.reference is not None and kl.reference.copy is not None
    copy = kl.reference.copy
    trained_sharded = all_dtensors(copy)  # after training: every forward was followed by a reshard
    logprobs = reference_logprobs(kl)
    layer = dict(copy.named_parameters())[LAYER_WEIGHT]
    rank = kl.collective.rank
    summary = {
        "steps": [checkpointing.state.step, first.state.step, kl.state.step],
        "checkpointing": bool(getattr(checkpointing.model, "is_gradient_checkpointing", False)),
        "mapped": map_large_allocations(),
        "reference": {
            "sharded_after_training": trained_sharded,
            "sharded_after_forward": all_dtensors(copy),
            "requires_grad": any(p.requires_grad for p in copy.parameters()),
            "local_rows": layer.to_local().shape[0] if hasattr(layer, "to_local") else layer.shape[0],
            "full_rows": layer.shape[0],
        },
    }
    (out / f"variants-rank{rank}.json").write_text(json.dumps(summary))
    if rank == 0:
        save_file(_clone(checkpointing_final), str(out / "checkpointing-final.safetensors"))
        save_file(_clone(kl_final), str(out / "kl-final.safetensors"))
        save_file({"logprobs": logprobs.contiguous()}, str(out / "kl-reference-logprobs.safetensors"))


def kill(model_dir: str, out: Path, resume: bool) -> None:
    # bf16: the mixed precision the trainer's own FSDP2 applies to the forward, end to end.
    resume_from = "latest" if resume else None
    config = run_config(out / "kill", max_steps=KILL_STEPS, resume_from_checkpoint=resume_from, bf16=True)
    trainer = HarnessAsyncGRPOTrainer(model_dir, lambda sampling: HandmadeFactory(sampling=sampling), config)
    if not resume:
        optimize = trainer._optimize

        def dying(share: Any) -> Any:
            if trainer.collective.rank == 1 and trainer.state.step + 1 == KILLED_AT:
                os.kill(os.getpid(), signal.SIGKILL)
            return optimize(share)

        trainer._optimize = dying  # type: ignore[method-assign]
    setup, started = trainer.setup, []

    def recorded_setup() -> None:
        setup()
        started.append(trainer.state.step)

    trainer.setup = recorded_setup  # type: ignore[method-assign]
    trainer.train()
    if trainer.collective.is_main:
        (out / "resumed.json").write_text(json.dumps({"from": started[0], "steps": trainer.state.step}))


def prefix(model_dir: str, out: Path) -> None:
    """Two copies of the model, each sharded over the ranks; one GRPO group's micro-batch (the same on every
    rank) through the packed forward on one and by prefix on the other, then backward. Rank 0 writes
    ``OUTPUT_DIR/prefix.json``: the largest logprob difference and each gradient's difference relative
    to its norm (the gathered gradients)."""
    from transformers import AutoModelForCausalLM

    from harness_trainer.trainer.fsdp2 import shard
    from harness_trainer.trainer.step.logprobs import use_packed_attention
    from tests.trainer.test_shared_prefix import grpo_group, packed_and_shared

    dist.init_process_group("gloo")
    models = []
    for _ in range(2):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        use_packed_attention(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        models.append(shard(model, optimizer, dist.get_world_size()))
    _, (packed, _), (shared, _), forwarded = packed_and_shared(*models, grpo_group(4))
    grads = [
        {name: p.grad.full_tensor() for name, p in model.named_parameters() if p.grad is not None}
        for model in models
    ]
    if dist.get_rank() == 0:
        relative = {
            name: float((grad - grads[1][name]).norm()) / max(float(grad.norm()), 1e-30)
            for name, grad in grads[0].items()
        }
        result = {
            "logps": float((packed - shared).abs().max()),
            "grads": relative,
            "same_parameters": sorted(grads[0]) == sorted(grads[1]),
            "forwarded": forwarded,
        }
        (out / "prefix.json").write_text(json.dumps(result))


def main(mode: str, model_dir: str, output_dir: str) -> None:
    out = Path(output_dir)
    if mode == "train":
        train(model_dir, out)
    elif mode == "prefix":
        prefix(model_dir, out)
    elif mode == "variants":
        variants(model_dir, out)
    else:
        kill(model_dir, out, resume=mode == "resume")
    dist.barrier()  # gloo aborts the process if a peer destroys the group while it still talks
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
