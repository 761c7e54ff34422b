"""Several training processes (accelerate: DDP, or FSDP) driven by rank 0, which alone owns the rollouts.

Contract of a distributed step:

- **Rank 0 deals.** Rank 0 takes the finished groups, assembles the :class:`StepBatch`, plans its packed
  micro-batches and deals them out in stride (``plan[rank::world_size]``); each rank gets one
  :class:`StepShare` (its micro-batches, the rollouts' advantages and weights, the step's rollout metrics),
  or None everywhere when the run stops. Rows travel, traces never do.
- **Equal calls.** Every rank runs the same number of forward/backward passes per step, so the gradient
  collectives line up: a rank short of micro-batches runs the step's shortest row at weight 0 instead.
- **Same gradient.** The step loss is a plain sum of weighted per-token terms over micro-batches, so each
  rank backpropagates ``world_size ×`` its share and the backend's gradient average equals the
  single-process gradient of the step; ranks sync only at their last backward.
- **Stats add up.** :class:`LossStats` are sums, so the ranks' stats are summed (with the tokens
  forwarded) before rank 0 logs them.

Control messages (the deal, the stop, a weight push's outcome, "does this checkpoint exist") go through
:class:`Collective`, on a gloo group of its own: the other ranks wait there as long as rank 0 waits for
rollouts, longer than a GPU backend's watchdog lets an operation stay pending.

Under FSDP the weights are sharded: the engine's weights and checkpoints are gathered to rank 0, the
optimizer state is written by parameter index exactly as a single process writes it, and on resume the
weights are restored before sharding and the optimizer state after it, by parameter name. Two paths shard:

- **On CPU, the trainer's own FSDP2** (:mod:`harness_trainer.trainer.fsdp2`): accelerate has no FSDP on
  CPU, so when the environment asks for FSDP2 and accelerate runs plain CPU processes, the trainer calls
  torch's ``fully_shard`` itself and gathers with torch's ``get_model_state_dict`` /
  ``get_optimizer_state_dict``. LoRA is supported: the engine's merged weights come from the gathered
  state. Ran for real: two gloo processes under ``torchrun`` train, checkpoint, resume and push like one
  process, full weights and LoRA (``tests/trainer/test_fsdp2.py``).
- **On GPUs, accelerate's FSDP** (``accelerate launch --use_fsdp``), gathered with accelerate's
  ``get_state_dict``. It needs GPUs, so it is not exercised by the tests (nor NCCL); its state-dict
  conversions are. LoRA under it is refused: train LoRA with DDP there.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from harness_trainer.trainer.checkpoint import TrainerState, load_checkpoint
from harness_trainer.trainer.fsdp2 import (
    autocast_forward,
    gathered_state,
    merged_weights,
    shard,
    shards_itself,
)
from harness_trainer.trainer.policy import engine_weights, is_peft
from harness_trainer.trainer.step.batch import StepBatch
from harness_trainer.trainer.step.loss import LossStats
from harness_trainer.trainer.step.packing import plan_micro_batches
from harness_trainer.trainer.step.prefix_tree import plan_shared_micro_batches
from harness_trainer.trainer.step.rows import Row

T = TypeVar("T")

CONTROL_TIMEOUT = timedelta(hours=24)
"""How long a control message may be awaited: rank 0 can wait on slow agents for a long time."""


@dataclass
class MicroPlan:
    """The rows of one micro-batch; ``padding`` ones are trained at weight 0 only to keep ranks in step."""

    rows: list[Row]
    padding: bool = False


@dataclass
class StepShare:
    """What one rank trains in one step."""

    micro_batches: list[MicroPlan]
    advantages: dict[int, float]
    weights: dict[int, float]
    metrics: dict[str, float]
    """The step's rollout metrics, computed by rank 0 (the same on every rank)."""
    groups_consumed: int
    """The data position once this step is trained."""


