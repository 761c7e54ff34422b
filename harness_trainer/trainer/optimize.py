"""One optimizer step of the policy on a rank's share of a training step, and the parts it steps.

Backward on each of the rank's micro-batches (gradients averaged across ranks at the last one), the loss
stats summed across ranks, the gradient norm clipped, the optimizer and learning-rate scheduler stepped.
:func:`prepare_training` makes those parts: the policy, its reference, optimizer and schedule, prepared
for the ranks and resumed.
"""

from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from harness_trainer.trainer.checkpoint import TrainerState, resolve_resume
from harness_trainer.trainer.config.async_grpo import AsyncGRPOConfig
from harness_trainer.trainer.distributed import Collective, StepShare, prepare
from harness_trainer.trainer.fsdp2 import clip_grad_norm, map_large_allocations, no_sync, shards_itself
from harness_trainer.trainer.optim import build_optimizer
from harness_trainer.trainer.policy import Reference, load_policy
from harness_trainer.trainer.step.logprobs import token_logprobs
from harness_trainer.trainer.step.loss import LossConfig, LossStats, policy_loss
from harness_trainer.trainer.step.packing import MicroBatch, collate
from harness_trainer.trainer.step.rows import Row
from harness_trainer.trainer.step.shared_prefix import micro_batch_logprobs

logger = logging.getLogger(__name__)


