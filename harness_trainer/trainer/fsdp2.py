"""FSDP2 sharding done by the trainer itself, where accelerate cannot: several CPU processes (gloo).

Contract:

- **When.** The environment asks for FSDP2 (``ACCELERATE_USE_FSDP`` true and ``FSDP_VERSION`` 2, as
  ``accelerate launch --use_fsdp --fsdp_version 2`` or :data:`harness_trainer.jobs.gpus.FSDP2_ENV` set
  it) and accelerate did not shard: it has no FSDP on CPU, so it reports ``MULTI_CPU`` and would wrap the
  model in DDP. With several processes the trainer then calls torch's ``fully_shard`` itself
  (:func:`shards_itself`). On GPUs accelerate's own FSDP path runs instead
  (:func:`harness_trainer.trainer.distributed.prepare`); that one is not exercised by the tests here.
- **What.** One shard unit per transformer layer (the classes named by the model's
  ``_no_split_modules``, as accelerate's ``TRANSFORMER_BASED_WRAP`` picks them), then the root, over a
  one-dimensional CPU mesh of every rank. Each parameter becomes a DTensor holding its rank's rows; the
  optimizer built before sharding is re-pointed at them by parameter name (:func:`shard`). The forward
  runs under the accelerator's mixed precision, as accelerate's ``prepare`` would set it
  (:func:`autocast_forward`).
- **Same step.** Ranks backpropagate ``world_size ×`` their share and FSDP2's reduce-scatter averages, so
  each rank's gradient shard is the single-process gradient's rows. Gradients are reduced at the last
  micro-batch only (:func:`no_sync` turns FSDP2's gradient sync off before it), and the norm clipped
  over the whole sharded gradient is the single-process norm (:func:`clip_grad_norm`).
- **Gathered for rank 0.** The engine's weights, ``save_pretrained`` and checkpoints read the full state
  gathered to rank 0 by torch's ``get_model_state_dict`` (:func:`gathered_state`); every rank must call
  it. LoRA is supported: the engine's merged weights are computed from the gathered state
  (:func:`merged_weights`), as :func:`harness_trainer.trainer.policy.engine_weights` computes them from
  the module.
- **Frozen copies too.** The KL reference of a full-weights run (``beta > 0``) is sharded the same way
  without gradients (:func:`shard_frozen`); its owner reshards it after each forward, since the root's
  parameters stay gathered otherwise (FSDP2 keeps them for a backward that never comes).
- **Memory given back.** glibc's heap keeps what FSDP2 frees (each layer's gathered weights, its full
  gradients) unless large blocks are mapped on their own: :func:`map_large_allocations` lowers glibc's
  mmap threshold before the model is loaded and sharded, so peak RSS per rank follows the memory in use.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from harness_trainer.trainer.policy import is_peft

_TRUE = {"1", "true", "yes", "on"}
M_MMAP_THRESHOLD = -3  # mallopt's parameter number, from glibc's malloc.h
MMAP_THRESHOLD = 65536
"""Bytes from which glibc maps an allocation on its own, under :func:`map_large_allocations`."""
MMAP_THRESHOLD_ENV = "MALLOC_MMAP_THRESHOLD_"

logger = logging.getLogger(__name__)
_mapped: bool | None = None  # map_large_allocations' outcome in this process, once decided


def wants_fsdp2() -> bool:
    """Whether this process's environment asks for FSDP2 (what ``accelerate launch`` sets for its flags)."""
    use = os.environ.get("ACCELERATE_USE_FSDP", "").strip().lower() in _TRUE
    return use and os.environ.get("FSDP_VERSION", "").strip() == "2"