def shard_micro_batches(plan: Sequence[list[Row]], world_size: int) -> list[list[MicroPlan]]:
    """Deal ``plan`` to ``world_size`` ranks in stride, each padded to the same count.

    Every micro-batch goes to exactly one rank, in plan order within a rank; a rank left short gets
    padding micro-batches holding the plan's shortest row.

    Raises:
        ValueError: ``world_size`` is below 1.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if not plan:
        return [[] for _ in range(world_size)]
    count = math.ceil(len(plan) / world_size)
    shortest = min((row for rows in plan for row in rows), key=lambda row: len(row.input_ids))
    shards = []
    for rank in range(world_size):
        own = [MicroPlan(list(rows)) for rows in plan[rank::world_size]]
        own += [MicroPlan([shortest], padding=True) for _ in range(count - len(own))]
        shards.append(own)
    return shards


def split_step(
    batch: StepBatch,
    *,
    token_budget: int,
    world_size: int,
    metrics: dict[str, float],
    groups_consumed: int,
    shared_prefix: bool = False,
) -> list[StepShare]:
    """One :class:`StepShare` per rank: ``batch`` planned into micro-batches and dealt by
    :func:`shard_micro_batches`. With one rank, its share is the whole plan in plan order. With
    ``shared_prefix``, rows that share a prefix are planned together and the budget counts the prefix
    once (:func:`~harness_trainer.trainer.step.prefix_tree.plan_shared_micro_batches`)."""
    if shared_prefix:
        plan = plan_shared_micro_batches(batch.rows, token_budget)
    else:
        plan = plan_micro_batches(batch.rows, token_budget)
    return [
        StepShare(micro, batch.advantages, batch.weights, metrics, groups_consumed)
        for micro in shard_micro_batches(plan, world_size)
    ]


def stats_vector(stats: LossStats, forwarded: int) -> list[float]:
    """``stats`` (every field) and the tokens forwarded, as numbers to sum across ranks."""
    return [float(getattr(stats, f.name)) for f in fields(LossStats)] + [float(forwarded)]


def stats_from_vector(values: Sequence[float]) -> tuple[LossStats, int]:
    """The inverse of :func:`stats_vector`; counts come back as ints."""
    named = zip(fields(LossStats), values, strict=False)
    stats = LossStats(**{f.name: type(f.default)(value) for f, value in named})
    return stats, int(values[-1])


class Collective:
    """The control messages of the trainer, from rank 0; identities in a single process.

    Raises (at construction, with several processes):
        RuntimeError: torch.distributed is not initialised.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self._group: Any = None
        if world_size > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise RuntimeError(f"{world_size} processes but torch.distributed is not initialised")
            self._group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def deal(self, produce: Callable[[], list[T] | None]) -> T | None:
        """Rank 0 runs ``produce`` (one item per rank, or None to stop) and each rank gets its item.

        When ``produce`` raises, the other ranks get None, so they stop, before the error propagates on
        rank 0.
        """
        if not self.is_main:
            return self.scatter(None)
        try:
            items = produce()
        except BaseException:
            self.scatter(None)
            raise
        return self.scatter(items)

    def scatter(self, shares: list[T] | None) -> T | None:
        """Rank 0's ``shares[rank]`` on each rank; None everywhere when rank 0 passes None. The argument
        is read on rank 0 only."""
        if self.world_size == 1:
            return None if shares is None else shares[0]
        import torch.distributed as dist

        sent = None
        if self.is_main:
            sent = [None] * self.world_size if shares is None else list(shares)
        received: list[Any] = [None]
        dist.scatter_object_list(received, sent, src=0, group=self._group)
        return received[0]

    def broadcast(self, value: T) -> T:
        """Rank 0's ``value`` on every rank."""
        if self.world_size == 1:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def sum_stats(self, stats: LossStats, forwarded: int) -> tuple[LossStats, int]:
        """The step's stats and forwarded tokens summed over every rank, on every rank."""
        if self.world_size == 1:
            return stats, forwarded
        import torch.distributed as dist

        values = torch.tensor(stats_vector(stats, forwarded), dtype=torch.float64)
        dist.all_reduce(values, group=self._group)
        return stats_from_vector(values.tolist())


# -- accelerate: preparing, resuming, gathering -------------------------------------------------------


def make_accelerator(mixed_precision: str | None) -> Any:
    """This process's ``Accelerator`` with the mixed precision the run asked for.

    accelerate keeps one mixed-precision setting per process, and an ``Accelerator`` given None silently
    takes whatever an earlier one set: after TRL's ``SFTTrainer`` (its config turns ``bf16`` on) in the
    same notebook, a run that asked for full precision would train under bfloat16 autocast. So None is
    resolved here as accelerate itself resolves it for a fresh process (the launcher's
    ``ACCELERATE_MIXED_PRECISION``, else ``"no"``) and a different setting already in force is refused.
    """
    from accelerate import Accelerator

    wanted = mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    try:
        return Accelerator(mixed_precision=wanted)
    except ValueError as exc:
        if "already been initialized" not in str(exc):
            raise
        from accelerate.state import AcceleratorState

        in_force = AcceleratorState().mixed_precision
        raise ValueError(
            f"this process already runs accelerate with mixed_precision={in_force!r} "
            f"(an earlier Accelerator, e.g. TRL's SFTTrainer, which turns bf16 on), and accelerate keeps "
            f"one setting per process; this run asks for {wanted!r}: set bf16= to match, or train in a "
            "fresh process"
        ) from exc


def is_sharded(accelerator: Any) -> bool:
    """Whether the weights are sharded across ranks: accelerate's FSDP, or the trainer's own FSDP2 on CPU
    (:func:`harness_trainer.trainer.fsdp2.shards_itself`)."""
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP or shards_itself(accelerator)


