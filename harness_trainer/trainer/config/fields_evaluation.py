"""The evaluation section of :class:`~.async_grpo.AsyncGRPOConfig`: when the run evaluates, on what, and
what a pass is."""

from __future__ import annotations

from dataclasses import dataclass, field

from harness_trainer.trainer.config.choices import EVAL_STRATEGIES
from harness_trainer.trainer.config.field_help import field_help


@dataclass
class EvaluationFields:
    """Evaluation: when, on which split, how sampled; what a pass is."""

    # Evaluation (harness_trainer.trainer.feed.evaluation).
    eval_strategy: str | None = field(
        default=None,
        metadata=field_help(
            f"One of {EVAL_STRATEGIES}: 'steps' evaluates every eval_steps steps (TRL's meaning). Default: "
            "'steps' when eval_steps is set, else 'no'."
        ),
    )
    eval_steps: float | None = field(
        default=None,
        metadata=field_help(
            "Evaluate every N steps (below 1: a fraction of max_steps); with eval_strategy 'steps' and no "
            "eval_steps, logging_steps (TRL's rule). Needs an eval split or the trainer's eval_dataset."
        ),
    )
    eval_on_start: bool = field(
        default=False,
        metadata=field_help("Evaluate once before the first step (logged at step 0; not again on resume)."),
    )
    eval_split: str | None = field(
        default=None,
        metadata=field_help(
            "The session factory's split to evaluate on (the builder gets split=); default: the training "
            "split, with the trainer's eval_dataset as the rows."
        ),
    )
    eval_num_generations: int = field(
        default=1,
        metadata=field_help("Rollouts per eval task (k of pass@k; TRL's num_generations_eval).", aliases=[]),
    )
    eval_temperature: float = field(
        default=0.0,
        metadata=field_help(
            "Sampling temperature of eval rollouts; 0 (the default): greedy, one answer per task. Raise it "
            "with eval_num_generations > 1, or the k samples repeat one answer."
        ),
    )
    pass_reward: float = field(
        default=1.0,
        metadata=field_help(
            "A rollout passes when its reward is at least this (1.0: the verifier's full marks): eval's "
            "pass@k and the pass-rate curriculum."
        ),
    )
