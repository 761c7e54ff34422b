"""``AsyncGRPOConfig``: every knob of ``HarnessAsyncGRPOTrainer``, usable from Python, the CLI and YAML.

Field names follow TRL's ``AsyncGRPOConfig`` / ``GRPOConfig`` where the idea is the same
(``num_generations``, ``epsilon``, ``epsilon_high``, ``beta``, ``vllm_server_base_url``, ``max_staleness``,
``token_budget``, ``report_to`` …). Invalid combinations are rejected at construction with one clear
message each, so a run never starts on settings that cannot work. ``HfArgumentParser(AsyncGRPOConfig)``
gives the CLI flags and ``parse_yaml_file`` the YAML loading (see :func:`parse_config`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

IMPORTANCE_SAMPLING_MODES = ("truncate", "mask", "none")
ENGINE_KINDS = ("vllm", "dev", "none")
WEIGHT_SYNCS = ("auto", "nccl", "file")
LORA_SYNCS = ("adapter", "merged")
DTYPES = ("auto", "float32", "bfloat16", "float16")
REPORT_TO = ("none", "all", "tensorboard", "wandb", "trackio")
LOSS_NORMALIZATIONS = ("rollout", "step")
LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")
OPTIMIZERS = ("adamw_torch", "sgd")


def _help(text: str, **extra: Any) -> Any:
    return {"help": text, **extra}


@dataclass
class AsyncGRPOConfig:
    """Configuration of an async GRPO run on captured agent traces."""

    # Model.
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata=_help("Keyword arguments for from_pretrained (a dict, or JSON text on the CLI)."),
    )
    dtype: str = field(default="float32", metadata=_help(f"Training dtype, one of {DTYPES}."))
    gradient_checkpointing: bool = field(
        default=False, metadata=_help("Trade compute for activation memory.")
    )
    use_peft: bool = field(default=False, metadata=_help("Train a LoRA adapter instead of all weights."))
    lora_r: int = field(default=16, metadata=_help("LoRA rank."))
    lora_alpha: int = field(default=32, metadata=_help("LoRA alpha."))
    lora_dropout: float = field(default=0.0, metadata=_help("LoRA dropout."))
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        metadata=_help("Modules LoRA adapts."),
    )
    lora_sync: str = field(
        default="adapter",
        metadata=_help(
            f"How a LoRA policy reaches vLLM, one of {LORA_SYNCS}: 'adapter' (only the adapter, one served "
            "name per version; vLLM needs --enable-lora and --max-lora-rank >= lora_r) or 'merged' (the "
            "full weights with the adapter merged, by weight_sync)."
        ),
    )

    # Rollouts.
    num_generations: int = field(default=8, metadata=_help("Rollouts per task (one group)."))
    max_concurrent_rollouts: int = field(default=8, metadata=_help("Sessions live at once."))
    max_staleness: int = field(
        default=1, metadata=_help("Policy versions a rollout may lag behind the weights it is trained on.")
    )
    groups_per_step: int = field(default=1, metadata=_help("Rollout groups trained per optimizer step."))
    server_capacity: int | None = field(
        default=None,
        metadata=_help("The rollout server's MAX_CONCURRENT_ENVS, when known: must be ≥ concurrency + 1."),
    )
    agent_timeout: float | None = field(
        default=600.0, metadata=_help("Seconds an agent may run; its captured turns stay trainable after.")
    )
    dataset_shuffle: bool = field(default=False, metadata=_help("Shuffle rows each pass (seeded)."))

    # Optimisation.
    learning_rate: float = field(default=1e-6, metadata=_help("Peak learning rate."))
    optim: str = field(
        default="adamw_torch",
        metadata=_help(f"Optimizer, one of {OPTIMIZERS} (transformers' names; sgd is plain, no momentum)."),
    )
    lr_scheduler_type: str = field(default="constant", metadata=_help(f"One of {LR_SCHEDULERS}."))
    warmup_steps: int = field(default=0, metadata=_help("Linear warm-up steps."))
    weight_decay: float = field(default=0.0, metadata=_help("AdamW weight decay."))
    max_grad_norm: float = field(default=1.0, metadata=_help("Gradient clipping norm (0 turns it off)."))
    token_budget: int = field(default=8192, metadata=_help("Tokens per packed micro-batch."))
    temperature: float = field(default=1.0, metadata=_help("Sampling temperature (the session policy)."))
    max_completion_length: int | None = field(
        default=None,
        metadata=_help("Cap on the tokens of each model call (the capture session's output cap)."),
    )
    epsilon: float = field(default=0.2, metadata=_help("Lower clip range of the surrogate."))
    epsilon_high: float | None = field(default=None, metadata=_help("Upper clip range (default: epsilon)."))
    importance_sampling: str = field(
        default="truncate",
        metadata=_help(f"Token-level importance correction, one of {IMPORTANCE_SAMPLING_MODES}."),
    )
    importance_sampling_cap: float = field(default=2.0, metadata=_help("Cap of the importance ratio."))
    beta: float = field(default=0.0, metadata=_help("KL (k3) coefficient to the reference policy."))
    loss_normalization: str = field(
        default="rollout",
        metadata=_help(
            "'rollout': each rollout's token mean (every rollout counts the same); 'step': tokens over the "
            "step's longest rollout (Dr. GRPO; no pull toward long failures)."
        ),
    )
    advantage_epsilon: float = field(default=1e-4, metadata=_help("Added to the group std."))

    # Length of the run, checkpoints, logging.
    max_steps: int = field(default=100, metadata=_help("Optimizer steps to train."))
    save_steps: int = field(default=0, metadata=_help("Checkpoint every N steps (0: only at the end)."))
    save_total_limit: int | None = field(default=None, metadata=_help("Keep at most N checkpoints."))
    output_dir: str = field(default="outputs", metadata=_help("Checkpoints, metrics.jsonl, runs/."))
    resume_from_checkpoint: str | None = field(
        default=None, metadata=_help("A checkpoint folder, or 'latest' for the newest in output_dir.")
    )
    report_to: list[str] = field(
        default_factory=lambda: ["none"], metadata=_help(f"Trackers, any of {REPORT_TO}.")
    )
    run_name: str | None = field(default=None, metadata=_help("Run name for the trackers."))
    logging_steps: int = field(default=1, metadata=_help("Log metrics every N steps."))
    seed: int = field(default=42, metadata=_help("Seed of torch, the data order and the rollout seeds."))
    rollout_log_steps: int = field(
        default=1,
        metadata=_help("Write each rollout (trace included) to rollouts.jsonl every N steps; 0: never."),
    )
    disable_tqdm: bool = field(default=False, metadata=_help("No progress bar."))

    # Engine and weight sync.
    vllm_server_base_url: str | None = field(
        default="http://localhost:8000",
        metadata=_help("The inference engine's URL (vLLM or the dev engine)."),
    )
    engine: str = field(default="vllm", metadata=_help(f"Engine kind, one of {ENGINE_KINDS}."))
    weight_sync_steps: int = field(default=1, metadata=_help("Push weights every N steps."))
    weight_sync_retries: int = field(default=3, metadata=_help("Attempts of a weight push before stopping."))
    weight_sync_timeout: float = field(default=300.0, metadata=_help("Seconds one weight push may take."))
    weight_sync: str = field(
        default="auto",
        metadata=_help(
            f"How weights reach vLLM, one of {WEIGHT_SYNCS}: 'nccl' (vLLM's NCCL weight transfer, trainer "
            "and vLLM on different GPUs or hosts), 'file' (a safetensors file in weight_sync_dir that "
            "vLLM reloads in place: CPU, one GPU), 'auto' ('file' for a vLLM on this host, else 'nccl')."
        ),
    )
    weight_sync_dir: str | None = field(
        default=None,
        metadata=_help("Folder the 'file' path writes to, readable by vLLM (default: /dev/shm)."),
    )

    def __post_init__(self) -> None:
        if isinstance(self.model_init_kwargs, str):
            try:
                self.model_init_kwargs = json.loads(self.model_init_kwargs)
            except json.JSONDecodeError as exc:
                raise ValueError(f"model_init_kwargs is not JSON: {exc}") from exc
        if isinstance(self.report_to, str):
            self.report_to = [part.strip() for part in self.report_to.split(",") if part.strip()]
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        if self.resume_from_checkpoint == "":
            self.resume_from_checkpoint = None
        problems = list(_problems(self))
        if problems:
            raise ValueError("invalid AsyncGRPOConfig: " + "; ".join(problems))

    @property
    def sampling(self) -> dict[str, float | int]:
        """The session sampling policy: temperature (top_p 1, top_k off, no penalties upstream), and the
        output cap when one is set."""
        policy: dict[str, float | int] = {"temperature": float(self.temperature)}
        if self.max_completion_length is not None:
            policy["max_tokens"] = int(self.max_completion_length)
        return policy

    @property
    def admission_limit(self) -> int:
        """Groups in flight plus buffered that the scheduler allows: (max_staleness + 1) × groups_per_step."""
        return (self.max_staleness + 1) * self.groups_per_step

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _problems(c: AsyncGRPOConfig) -> Sequence[str]:
    if c.num_generations < 2:
        yield f"num_generations must be at least 2 (a group of {c.num_generations} has no baseline)"
    if c.max_concurrent_rollouts < 1:
        yield "max_concurrent_rollouts must be at least 1"
    if c.server_capacity is not None and c.server_capacity < c.max_concurrent_rollouts + 1:
        yield (
            f"the rollout server's capacity ({c.server_capacity}) must be at least "
            f"max_concurrent_rollouts + 1 = {c.max_concurrent_rollouts + 1} (the factory keeps one "
            "session for metadata); raise MAX_CONCURRENT_ENVS or lower max_concurrent_rollouts"
        )
    if c.max_staleness < 0:
        yield "max_staleness must be ≥ 0"
    if c.groups_per_step < 1:
        yield "groups_per_step must be at least 1"
    if c.agent_timeout is not None and c.agent_timeout <= 0:
        yield "agent_timeout must be positive (or None for no limit)"
    if not c.learning_rate > 0:
        yield "learning_rate must be positive"
    if c.optim not in OPTIMIZERS:
        yield f"optim {c.optim!r} is not one of {OPTIMIZERS}"
    if c.lr_scheduler_type not in LR_SCHEDULERS:
        yield f"lr_scheduler_type {c.lr_scheduler_type!r} is not one of {LR_SCHEDULERS}"
    if c.warmup_steps < 0 or c.weight_decay < 0 or c.max_grad_norm < 0:
        yield "warmup_steps, weight_decay and max_grad_norm must be ≥ 0"
    if c.max_completion_length is not None and c.max_completion_length < 1:
        yield "max_completion_length must be at least 1"
    if c.token_budget < 1:
        yield "token_budget must be positive"
    if not 0 < c.temperature < float("inf"):
        yield "temperature must be a finite positive number (the policy samples the full vocabulary)"
    if c.epsilon < 0 or (c.epsilon_high is not None and c.epsilon_high < 0):
        yield "epsilon and epsilon_high must be ≥ 0"
    if c.importance_sampling not in IMPORTANCE_SAMPLING_MODES:
        yield f"importance_sampling {c.importance_sampling!r} is not one of {IMPORTANCE_SAMPLING_MODES}"
    if not c.importance_sampling_cap > 1:
        yield "importance_sampling_cap must be greater than 1"
    if c.loss_normalization not in LOSS_NORMALIZATIONS:
        yield f"loss_normalization {c.loss_normalization!r} is not one of {LOSS_NORMALIZATIONS}"
    if c.beta < 0:
        yield "beta must be ≥ 0"
    if c.advantage_epsilon <= 0:
        yield "advantage_epsilon must be positive"
    if c.max_steps < 1:
        yield "max_steps must be at least 1"
    if c.rollout_log_steps < 0:
        yield "rollout_log_steps must be ≥ 0"
    if c.save_steps < 0 or c.logging_steps < 1:
        yield "save_steps must be ≥ 0 and logging_steps ≥ 1"
    if c.save_total_limit is not None and c.save_total_limit < 1:
        yield "save_total_limit must be at least 1"
    if c.dtype not in DTYPES:
        yield f"dtype {c.dtype!r} is not one of {DTYPES}"
    unknown = [name for name in c.report_to if name not in REPORT_TO]
    if unknown:
        yield f"report_to {unknown} not among {REPORT_TO}"
    if c.engine not in ENGINE_KINDS:
        yield f"engine {c.engine!r} is not one of {ENGINE_KINDS}"
    if c.engine != "none" and not c.vllm_server_base_url:
        yield f"engine {c.engine!r} needs vllm_server_base_url (or set engine='none' to push no weights)"
    if c.weight_sync not in WEIGHT_SYNCS:
        yield f"weight_sync {c.weight_sync!r} is not one of {WEIGHT_SYNCS}"
    if c.weight_sync_steps < 1 or c.weight_sync_retries < 1 or c.weight_sync_timeout <= 0:
        yield "weight_sync_steps and weight_sync_retries must be ≥ 1 and weight_sync_timeout positive"
    if c.lora_sync not in LORA_SYNCS:
        yield f"lora_sync {c.lora_sync!r} is not one of {LORA_SYNCS}"
    if c.use_peft and c.lora_r < 1:
        yield "lora_r must be at least 1"


def parse_config(args: Sequence[str] | None = None, *, yaml_file: str | None = None) -> AsyncGRPOConfig:
    """Build a config from CLI flags (``--num_generations 4`` …) or a YAML file of the same names."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(AsyncGRPOConfig)
    if yaml_file is not None:
        (config,) = parser.parse_yaml_file(yaml_file)
        return config
    (config,) = parser.parse_args_into_dataclasses(args=list(args) if args is not None else None)
    return config
