"""``LossConfig``: the knobs of the policy loss, held once in ``AsyncGRPOConfig.loss`` and checked on
construction."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from harness_trainer.trainer.config.choices import IMPORTANCE_SAMPLING_MODES, LOSS_NORMALIZATIONS
from harness_trainer.trainer.config.field_help import field_help
from harness_trainer.trainer.config.problems import ConfigProblems


@dataclass(frozen=True)
class LossConfig:
    """The knobs of the policy loss (:func:`harness_trainer.trainer.step.loss.policy_loss`) and of the
    advantages and weights it is given (:func:`harness_trainer.trainer.step.batch.assemble`), checked on
    construction.

    ``AsyncGRPOConfig.loss`` holds one; ``AsyncGRPOConfig`` also takes each knob flat, under the same name
    (TRL's way: ``AsyncGRPOConfig(beta=0.04)``), and puts it here.

    Raises:
        ConfigProblems: every out-of-range value, in one message.
    """

    epsilon: float = field(
        default=0.2,
        metadata=field_help("Lower clip range: no push on a ratio below 1 - epsilon; in [0, 1)."),
    )
    epsilon_high: float | None = field(
        default=None,
        metadata=field_help("Upper clip range: no push above 1 + epsilon_high; ≥ 0 (None: epsilon, as TRL)."),
    )
    importance_sampling: str = field(
        default="truncate",
        metadata=field_help(
            f"Token-level importance sampling against the engine's logprobs, one of "
            f"{IMPORTANCE_SAMPLING_MODES}: the ratio truncated to importance_sampling_cap, tokens above it "
            "dropped, or the ratio as is."
        ),
    )
    importance_sampling_cap: float = field(
        default=2.0, metadata=field_help("Cap of the importance ratio (> 1).")
    )
    beta: float = field(
        default=0.0, metadata=field_help("KL (k3) coefficient to the reference policy (≥ 0).")
    )
    loss_normalization: str = field(
        default="rollout",
        metadata=field_help(
            f"One of {LOSS_NORMALIZATIONS}. 'rollout': each rollout's token mean (every rollout counts the "
            "same); 'step': tokens over the step's longest rollout (Dr. GRPO; no pull toward long failures)."
        ),
    )
    advantage_epsilon: float = field(default=1e-4, metadata=field_help("Added to the group std (> 0)."))

    def __post_init__(self) -> None:
        if self.epsilon_high is None:
            object.__setattr__(self, "epsilon_high", self.epsilon)
        problems = list(_loss_checks(self))
        if problems:
            raise ConfigProblems("LossConfig", problems)


LOSS_FIELDS = frozenset(f.name for f in fields(LossConfig))
"""The loss knobs' names, which ``AsyncGRPOConfig`` also takes flat."""


def _loss_checks(c: LossConfig) -> Sequence[str]:
    if not 0 <= c.epsilon < 1:
        yield f"epsilon must be in [0, 1), got {c.epsilon}"
    if not (c.epsilon_high is not None and c.epsilon_high >= 0):
        yield f"epsilon_high must be ≥ 0, got {c.epsilon_high}"
    if c.importance_sampling not in IMPORTANCE_SAMPLING_MODES:
        yield f"importance_sampling {c.importance_sampling!r} is not one of {IMPORTANCE_SAMPLING_MODES}"
    if not c.importance_sampling_cap > 1:
        yield f"importance_sampling_cap must be greater than 1, got {c.importance_sampling_cap}"
    if not c.beta >= 0:
        yield f"beta must be ≥ 0, got {c.beta}"
    if c.loss_normalization not in LOSS_NORMALIZATIONS:
        yield f"loss_normalization {c.loss_normalization!r} is not one of {LOSS_NORMALIZATIONS}"
    if not c.advantage_epsilon > 0:
        yield f"advantage_epsilon must be positive, got {c.advantage_epsilon}"