def shards_itself(accelerator: Any) -> bool:
    """Whether the trainer shards with FSDP2 itself: FSDP2 asked for, several processes, and accelerate
    running plain CPU processes (it has no FSDP there)."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.MULTI_CPU:
        return False
    return getattr(accelerator, "num_processes", 1) > 1 and wants_fsdp2()


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The transformer layers of ``model`` (LoRA's base model for a PeftModel): the modules whose class is
    in the model's ``_no_split_modules``, in model order. Empty when the model names none."""
    base = model.get_base_model() if is_peft(model) else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    return [module for module in model.modules() if type(module).__name__ in names]


def shard(model: nn.Module, optimizer: torch.optim.Optimizer, world_size: int) -> nn.Module:
    """``model`` sharded in place over every rank with ``fully_shard`` (each layer, then the root), and
    ``optimizer``'s parameters replaced by their shards; the model, now an ``FSDPModule``.

    ``torch.distributed`` must be initialised (accelerate did). ``optimizer`` holds parameters of
    ``model`` only; its state must be empty (restore it after sharding).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    names = {id(p): name for name, p in model.named_parameters()}
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in shard_units(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # fully_shard replaced every parameter with a DTensor of the same name.
    sharded = dict(model.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [sharded[names[id(p)]] for p in group["params"]]
    return model


def shard_frozen(module: nn.Module, world_size: int) -> nn.Module:
    """``module``, whose parameters are frozen, sharded in place over every rank as :func:`shard` shards
    the trained model (each layer, then the root); the module, now an ``FSDPModule``. Its forward gathers
    each layer's weights and frees them after it, except the root's: call ``reshard()`` after each forward.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if any(p.requires_grad for p in module.parameters()):
        raise ValueError("shard_frozen shards frozen modules: a parameter requires grad")
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in shard_units(module):
        fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def _glibc() -> Any:
    """The C library when it is glibc on Linux (``mallopt`` means what its ``malloc.h`` says), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        if not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
            return None
        return ctypes.CDLL("libc.so.6")
    except (OSError, ValueError):  # no such confstr name (another libc), or no libc.so.6 to load
        return None


def map_large_allocations() -> bool:
    """Have glibc map every allocation of :data:`MMAP_THRESHOLD` bytes or more on its own and unmap it
    when freed (``mallopt(M_MMAP_THRESHOLD, 65536)``); whether it does in this process.

    Under FSDP2 each rank gathers a layer's weights and full gradients and frees them a moment later; with
    glibc's default threshold (which grows to 32 MiB as blocks are freed) those land in its heap, which
    keeps them, and peak RSS per rank stays near the unsharded process's. The trainer calls this on Linux
    with glibc when it shards itself, before it loads the model. It leaves a threshold the user set
    (``MALLOC_MMAP_THRESHOLD_`` in the environment: glibc applied it at start) and does nothing elsewhere;
    the first call decides and logs, later calls return the same answer.
    """
    global _mapped
    if _mapped is not None:
        return _mapped
    if MMAP_THRESHOLD_ENV in os.environ:
        logger.info("%s is set: glibc's mmap threshold left as the environment sets it", MMAP_THRESHOLD_ENV)
        _mapped = False
        return _mapped
    libc = _glibc()
    if libc is None:
        _mapped = False  # another allocator: it has its own ways of giving memory back
        return _mapped
    _mapped = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    if _mapped:
        logger.info(
            "FSDP2: allocations of %d bytes or more are mapped on their own (glibc mallopt), so what "
            "the gathered weights free goes back to the system; %s overrides it",
            MMAP_THRESHOLD, MMAP_THRESHOLD_ENV,
        )  # fmt: skip
    else:
        logger.warning("FSDP2: glibc refused mallopt(M_MMAP_THRESHOLD); freed gathers stay in its heap")
    return _mapped


def autocast_forward(accelerator: Any, model: nn.Module) -> None:
    """Run ``model``'s forward under ``accelerator``'s mixed precision with its outputs in float32, as
    accelerate's ``prepare`` does for the models it wraps (the trainer's own FSDP2 does not go through it)."""
    if not getattr(accelerator, "native_amp", False):
        return
    from accelerate.utils import convert_outputs_to_fp32

    forward = model.forward

    @functools.wraps(forward)
    def mixed_forward(*args: Any, **kwargs: Any) -> Any:
        with accelerator.autocast():
            return forward(*args, **kwargs)

    model.forward = convert_outputs_to_fp32(mixed_forward)  # type: ignore[method-assign]


def is_fsdp2(module: nn.Module) -> bool:
    """Whether ``module`` was sharded by ``fully_shard`` (here or by accelerate)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