def prepare(
    accelerator: Any,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    resume: Path | None,
) -> tuple[nn.Module, torch.optim.Optimizer, TrainerState | None]:
    """``model`` and ``optimizer`` wrapped for ``accelerator`` (the model as trained: DDP, FSDP or itself),
    with checkpoint ``resume`` restored into them on this rank; its state, or None without one.

    ``optimizer`` holds ``model``'s trainable parameters in model order (FSDP restores its state by name).
    Under the trainer's own FSDP2 (CPU) ``model`` is sharded in place and ``optimizer`` re-pointed at its
    shards; both come back unwrapped.

    Raises:
        NotImplementedError: DeepSpeed, Megatron-LM or XLA; LoRA under accelerate's FSDP.
        ValueError: as :func:`harness_trainer.trainer.checkpoint.load_checkpoint`.
    """
    from accelerate.utils import DistributedType

    unsupported = (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA)
    if accelerator.distributed_type in unsupported:
        raise NotImplementedError(f"{accelerator.distributed_type} is not supported: use DDP or FSDP")
    if not is_sharded(accelerator):
        trained, optimizer = accelerator.prepare(model, optimizer)
        state = None if resume is None else load_checkpoint(resume, model, optimizer, scheduler)
        return trained, optimizer, state
    itself = shards_itself(accelerator)
    if is_peft(model) and not itself:
        raise NotImplementedError(
            "LoRA under accelerate's FSDP is not supported (untested without GPUs); train LoRA with DDP "
            "(the adapter is small)"
        )
    # FSDP shards what it is given: weights go in before sharding, the optimizer state after it.
    held = OptimizerState()
    state = None if resume is None else load_checkpoint(resume, model, held, scheduler)  # type: ignore[arg-type]
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    if itself:
        autocast_forward(accelerator, model)
        trained = shard(model, optimizer, accelerator.num_processes)
    else:
        trained, optimizer = accelerator.prepare(model, optimizer)
    if held.state is not None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        full = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(trained, _inner(optimizer), by_name(held.state, names), options=full)
    return trained, optimizer, state


def engine_state(accelerator: Any, trained: nn.Module, model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The full weights under the engine's names, on rank 0 (None elsewhere). Every rank must call it:
    under FSDP it gathers."""
    if shards_itself(accelerator):
        state = gathered_state(trained)  # empty but on rank 0
        return merged_weights(model, state) if accelerator.is_main_process else None
    if is_sharded(accelerator):
        weights = accelerator.get_state_dict(trained)
        return weights if accelerator.is_main_process else None
    return engine_weights(model) if accelerator.is_main_process else None


def savable_model(accelerator: Any, trained: nn.Module, model: nn.Module) -> Any:
    """What to ``save_pretrained`` on rank 0: ``model`` itself, or under FSDP a :class:`GatheredModel`.
    Every rank must call it: under FSDP it gathers."""
    if shards_itself(accelerator):
        return GatheredModel(model, gathered_state(trained))
    if is_sharded(accelerator):
        return GatheredModel(model, accelerator.get_state_dict(trained))
    return model


def checkpoint_parts(
    accelerator: Any, trained: nn.Module, model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[Any, Any]:
    """The model and optimizer to hand ``save_checkpoint`` on rank 0: themselves, or under FSDP their
    gathered full states. Every rank must call it: under FSDP it gathers."""
    if not is_sharded(accelerator):
        return model, optimizer
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    saved = savable_model(accelerator, trained, model)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_optimizer_state_dict(trained, _inner(optimizer), options=options)
    return saved, OptimizerState(by_index(state) if accelerator.is_main_process else None)


class GatheredModel:
    """A model whose ``save_pretrained`` writes a given (gathered) state dict: what ``save_checkpoint``
    saves for an FSDP model, whose own tensors are shards."""

    def __init__(self, model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        self.model = model
        self.state_dict = state_dict

    def save_pretrained(self, path: str | Path, **kwargs: Any) -> None:
        self.model.save_pretrained(path, state_dict=self.state_dict, **kwargs)


class OptimizerState:
    """An optimizer state dict standing in for the optimizer in ``save_checkpoint`` (it is read) and
    ``load_checkpoint`` (it is filled), where the real optimizer is sharded."""

    def __init__(self, state: dict[str, Any] | None = None) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        assert self.state is not None
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


def by_index(state: dict[str, Any]) -> dict[str, Any]:
    """A full optimizer state dict keyed by parameter name (torch's ``get_optimizer_state_dict``) keyed
    by parameter index instead, numbered as ``optimizer.state_dict()`` numbers them."""
    index: dict[str, int] = {}
    groups = []
    for group in state["param_groups"]:
        for name in group["params"]:
            index[name] = len(index)
        groups.append({**group, "params": [index[name] for name in group["params"]]})
    return {"state": {index[name]: value for name, value in state["state"].items()}, "param_groups": groups}


def by_name(state: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """The inverse of :func:`by_index`: ``names`` are the optimizer's parameters' names, in its order."""
    groups = [{**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]]
    return {"state": {names[i]: value for i, value in state["state"].items()}, "param_groups": groups}


def _inner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)