class OptimizerStep:
    """The policy's optimizer step, on every rank.

    Args:
        accelerator: accelerate's ``Accelerator`` the model was prepared with.
        trained: the model as trained (its DDP or FSDP wrapper, or itself).
        model: the policy itself (its parameters' device is where micro-batches go).
        optimizer, lr_scheduler: as prepared for ``trained``.
        collective: the ranks' control messages.
        reference: the KL reference (``beta`` > 0), or None.
        loss: the loss's config.
        temperature: the sampling temperature the logprobs are taken at.
        max_grad_norm: the clip (0 or less: measured, not clipped).
        fp16: float16 with loss scaling (the scaler skips a step that overflowed on its own).
        shared_prefix: forward the prefixes a micro-batch's rows share once
            (:mod:`harness_trainer.trainer.step.shared_prefix`); else the packed forward.
    """

    def __init__(
        self,
        accelerator: Any,
        trained: nn.Module,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any,
        collective: Collective,
        reference: Reference | None,
        *,
        loss: LossConfig,
        temperature: float,
        max_grad_norm: float,
        fp16: bool,
        shared_prefix: bool = False,
    ) -> None:
        self.accelerator = accelerator
        self.trained = trained
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.collective = collective
        self.reference = reference
        self.loss = loss
        self.temperature = temperature
        self.max_grad_norm = max_grad_norm
        self.fp16 = fp16
        self.shared_prefix = shared_prefix

    def __call__(self, share: StepShare, step: int) -> tuple[dict[str, float], int]:
        """Train on this rank's ``share`` of step ``step`` + 1: the step's loss metrics (``loss``,
        ``grad_norm``, …, summed over the ranks) and the tokens forwarded on every rank."""
        total, forwarded = LossStats(), 0
        device = next(self.model.parameters()).device
        last = len(share.micro_batches) - 1
        for i, plan in enumerate(share.micro_batches):
            micro = collate(plan.rows, share.advantages, share.weights).to(device)
            if plan.padding:
                micro.token_weights.zero_()
            with no_sync(self.accelerator, self.trained) if i < last else contextlib.nullcontext():
                stats, micro_forwarded = self._backward(micro, plan.rows)
            if not plan.padding:
                total = total.merge(stats)
                forwarded += micro_forwarded
        total, forwarded = self.collective.sum_stats(total, forwarded)
        grad_norm = 0.0
        if share.micro_batches:  # as many on every rank, so every rank steps or none does
            # An infinite max norm measures without clipping (the gradients are scaled by exactly 1).
            max_norm = self.max_grad_norm if self.max_grad_norm > 0 else math.inf
            grad_norm = clip_grad_norm(self.accelerator, self.trained, max_norm)
            # fp16: the loss scaler itself skips a step whose gradients overflowed, and lowers its scale.
            if not math.isfinite(grad_norm) and not self.fp16:
                logger.warning("non-finite gradient norm at step %d; the update is skipped", step + 1)
                self.optimizer.zero_grad(set_to_none=True)
            else:
                self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics = total.metrics() if share.micro_batches else {}
        metrics.setdefault("loss", 0.0)
        metrics["grad_norm"] = grad_norm
        return metrics, forwarded

    def _backward(self, micro: MicroBatch, rows: list[Row]) -> tuple[LossStats, int]:
        """Forward and backward one micro-batch (``rows`` collated): its loss stats and the ids forwarded."""
        logps, entropy, forwarded = self._logprobs(self.trained, micro, rows, with_entropy=True)
        ref_logps = None
        if self.reference is not None:
            with torch.no_grad(), self.reference.model() as reference, self.accelerator.autocast():
                ref_logps, _, _ = self._logprobs(reference, micro, rows, with_entropy=False)
        loss, stats = policy_loss(logps, micro, self.loss, ref_logps=ref_logps, entropy=entropy)
        # The backend averages gradients over ranks; the step's gradient is their sum.
        self.accelerator.backward(loss * self.collective.world_size)
        return stats, forwarded

    def _logprobs(
        self, model: nn.Module, micro: MicroBatch, rows: list[Row], *, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """Target logprobs (and entropies) of ``micro``: forwarded by prefix (``shared_prefix``) or packed."""
        if self.shared_prefix:
            return micro_batch_logprobs(model, micro, rows, self.temperature, with_entropy=with_entropy)
        logps, entropy = token_logprobs(
            model, micro, self.temperature, with_entropy=with_entropy, targets_only=True
        )
        return logps, entropy, micro.n_tokens


def prepare_training(
    model_source: str | nn.Module,
    args: AsyncGRPOConfig,
    peft_config: Any,
    accelerator: Any,
    collective: Collective,
    output_dir: Path,
) -> tuple[OptimizerStep, TrainerState | None, Path | None]:
    """The policy loaded onto this rank's device, its KL reference (``beta`` > 0), optimizer and learning
    rate schedule, prepared for the ranks (DDP, FSDP) and restored from the checkpoint in ``output_dir``
    that ``resume_from_checkpoint`` names: the optimizer step over them, the state resumed (None for a
    fresh run) and the checkpoint it was resumed from."""
    from transformers import get_scheduler

    if shards_itself(accelerator):  # before the model is loaded: what FSDP2 frees goes back
        map_large_allocations()
    # On this rank's device before the reference copies it, so both sit where the forwards run.
    model = load_policy(model_source, args, peft_config).to(accelerator.device)
    model.train()
    reference = Reference(model) if args.loss.beta > 0 else None
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(args.optim, params, args.learning_rate, args.weight_decay)
    lr_scheduler = get_scheduler(
        args.lr_scheduler_type, optimizer, num_warmup_steps=args.warmup_step_count,
        num_training_steps=args.max_steps,
    )  # fmt: skip
    resume = resolve_resume(_resume_flag(args.resume_from_checkpoint), output_dir)
    trained, optimizer, resumed = prepare(accelerator, model, optimizer, lr_scheduler, resume)
    if reference is not None and shards_itself(accelerator):
        reference.shard(accelerator.num_processes)
    step = OptimizerStep(
        accelerator, trained, model, optimizer, lr_scheduler, collective, reference, loss=args.loss,
        temperature=args.temperature, max_grad_norm=args.max_grad_norm, fp16=args.fp16,
        shared_prefix=args.forwards_by_prefix,
    )  # fmt: skip
    return step, resumed, resume


def _resume_flag(value: str | None) -> bool | str | None:
    if value in ("latest", "true", "True"):
        return True
    return value