@contextlib.contextmanager
def no_sync(accelerator: Any, trained: nn.Module) -> Iterator[None]:
    """Backward passes inside keep their gradients local (accumulated unsharded under FSDP2); the next
    backward outside reduces everything. Accelerate's ``no_sync`` for any other model."""
    if not is_fsdp2(trained):
        with accelerator.no_sync(trained):
            yield
        return
    trained.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        trained.set_requires_gradient_sync(True)  # type: ignore[operator]


def clip_grad_norm(accelerator: Any, trained: nn.Module, max_norm: float) -> float:
    """Clip the gradients of ``trained`` to ``max_norm`` in total; the total norm before clipping, the same
    on every rank. Under the trainer's own FSDP2 the gradients are DTensor shards: torch's clip reduces
    their norm over the ranks (accelerate's wrapper only handles its own FSDP, which keeps it)."""
    if not shards_itself(accelerator):
        return float(accelerator.clip_grad_norm_(trained.parameters(), max_norm))
    norm = torch.nn.utils.clip_grad_norm_(trained.parameters(), max_norm)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def gathered_state(trained: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict of ``trained`` (its ``state_dict`` names), on CPU on rank 0; empty elsewhere.
    Every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(trained, options=options)
    # Tied weights (one parameter under two names) come back as two copies: tie them again, so that
    # save_pretrained drops the duplicate as it does for the unsharded module.
    first: dict[int, str] = {}
    for name, tensor in trained.state_dict(keep_vars=True).items():
        owner = first.setdefault(id(tensor), name)
        if owner != name and owner in state and name in state:
            state[name] = state[owner]
    return state


@torch.no_grad()
def merged_weights(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The engine's weights (base model names) from ``state``, ``model``'s gathered full state dict: for
    LoRA, each adapted weight plus ``scaling × B @ A`` of every active adapter, the factors and scaling read
    from ``model``'s LoRA modules; otherwise ``state`` itself.

    Raises:
        NotImplementedError: a LoRA variant other than plain low-rank factors (DoRA, embeddings,
            convolutions).
    """
    if not is_peft(model):
        return state
    from peft.tuners.lora import Linear, LoraLayer

    base = model.get_base_model()
    prefix = next(name for name, module in model.named_modules() if module is base)
    prefix = f"{prefix}." if prefix else ""
    weights = {
        name[len(prefix) :].replace(".base_layer.", "."): tensor
        for name, tensor in state.items()
        if "lora_" not in name and name.startswith(prefix)
    }
    for module_name, module in base.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        key = f"{module_name}.weight"
        for adapter in module.active_adapters:
            if adapter not in module.lora_A:
                continue
            if not isinstance(module, Linear) or module.use_dora.get(adapter, False):
                raise NotImplementedError(f"{module_name}: only plain LoRA on linear layers merges")
            a = state[f"{prefix}{module_name}.lora_A.{adapter}.weight"].float()
            b = state[f"{prefix}{module_name}.lora_B.{adapter}.weight"].float()
            delta = b @ a
            if module.fan_in_fan_out:
                delta = delta.T
            delta = delta * module.scaling[adapter]
            weights[key] = weights[key] + delta.to(weights[key].dtype)
    return weights


def local_bytes(tensors: Iterator[torch.Tensor] | list[torch.Tensor]) -> int:
    """The bytes these tensors hold on this rank: a DTensor's local shard only."""
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total
