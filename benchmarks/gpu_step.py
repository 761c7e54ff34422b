"""The GPU trainer check's workload: a Qwen3-shaped model built on the device, and one training step as
``Trainer._optimize`` takes it on one rank, packed or padded, with or without gradient checkpointing and
FSDP2 (on a one-process group), and the engine's weights gathered after it (see
:mod:`benchmarks.gpu_trainer`)."""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harness_trainer.trainer.step.rows import Row

from benchmarks.trainer import VOCAB

MAX_GRAD_NORM = 1.0

QWEN3_1_7B = {
    "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True,
    "max_position_embeddings": 40960, "rope_theta": 1000000.0,
}  # fmt: skip
# The rows' token ids are below benchmarks.trainer.VOCAB, so the tiny shape's vocabulary is that.
TINY = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": VOCAB, "tie_word_embeddings": True,
    "max_position_embeddings": 4096, "rope_theta": 1000000.0,
}  # fmt: skip


@dataclass(frozen=True)
class Setup:
    """One measured variant: how rows are collated, whether checkpointing or FSDP2 is on, and the gather
    timed after its steps (if any)."""

    name: str
    packed: bool
    checkpointing: bool = False
    fsdp: bool = False
    gather: str | None = None
    by_prefix: bool = False  # packed, each shared prefix forwarded once (the trainer's shared_prefix)


def build_model(config: dict[str, Any], device: str | None = None) -> Any:
    """The random-initialised model of ``config["shape"]`` on ``device`` (default ``config["device"]``), in
    training mode (seeded: every variant gets the same weights)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(config["seed"])
    dtype = getattr(torch, config["dtype"])
    with torch.device(device or config["device"]):  # initialised where it trains: no host copy of the weights
        model = AutoModelForCausalLM.from_config(
            Qwen3Config(**config["shape"]), dtype=dtype, attn_implementation="sdpa"
        )
    return model.train()


def step_inputs(rows: Sequence[Row], seed: int) -> dict[str, Any]:
    """Per-rollout advantages (random) and weights ``1 / (N_r · R)``, as ``benchmarks/trainer.py`` sets
    them."""
    from harness_trainer.trainer.step.loss import LossConfig

    rng = random.Random(seed)
    trained: dict[int, int] = defaultdict(int)
    for row in rows:
        trained[row.rollout] += row.n_targets
    return {
        "advantages": {r: rng.gauss(0.0, 1.0) for r in trained},
        "weights": {r: 1.0 / (n * len(trained)) for r, n in trained.items()},
        "loss": LossConfig(),
    }


def on_device(batch: Any, device: str) -> Any:
    """A packed or padded micro-batch with every tensor on ``device``."""
    import torch

    moved = {
        field.name: value.to(device)
        for field in dataclasses.fields(batch)
        if isinstance(value := getattr(batch, field.name), torch.Tensor)
    }
    return dataclasses.replace(batch, **moved)


def synchronize(device: str) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously; on CPU there is none)."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def train_step(
    model: Any,
    optimizer: Any,
    setup: Setup,
    rows: Sequence[Row],
    inputs: dict[str, Any],
    config: dict[str, Any],
) -> dict[str, float]:
    """One optimizer step over every row (see :mod:`benchmarks.gpu_trainer`); its seconds and token counts."""
    import torch

    from harness_trainer.trainer.step.logprobs import token_logprobs, token_logprobs_padded
    from harness_trainer.trainer.step.loss import policy_loss
    from harness_trainer.trainer.step.packing import collate, collate_padded, plan_micro_batches
    from harness_trainer.trainer.step.prefix_tree import plan_shared_micro_batches
    from harness_trainer.trainer.step.shared_prefix import micro_batch_logprobs

    device = config["device"]
    trained = tensor_tokens = row_tokens = 0
    synchronize(device)
    start = time.perf_counter()
    planner = plan_shared_micro_batches if setup.by_prefix else plan_micro_batches
    plan = planner(rows, config["token_budget"])
    for i, micro in enumerate(plan):
        if setup.fsdp:  # the trainer's no_sync: gradients reduced at the last backward only
            model.set_requires_gradient_sync(i == len(plan) - 1)
        if setup.packed:
            collated = collate(micro, inputs["advantages"], inputs["weights"])
        else:
            collated = collate_padded(micro, inputs["advantages"], inputs["weights"])
        # Counted on the host copy: counting on the device would wait for it at every micro-batch.
        trained += collated.n_targets
        row_tokens += sum(collated.row_lengths)
        batch = on_device(collated, device)
        if setup.by_prefix:
            logps, entropy, forwarded = micro_batch_logprobs(model, batch, micro, 1.0)
            tensor_tokens += forwarded
        else:
            tensor_tokens += collated.input_ids.numel()
            logprobs_of = token_logprobs if setup.packed else token_logprobs_padded
            logps, entropy = logprobs_of(model, batch, 1.0, targets_only=True)
        loss, _ = policy_loss(logps, batch, inputs["loss"], entropy=entropy)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    synchronize(device)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "trained_tokens": trained,
        "row_tokens": row_tokens,
        "tensor_tokens": tensor_tokens,
        "batches": len(plan),
    }


def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max of ``values``."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def timed(action: Callable[[], Any], device: str, times: int) -> tuple[list[float], Any]:
    """Seconds of each of ``times`` calls of ``action`` after one untimed call, and the last result."""
    result = action()
    seconds = []
    for _ in range(times):
        del result  # the previous gather is freed before the next one is made
        synchronize(device)
        start = time.perf_counter()
        result = action()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return seconds, result


def shard(model: Any, device: str) -> None:
    """``fully_shard`` each decoder layer, then the root, on a one-process group of this process."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh(device.split(":")[0], (1,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def full_state_dict(model: Any) -> dict[str, Any]:
    """The sharded model's full state dict on rank 0, gathered as accelerate's ``get_state_dict`` gathers
    an FSDP2 model for ``engine_state``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)
