"""The model section of :class:`~.async_grpo.AsyncGRPOConfig`: how the policy is loaded, its training
precision, and LoRA."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness_trainer.trainer.config.choices import DTYPES, LORA_SAVES, LORA_SYNCS
from harness_trainer.trainer.config.field_help import field_help


@dataclass
class ModelFields:
    """The model: loading, precision, LoRA."""

    # Model.
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata=field_help("Keyword arguments for from_pretrained (a dict, or JSON text on the CLI)."),
    )
    dtype: str = field(default="float32", metadata=field_help(f"Training dtype, one of {DTYPES}."))
    bf16: bool = field(
        default=False,
        metadata=field_help(
            "bfloat16 autocast (mixed precision: the weights stay in dtype), through accelerate, on CPU too. "
            "Off by default, unlike TRL: the importance ratios compare the trainer's logprobs with the "
            "engine's, and a lower-precision trainer widens that gap (TRL's own dtype defaults to float32 "
            "for the same reason). Left off, the launcher decides (accelerate launch --mixed_precision)."
        ),
    )
    fp16: bool = field(
        default=False,
        metadata=field_help(
            "float16 autocast with loss scaling (a step whose gradients overflow is skipped and the scale "
            "lowered); needs a GPU: refused at setup on CPU. The loss scale is not checkpointed."
        ),
    )
    gradient_checkpointing: bool = field(
        default=False, metadata=field_help("Trade compute for activation memory.")
    )
    use_peft: bool = field(default=False, metadata=field_help("Train a LoRA adapter instead of all weights."))
    lora_r: int = field(default=16, metadata=field_help("LoRA rank."))
    lora_alpha: int = field(default=32, metadata=field_help("LoRA alpha."))
    lora_dropout: float = field(default=0.0, metadata=field_help("LoRA dropout."))
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        metadata=field_help("Modules LoRA adapts."),
    )
    lora_sync: str = field(
        default="adapter",
        metadata=field_help(
            f"How a LoRA policy reaches vLLM, one of {LORA_SYNCS}: 'adapter' (only the adapter, one served "
            "name per version; vLLM needs --enable-lora and --max-lora-rank >= lora_r) or 'merged' (the "
            "full weights with the adapter merged, by weight_sync)."
        ),
    )
    lora_save: str = field(
        default="adapter",
        metadata=field_help(
            f"What save_model (and the Hub push) writes for a LoRA policy, one of {LORA_SAVES}: 'adapter' "
            "(the adapter alone, as PEFT and TRL: PeftModel.from_pretrained, or vLLM with --enable-lora) or "
            "'merged' (the full model with the adapter merged in, served like any model)."
        ),
    )
