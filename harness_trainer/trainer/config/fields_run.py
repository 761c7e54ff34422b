"""The run section of :class:`~.async_grpo.AsyncGRPOConfig`: its length, checkpoints, the Hub push,
trackers and logging."""

from __future__ import annotations

from dataclasses import dataclass, field

from harness_trainer.trainer.config.choices import REPORT_TO
from harness_trainer.trainer.config.field_help import field_help


@dataclass
class RunFields:
    """The run: its length, checkpoints, the Hub push, logging."""

    # Length of the run, checkpoints, logging.
    num_train_epochs: float = field(
        default=3.0,
        metadata=field_help(
            "Passes over the dataset rows, when max_steps ≤ 0 (TRL's precedence): the run stops once "
            "⌈num_train_epochs × rows⌉ groups were taken, dropped groups included (their row had its turn)."
        ),
    )
    max_steps: int = field(
        default=-1, metadata=field_help("Optimizer steps to train; > 0 wins over num_train_epochs (TRL).")
    )
    save_steps: float = field(
        default=0,
        metadata=field_help(
            "Checkpoint every N steps, below 1 a fraction of max_steps; 0 (the default, TRL's is 500): only "
            "at the end and on SIGTERM."
        ),
    )
    save_total_limit: int | None = field(default=None, metadata=field_help("Keep at most N checkpoints."))
    output_dir: str | None = field(
        default="outputs", metadata=field_help("Checkpoints, metrics.jsonl, runs/ (None: 'outputs').")
    )
    resume_from_checkpoint: str | None = field(
        default=None, metadata=field_help("A checkpoint folder, or 'latest' for the newest in output_dir.")
    )
    push_to_hub: bool = field(
        default=False,
        metadata=field_help(
            "At the end of a run that reached it (not one stopped early), save_model() into output_dir and "
            "upload the files it wrote to hub_model_id (TRL's hub_strategy='end'). The repository is opened "
            "(created if missing) at setup, so a missing token or a refused repository stops the run before "
            "it trains. Rank 0 uploads."
        ),
    )
    hub_model_id: str | None = field(
        default=None,
        metadata=field_help(
            "The Hub repository a push goes to ('namespace/name', or 'name' in the token's namespace); None: "
            "output_dir's folder name (TRL)."
        ),
    )
    hub_token: str | None = field(
        default=None,
        repr=False,
        metadata=field_help(
            "The token of the push; None: huggingface_hub's (HF_TOKEN, then `hf auth login`'s). A secret: "
            "to_dict() (the run's saved config, the trackers) shows '<HUB_TOKEN>'."
        ),
    )
    hub_private_repo: bool | None = field(
        default=None,
        metadata=field_help(
            "Create the repository private (None: the Hub's default for the namespace); no effect on one "
            "that exists."
        ),
    )
    hub_revision: str | None = field(
        default=None,
        metadata=field_help("The branch the push commits to, created from main if missing; None: main."),
    )
    report_to: list[str] = field(
        default_factory=lambda: ["none"], metadata=field_help(f"Trackers, any of {REPORT_TO}.")
    )
    run_name: str | None = field(default=None, metadata=field_help("Run name for the trackers."))
    project: str = field(
        default="harness-trainer",
        metadata=field_help(
            "wandb / trackio project (TRL's is 'huggingface'; this trainer's runs share their own)."
        ),
    )
    logging_steps: float = field(
        default=1, metadata=field_help("Log metrics every N steps; below 1, a fraction of max_steps (TRL).")
    )
    logging_first_step: bool = field(default=False, metadata=field_help("Log step 1 as well."))
    log_completions: bool = field(
        default=False,
        metadata=field_help(
            "At each logged step, print each trained rollout's task, reward, advantage and final reply "
            "(rollouts.jsonl keeps whole traces: rollout_log_steps)."
        ),
    )
    num_completions_to_print: int | None = field(
        default=None, metadata=field_help("Rollouts log_completions prints per logged step (None: all).")
    )
    seed: int = field(default=42, metadata=field_help("Seed of torch, the data order and the rollout seeds."))
    rollout_log_steps: int = field(
        default=1,
        metadata=field_help(
            "Every rollout goes to rollouts.jsonl as it finishes, with what its step did with it; this keeps "
            "the traces of one step's groups every N steps (group g's when g // groups_per_step + 1 is a "
            "multiple of N); 0: no traces."
        ),
    )
    disable_tqdm: bool | None = field(default=False, metadata=field_help("No progress bar."))
