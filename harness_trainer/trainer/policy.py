"""The trained policy: loading it (dtype, LoRA, gradient checkpointing), its reference, and its weights
as the engine names them."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from harness_trainer.trainer.config.async_grpo import AsyncGRPOConfig
from harness_trainer.trainer.step.logprobs import use_packed_attention

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_policy(model: str | nn.Module, config: AsyncGRPOConfig, peft_config: Any = None) -> nn.Module:
    """The model to train: loaded from a path or name, or the module given; wrapped with LoRA when asked."""
    if isinstance(model, str):
        from transformers import AutoModelForCausalLM

        kwargs = dict(config.model_init_kwargs or {})
        if config.dtype != "auto":
            kwargs.setdefault("dtype", _DTYPES[config.dtype])
        model = AutoModelForCausalLM.from_pretrained(model, **kwargs)
    # Rows are packed without padding; this attention runs each row's causal sdpa on its own (no T×T mask).
    use_packed_attention(model)
    if peft_config is None and config.use_peft:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=config.lora_r,
            lora_alpha=config.lora_alpha,
            lora_dropout=config.lora_dropout,
            target_modules=list(config.lora_target_modules),
            task_type="CAUSAL_LM",
        )
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if hasattr(model, "config"):
            model.config.use_cache = False
    if peft_config is not None:
        try:
            from peft import get_peft_model
        except ImportError as exc:
            raise ImportError("LoRA training needs peft: pip install 'harness-trainer[train]'") from exc
        if config.gradient_checkpointing:
            model.enable_input_require_grads()
        model = get_peft_model(model, peft_config)
    return model


def is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def vocab_size(model: nn.Module) -> int:
    return int(model.get_input_embeddings().num_embeddings)


class Reference:
    """The KL reference policy: the base model with the adapter off (LoRA), else a frozen copy.

    Under the trainer's own FSDP2 the copy is sharded over the ranks (:meth:`shard`) and its gathered
    weights freed after each forward; with LoRA the base model is the policy's, sharded with it.
    """

    def __init__(self, model: nn.Module) -> None:
        self._policy = model
        self._copy: nn.Module | None = None
        self._sharded = False
        if not is_peft(model):
            self._copy = copy.deepcopy(model).eval()
            self._copy.requires_grad_(False)

    @property
    def copy(self) -> nn.Module | None:
        """The frozen copy (sharded after :meth:`shard`); None with LoRA."""
        return self._copy

    def shard(self, world_size: int) -> None:
        """Shard the frozen copy over ``world_size`` ranks (every rank calls it); nothing with LoRA."""
        # Imported here: fsdp2 imports this module.
        from harness_trainer.trainer.fsdp2 import shard_frozen

        if self._copy is not None and not self._sharded:
            shard_frozen(self._copy, world_size)
            self._sharded = True

    @contextlib.contextmanager
    def model(self) -> Iterator[nn.Module]:
        """The reference for one forward; sharded, its gathered weights are freed when the block ends."""
        if self._copy is None:
            with self._policy.disable_adapter():
                yield self._policy
            return
        try:
            yield self._copy
        finally:
            if self._sharded:  # the root's weights stay gathered after a forward: free them
                self._copy.reshard()  # type: ignore[operator]


@torch.no_grad()
def engine_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full weights under the base model's names. LoRA deltas are added to copies of the base weights;
    the module itself is never touched (merging in place and out again would round the frozen weights)."""
    if not is_peft(model):
        return {name: tensor.detach() for name, tensor in model.state_dict().items()}
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    weights = {
        name.replace(".base_layer.", "."): tensor.detach()
        for name, tensor in base.state_dict().items()
        if "lora_" not in name
    }
    for module_name, module in base.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        key = f"{module_name}.weight"
        for adapter in module.active_adapters:
            if adapter in module.lora_A:
                weights[key] = weights[key] + module.get_delta_weight(adapter).to(weights[key].dtype)
    return weights
