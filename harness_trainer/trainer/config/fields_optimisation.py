"""The optimisation section of :class:`~.async_grpo.AsyncGRPOConfig`: optimizer, schedule, micro-batches,
the sampling policy, and the loss's knobs (:class:`~.loss.LossConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from harness_trainer.trainer.config.choices import DECAYING_SCHEDULERS, LR_SCHEDULERS, OPTIMIZERS
from harness_trainer.trainer.config.field_help import field_help
from harness_trainer.trainer.config.loss import LossConfig


@dataclass
class OptimisationFields:
    """The optimisation: optimizer, schedule, micro-batches, sampling, the loss."""

    # Optimisation.
    learning_rate: float = field(default=1e-6, metadata=field_help("Peak learning rate."))
    optim: str = field(
        default="adamw_torch",
        metadata=field_help(
            f"Optimizer, one of {OPTIMIZERS} (transformers' names; sgd is plain, no momentum)."
        ),
    )
    lr_scheduler_type: str = field(
        default="constant",
        metadata=field_help(
            f"One of {LR_SCHEDULERS}; a decaying one ({DECAYING_SCHEDULERS}) needs max_steps > 0."
        ),
    )
    warmup_steps: float = field(
        default=0, metadata=field_help("Linear warm-up steps; below 1, a fraction of max_steps (TRL).")
    )
    weight_decay: float = field(default=0.0, metadata=field_help("AdamW weight decay."))
    max_grad_norm: float = field(default=1.0, metadata=field_help("Gradient clipping norm (0 turns it off)."))
    token_budget: int | None = field(
        default=8192,
        metadata=field_help(
            "Tokens per packed micro-batch. A number is needed: TRL's None (the engine's max_model_len) "
            "would need the engine asked at setup, which this trainer does not do."
        ),
    )
    shared_prefix: bool = field(
        default=True,
        metadata=field_help(
            "Forward each prefix that a micro-batch's rows share (a GRPO group's prompt) once, its "
            "key/value cache reused by every row after it: the packed forward's logprobs and gradients "
            "at fewer tokens; micro-batches keep such rows together. Off under gradient_checkpointing, "
            "which drops the cache."
        ),
    )
    temperature: float = field(default=1.0, metadata=field_help("Sampling temperature (the session policy)."))
    max_completion_length: int | None = field(
        default=None,
        metadata=field_help("Cap on the tokens of each model call (the capture session's output cap)."),
    )
    loss: LossConfig = field(
        default_factory=LossConfig,
        metadata=field_help(
            "The loss's knobs (LossConfig: epsilon, epsilon_high, importance_sampling, "
            "importance_sampling_cap, beta, loss_normalization, advantage_epsilon); each is also taken "
            "flat, TRL's way (beta=0.04)."
        ),
    )
