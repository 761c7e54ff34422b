"""``AsyncGRPOConfig``: every knob of ``HarnessAsyncGRPOTrainer``, usable from Python, the CLI and YAML.

It speaks TRL: every field of TRL's ``AsyncGRPOConfig`` and ``GRPOConfig`` (``TrainingArguments``'
included) is accepted by name: supported under TRL's meaning, refused with a reason unless its value means
what this trainer does anyway, or ignored with a logged reason (the tables of :mod:`.trl_fields`).

A name in no table is a ``TypeError``, as for any dataclass. The fields added for TRL take TRL's defaults
unless their help says why not; older fields kept theirs (``gradient_checkpointing``, ``max_staleness``,
``max_completion_length``, ``token_budget``, ``optim`` and ``weight_sync_timeout`` differ from TRL's).

The loss's knobs live once, in the nested :class:`LossConfig` (``config.loss.beta``); they are also taken
flat, as TRL takes them (``AsyncGRPOConfig(beta=0.04)``). The session sampling policy is the capture
proxy's own :class:`~capture_proxy.sampling.SamplingPolicy`, built from ``temperature`` and
``max_completion_length`` and checked at construction.

Invalid combinations are rejected at construction (the rules: :mod:`.config_checks`), every problem in
one :class:`ConfigProblems` (a ``ValueError``), so a run never starts on settings that cannot work;
validation never rewrites a value it was given (``None`` fields are resolved: ``loss.epsilon_high``,
``groups_per_step``, ``max_concurrent_rollouts``, ``output_dir``).
:func:`parse_config` reads CLI flags (``HfArgumentParser``) or a YAML file of the same names, TRL's
included.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from capture_proxy.sampling import SamplingPolicy
from harness_trainer.engines.kinds import ENGINE_KINDS, WEIGHT_SYNCS
from harness_trainer.trainer.config.trl_fields import TRL_ONLY, trl_flags, trl_problems

logger = logging.getLogger(__name__)

IMPORTANCE_SAMPLING_MODES = ("truncate", "mask", "none")
LORA_SYNCS = ("adapter", "merged")
LORA_SAVES = ("adapter", "merged")
DTYPES = ("auto", "float32", "bfloat16", "float16")
REPORT_TO = ("none", "all", "tensorboard", "wandb", "trackio")
LOSS_NORMALIZATIONS = ("rollout", "step")
LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")
DECAYING_SCHEDULERS = ("linear", "cosine")
OPTIMIZERS = ("adamw_torch", "sgd")
EVAL_STRATEGIES = ("no", "steps")
CURRICULA = ("none", "pass_rate")
DEFAULT_GROUPS_PER_STEP = 1
DEFAULT_MAX_CONCURRENT_ROLLOUTS = 8


def _help(text: str, **extra: Any) -> Any:
    return {"help": text, **extra}


class ConfigProblems(ValueError):
    """Every problem with a config's values, in one message; ``problems`` lists them one by one."""

    def __init__(self, what: str, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__(f"invalid {what}: " + "; ".join(self.problems))


@dataclass(frozen=True)
class LossConfig:
    """The knobs of the policy loss (:func:`harness_trainer.trainer.step.loss.policy_loss`) and of the
    advantages
    and weights it is given (:func:`harness_trainer.trainer.step.batch.assemble`), checked on construction.

    ``AsyncGRPOConfig.loss`` holds one; ``AsyncGRPOConfig`` also takes each knob flat, under the same name
    (TRL's way: ``AsyncGRPOConfig(beta=0.04)``), and puts it here.

    Raises:
        ConfigProblems: every out-of-range value, in one message.
    """

    epsilon: float = field(
        default=0.2,
        metadata=_help("Lower clip range: no push on a ratio below 1 - epsilon; in [0, 1)."),
    )
    epsilon_high: float | None = field(
        default=None,
        metadata=_help("Upper clip range: no push above 1 + epsilon_high; ≥ 0 (None: epsilon, as TRL)."),
    )
    importance_sampling: str = field(
        default="truncate",
        metadata=_help(
            f"Token-level importance sampling against the engine's logprobs, one of "
            f"{IMPORTANCE_SAMPLING_MODES}: the ratio truncated to importance_sampling_cap, tokens above it "
            "dropped, or the ratio as is."
        ),
    )
    importance_sampling_cap: float = field(default=2.0, metadata=_help("Cap of the importance ratio (> 1)."))
    beta: float = field(default=0.0, metadata=_help("KL (k3) coefficient to the reference policy (≥ 0)."))
    loss_normalization: str = field(
        default="rollout",
        metadata=_help(
            f"One of {LOSS_NORMALIZATIONS}. 'rollout': each rollout's token mean (every rollout counts the "
            "same); 'step': tokens over the step's longest rollout (Dr. GRPO; no pull toward long failures)."
        ),
    )
    advantage_epsilon: float = field(default=1e-4, metadata=_help("Added to the group std (> 0)."))

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


@dataclass
class _ConfigFields:
    """The fields and their checks; :class:`AsyncGRPOConfig` adds TRL's other names."""

    # Model.
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata=_help("Keyword arguments for from_pretrained (a dict, or JSON text on the CLI)."),
    )
    dtype: str = field(default="float32", metadata=_help(f"Training dtype, one of {DTYPES}."))
    bf16: bool = field(
        default=False,
        metadata=_help(
            "bfloat16 autocast (mixed precision: the weights stay in dtype), through accelerate, on CPU too. "
            "Off by default, unlike TRL: the importance ratios compare the trainer's logprobs with the "
            "engine's, and a lower-precision trainer widens that gap (TRL's own dtype defaults to float32 "
            "for the same reason). Left off, the launcher decides (accelerate launch --mixed_precision)."
        ),
    )
    fp16: bool = field(
        default=False,
        metadata=_help(
            "float16 autocast with loss scaling (a step whose gradients overflow is skipped and the scale "
            "lowered); needs a GPU: refused at setup on CPU. The loss scale is not checkpointed."
        ),
    )
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
    lora_save: str = field(
        default="adapter",
        metadata=_help(
            f"What save_model (and the Hub push) writes for a LoRA policy, one of {LORA_SAVES}: 'adapter' "
            "(the adapter alone, as PEFT and TRL: PeftModel.from_pretrained, or vLLM with --enable-lora) or "
            "'merged' (the full model with the adapter merged in, served like any model)."
        ),
    )

    # Rollouts.
    num_generations: int = field(default=8, metadata=_help("Rollouts per task (one group)."))
    max_concurrent_rollouts: int | None = field(
        default=None,
        metadata=_help(
            f"Sessions live at once (default {DEFAULT_MAX_CONCURRENT_ROLLOUTS}). TRL's max_inflight_tasks is "
            "accepted as its alias, -1 there meaning max(max_staleness, 1) × rollouts per step; the default "
            "is a number rather than that because every session here holds a sandbox."
        ),
    )
    adaptive_concurrency: bool = field(
        default=False,
        metadata=_help(
            "Let the engine's load set how many rollouts are in flight, between min_concurrent_rollouts "
            "and max_concurrent_rollouts: every concurrency_poll_interval seconds the trainer reads the "
            "Prometheus GET /metrics of vllm_server_base_url and of each of vllm_replica_urls (KV-cache "
            "usage, running and waiting requests, preemptions, under vLLM's names, which the dev engine "
            "serves too) and pools them: the mean KV usage over the replicas read, the sums of running and "
            "waiting, the preemptions since polling started. The limit starts at the floor (a resumed run: "
            "at its checkpoint's limit, within the bounds); it grows while the KV usage is below "
            "kv_cache_low_water, nothing waits in the engines and rollouts wait for a slot, and shrinks "
            "above kv_cache_high_water or on a preemption, without cancelling rollouts (the rule: "
            "harness_trainer/trainer/feed/concurrency.py). Logged each step as rollout/concurrency_limit "
            "with engine/replicas_read, engine/kv_cache_usage, engine/running, engine/waiting and "
            "engine/preemptions_total (since polling started). A replica whose /metrics cannot be read is "
            "warned about once until it reads again, and left out of the pool; with none read the limit "
            "stays where it is."
        ),
    )
    min_concurrent_rollouts: int = field(
        default=1,
        metadata=_help(
            "The floor of adaptive_concurrency, where its limit starts unless resumed (1 to "
            "max_concurrent_rollouts)."
        ),
    )
    kv_cache_low_water: float = field(
        default=0.8,
        metadata=_help(
            "adaptive_concurrency grows the limit only while the engine's KV-cache usage (0 to 1) "
            "is below this."
        ),
    )
    kv_cache_high_water: float = field(
        default=0.9,
        metadata=_help(
            "adaptive_concurrency shrinks the limit when the engine's KV-cache usage is above this (from "
            "kv_cache_low_water to 1; the band between them holds the limit)."
        ),
    )
    concurrency_poll_interval: float = field(
        default=5.0,
        metadata=_help(
            "Seconds between two readings of the engines' /metrics under adaptive_concurrency; each reading "
            "changes the limit at most once."
        ),
    )
    max_staleness: int = field(
        default=1, metadata=_help("Policy versions a rollout may lag behind the weights it is trained on.")
    )
    groups_per_step: int | None = field(
        default=None,
        metadata=_help(
            f"Rollout groups trained per optimizer step (default {DEFAULT_GROUPS_PER_STEP}, or what "
            "per_device_train_batch_size gives)."
        ),
    )
    per_device_train_batch_size: int | None = field(
        default=None,
        metadata=_help(
            "TRL's batch size: each optimizer step trains per_device_train_batch_size × "
            "gradient_accumulation_steps × processes (WORLD_SIZE) rollouts, which must be whole groups of "
            "num_generations; it sets groups_per_step. None: groups_per_step decides (TRL's default, 8, is "
            "one group of 8, as here). TRL counts each row of a forked conversation; a rollout counts once "
            "here."
        ),
    )
    gradient_accumulation_steps: int = field(
        default=1,
        metadata=_help(
            "Counts only in the rollouts per step (see per_device_train_batch_size): micro-batches are "
            "packed by token_budget, so how many a step takes follows its tokens."
        ),
    )
    server_capacity: int | None = field(
        default=None,
        metadata=_help("The rollout server's MAX_CONCURRENT_ENVS, when known: must be ≥ concurrency + 1."),
    )
    agent_timeout: float | None = field(
        default=None,
        metadata=_help(
            "Seconds the trainer waits for a rollout before it stops the agent (its captured turns stay "
            "trainable). None: each session's own bound, which for HarborSessionFactory and "
            "LocalSessionFactory covers sandbox start, install, agent and verifier (the factory's timeouts "
            "plus setup_timeout_sec), so a slow start never cuts an agent short."
        ),
    )
    max_unexpected_errors: int = field(
        default=3,
        metadata=_help(
            "Rollouts that may fail with an unexpected exception (a bug: not a sandbox, harness, capture, "
            "transport or rollout-server failure; a rollout_reward_fn that raises counts too) before the run "
            "stops with that error. Each is logged with its traceback and leaves its rollout unscorable; 0 "
            "stops at the first."
        ),
    )
    dataset_shuffle: bool = field(default=False, metadata=_help("Shuffle rows each pass (seeded)."))
    drop_zero_variance_groups: bool = field(
        default=True,
        metadata=_help(
            "Leave out of the step a group whose scored rollouts all got the same reward (its advantages are "
            "all 0: every task solved, or none) and take further groups in its place: DAPO's dynamic "
            "sampling (TRL has no such option). Dropped groups still go to rollouts.jsonl (advantage null) "
            "and the step's reward metrics, and count in rollout/zero_variance_dropped. With beta > 0 they "
            "are dropped too, so their tokens no longer carry the KL term: set False to keep them."
        ),
    )
    max_zero_variance_groups_in_a_row: int = field(
        default=64,
        metadata=_help(
            "Zero-variance groups dropped in a row after which the run stops: as done (stop_reason "
            "'solved') when every rollout of them passed (pass_reward), else with NoLearningSignal naming "
            "the rewards they got (use curriculum='pass_rate', other tasks, or "
            "drop_zero_variance_groups=False)."
        ),
    )
    curriculum: str = field(
        default="none",
        metadata=_help(
            f"How each group's row is chosen, one of {CURRICULA}: 'none' cycles the rows in order "
            "(dataset_shuffle: reshuffled each pass); 'pass_rate' draws each group's row by weight from "
            "each task's pass rate over its last curriculum_window groups: solved tasks are retired, tasks "
            "never solved retried less often. An epoch is then as many groups as rows, not a pass over "
            "every row."
        ),
    )
    curriculum_window: int = field(
        default=2, metadata=_help("Last groups of a task its pass rate is measured over (≥ 1).")
    )
    curriculum_retire_threshold: float = field(
        default=1.0,
        metadata=_help(
            "A task whose pass rate over its last curriculum_window groups is at least this (in (0, 1]) is "
            "retired: sampled with curriculum_retired_weight."
        ),
    )
    curriculum_retired_weight: float = field(
        default=0.0,
        metadata=_help("Sampling weight of a retired task, in [0, 1] (other tasks weigh 1; 0: never again)."),
    )
    curriculum_unsolved_weight: float = field(
        default=0.25,
        metadata=_help(
            "Sampling weight, in [0, 1], of a task that had curriculum_window groups and never passed."
        ),
    )
    chat_template_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata=_help(
            "TRL passes these to apply_chat_template. Here the engine renders each agent call's prompt and "
            "the trainer trains on the captured token ids (it renders no template), and the capture proxy "
            "sends no template arguments upstream: kept with the run's config and warned about; set them on "
            "the engine (its default chat template arguments) to apply them. In white-box mode "
            "(harness_adapter=) the trainer renders each turn itself, with them. A dict, or JSON text."
        ),
    )

    # Optimisation.
    learning_rate: float = field(default=1e-6, metadata=_help("Peak learning rate."))
    optim: str = field(
        default="adamw_torch",
        metadata=_help(f"Optimizer, one of {OPTIMIZERS} (transformers' names; sgd is plain, no momentum)."),
    )
    lr_scheduler_type: str = field(
        default="constant",
        metadata=_help(
            f"One of {LR_SCHEDULERS}; a decaying one ({DECAYING_SCHEDULERS}) needs max_steps > 0."
        ),
    )
    warmup_steps: float = field(
        default=0, metadata=_help("Linear warm-up steps; below 1, a fraction of max_steps (TRL).")
    )
    weight_decay: float = field(default=0.0, metadata=_help("AdamW weight decay."))
    max_grad_norm: float = field(default=1.0, metadata=_help("Gradient clipping norm (0 turns it off)."))
    token_budget: int | None = field(
        default=8192,
        metadata=_help(
            "Tokens per packed micro-batch. A number is needed: TRL's None (the engine's max_model_len) "
            "would need the engine asked at setup, which this trainer does not do."
        ),
    )
    temperature: float = field(default=1.0, metadata=_help("Sampling temperature (the session policy)."))
    max_completion_length: int | None = field(
        default=None,
        metadata=_help("Cap on the tokens of each model call (the capture session's output cap)."),
    )
    loss: LossConfig = field(
        default_factory=LossConfig,
        metadata=_help(
            "The loss's knobs (LossConfig: epsilon, epsilon_high, importance_sampling, "
            "importance_sampling_cap, beta, loss_normalization, advantage_epsilon); each is also taken "
            "flat, TRL's way (beta=0.04)."
        ),
    )

    # Length of the run, checkpoints, logging.
    num_train_epochs: float = field(
        default=3.0,
        metadata=_help(
            "Passes over the dataset rows, when max_steps ≤ 0 (TRL's precedence): the run stops once "
            "⌈num_train_epochs × rows⌉ groups were taken, dropped groups included (their row had its turn)."
        ),
    )
    max_steps: int = field(
        default=-1, metadata=_help("Optimizer steps to train; > 0 wins over num_train_epochs (TRL).")
    )
    save_steps: float = field(
        default=0,
        metadata=_help(
            "Checkpoint every N steps, below 1 a fraction of max_steps; 0 (the default, TRL's is 500): only "
            "at the end and on SIGTERM."
        ),
    )
    save_total_limit: int | None = field(default=None, metadata=_help("Keep at most N checkpoints."))
    output_dir: str | None = field(
        default="outputs", metadata=_help("Checkpoints, metrics.jsonl, runs/ (None: 'outputs').")
    )
    resume_from_checkpoint: str | None = field(
        default=None, metadata=_help("A checkpoint folder, or 'latest' for the newest in output_dir.")
    )
    push_to_hub: bool = field(
        default=False,
        metadata=_help(
            "At the end of a run that reached it (not one stopped early), save_model() into output_dir and "
            "upload the files it wrote to hub_model_id (TRL's hub_strategy='end'). The repository is opened "
            "(created if missing) at setup, so a missing token or a refused repository stops the run before "
            "it trains. Rank 0 uploads."
        ),
    )
    hub_model_id: str | None = field(
        default=None,
        metadata=_help(
            "The Hub repository a push goes to ('namespace/name', or 'name' in the token's namespace); None: "
            "output_dir's folder name (TRL)."
        ),
    )
    hub_token: str | None = field(
        default=None,
        repr=False,
        metadata=_help(
            "The token of the push; None: huggingface_hub's (HF_TOKEN, then `hf auth login`'s). A secret: "
            "to_dict() (the run's saved config, the trackers) shows '<HUB_TOKEN>'."
        ),
    )
    hub_private_repo: bool | None = field(
        default=None,
        metadata=_help(
            "Create the repository private (None: the Hub's default for the namespace); no effect on one "
            "that exists."
        ),
    )
    hub_revision: str | None = field(
        default=None,
        metadata=_help("The branch the push commits to, created from main if missing; None: main."),
    )
    report_to: list[str] = field(
        default_factory=lambda: ["none"], metadata=_help(f"Trackers, any of {REPORT_TO}.")
    )
    run_name: str | None = field(default=None, metadata=_help("Run name for the trackers."))
    project: str = field(
        default="harness-trainer",
        metadata=_help(
            "wandb / trackio project (TRL's is 'huggingface'; this trainer's runs share their own)."
        ),
    )
    logging_steps: float = field(
        default=1, metadata=_help("Log metrics every N steps; below 1, a fraction of max_steps (TRL).")
    )
    logging_first_step: bool = field(default=False, metadata=_help("Log step 1 as well."))
    log_completions: bool = field(
        default=False,
        metadata=_help(
            "At each logged step, print each trained rollout's task, reward, advantage and final reply "
            "(rollouts.jsonl keeps whole traces: rollout_log_steps)."
        ),
    )
    num_completions_to_print: int | None = field(
        default=None, metadata=_help("Rollouts log_completions prints per logged step (None: all).")
    )
    seed: int = field(default=42, metadata=_help("Seed of torch, the data order and the rollout seeds."))
    rollout_log_steps: int = field(
        default=1,
        metadata=_help(
            "Every rollout goes to rollouts.jsonl as it finishes, with what its step did with it; this keeps "
            "the traces of one step's groups every N steps (group g's when g // groups_per_step + 1 is a "
            "multiple of N); 0: no traces."
        ),
    )
    disable_tqdm: bool | None = field(default=False, metadata=_help("No progress bar."))

    # Evaluation (harness_trainer.trainer.feed.evaluation).
    eval_strategy: str | None = field(
        default=None,
        metadata=_help(
            f"One of {EVAL_STRATEGIES}: 'steps' evaluates every eval_steps steps (TRL's meaning). Default: "
            "'steps' when eval_steps is set, else 'no'."
        ),
    )
    eval_steps: float | None = field(
        default=None,
        metadata=_help(
            "Evaluate every N steps (below 1: a fraction of max_steps); with eval_strategy 'steps' and no "
            "eval_steps, logging_steps (TRL's rule). Needs an eval split or the trainer's eval_dataset."
        ),
    )
    eval_on_start: bool = field(
        default=False,
        metadata=_help("Evaluate once before the first step (logged at step 0; not again on resume)."),
    )
    eval_split: str | None = field(
        default=None,
        metadata=_help(
            "The session factory's split to evaluate on (the builder gets split=); default: the training "
            "split, with the trainer's eval_dataset as the rows."
        ),
    )
    eval_num_generations: int = field(
        default=1,
        metadata=_help("Rollouts per eval task (k of pass@k; TRL's num_generations_eval).", aliases=[]),
    )
    eval_temperature: float = field(
        default=0.0,
        metadata=_help(
            "Sampling temperature of eval rollouts; 0 (the default): greedy, one answer per task. Raise it "
            "with eval_num_generations > 1, or the k samples repeat one answer."
        ),
    )
    pass_reward: float = field(
        default=1.0,
        metadata=_help(
            "A rollout passes when its reward is at least this (1.0: the verifier's full marks): eval's "
            "pass@k and the pass-rate curriculum."
        ),
    )

    # Engine and weight sync.
    vllm_server_base_url: str | None = field(
        default="http://localhost:8000",
        metadata=_help("The inference engine's URL (vLLM or the dev engine)."),
    )
    engine: str = field(
        default="auto",
        metadata=_help(
            f"Engine kind, one of {ENGINE_KINDS}. 'auto': told by asking the engine at vllm_server_base_url "
            "when the trainer is made (the dev engine answers GET /weight_version, vLLM does not), so the "
            "same script runs against either; 'none' pushes no weights."
        ),
    )
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
    vllm_replica_urls: list[str] = field(
        default_factory=list,
        metadata=_help(
            "Further replicas of the engine at vllm_server_base_url (same kind, same model; vLLM's data "
            "parallelism across servers): each weight push pauses, pushes to and resumes every one, and a "
            "replica that fails a push is out of rotation until a later push gives it the current weights "
            "(harness_trainer.engines.EngineReplicas). The rollouts' capture proxy routes over them "
            "(serve --upstream A --upstream B --replicas). A comma-separated string is split."
        ),
    )
    replica_proxy_url: str | None = field(
        default=None,
        metadata=_help(
            "The capture proxy that routes the rollouts over vllm_replica_urls (serve --replicas's "
            "--capture-port, or python -m capture_proxy --replicas): a replica that goes out is drained "
            "there and enabled once current. Its admin key comes from $CAPTURE_PROXY_ADMIN_KEY (serve "
            "--capture-admin-key sets the one it starts with). None: a replica out is only recorded, and "
            "the proxy's sessions on it wait while it stays paused."
        ),
    )

    def __post_init__(self) -> None:
        # TRL's names that are not fields, set aside by AsyncGRPOConfig.__init__; dropped once checked.
        trl: dict[str, Any] = self.__dict__.pop("_trl_values", {})
        from harness_trainer.trainer.config import checks  # it reads this module's names

        problems = checks.resolve_loss(self, self.__dict__.pop("_loss_values", {}))
        for name in ("model_init_kwargs", "chat_template_kwargs"):
            text = getattr(self, name)
            if isinstance(text, str):
                try:
                    setattr(self, name, json.loads(text))
                except json.JSONDecodeError as exc:
                    problems.append(f"{name} is not JSON: {exc}")
        if isinstance(self.vllm_replica_urls, str):
            self.vllm_replica_urls = [u.strip() for u in self.vllm_replica_urls.split(",") if u.strip()]
        if self.report_to is None:
            self.report_to = ["none"]
        elif isinstance(self.report_to, str):
            self.report_to = [part.strip() for part in self.report_to.split(",") if part.strip()]
        if self.output_dir is None:
            self.output_dir = "outputs"
        if self.resume_from_checkpoint == "":
            self.resume_from_checkpoint = None
        if self.eval_strategy is None:
            self.eval_strategy = "steps" if self.eval_steps is not None else "no"
        elif self.eval_strategy == "steps" and self.eval_steps is None:
            self.eval_steps = self.logging_steps
        self._world_size = _processes()
        problems += checks.resolve_batch(self, self._world_size)
        problems += checks.resolve_concurrency(self, trl.get("max_inflight_tasks"))
        if trl.get("num_generations_eval") is not None:  # TRL's name; its None leaves our default
            self.eval_num_generations = trl["num_generations_eval"]
        problems += checks.problems(self)
        problems += checks.policy_problems(self)
        problems += trl_problems(trl)
        if problems:
            raise ConfigProblems("AsyncGRPOConfig", problems)
        if self.eval_num_generations > 1 and self.eval_temperature == 0:
            logger.warning(
                "eval_num_generations=%d at eval_temperature 0: greedy samples repeat one answer, so pass@%d "
                "is pass@1; raise eval_temperature to sample k answers", self.eval_num_generations,
                self.eval_num_generations,
            )  # fmt: skip
        if self.chat_template_kwargs:
            logger.warning(
                "chat_template_kwargs %s do not reach the engine: it renders each agent call's prompt and "
                "the capture proxy sends no template arguments; set them on the engine to apply them (in "
                "white-box mode, harness_adapter=, the trainer renders each turn with them: ignore this)",
                sorted(self.chat_template_kwargs),
            )

    @property
    def sampling_policy(self) -> SamplingPolicy:
        """The capture proxy's policy for every session: ``temperature``, and ``max_completion_length`` as
        its output cap (top_p 1, top_k off, no penalties); checked at construction."""
        return SamplingPolicy(temperature=self.temperature, max_tokens=self.max_completion_length)

    @property
    def sampling(self) -> dict[str, float | int]:
        """:attr:`sampling_policy` as the JSON the session factories send: its temperature, and its output
        cap when one is set. top_p and top_k are left out: the policy type holds them at 1 and off."""
        return _policy_json(self.sampling_policy)

    @property
    def eval_sampling(self) -> dict[str, float | int]:
        """:attr:`sampling` with ``eval_temperature``: the policy of eval rollouts."""
        return _policy_json(
            SamplingPolicy(temperature=self.eval_temperature, max_tokens=self.max_completion_length)
        )

    @property
    def evaluates(self) -> bool:
        """Whether the run evaluates at all: every ``eval_steps`` steps, or once at its start."""
        return self.eval_strategy == "steps" or self.eval_on_start

    def should_evaluate(self, step: int) -> bool:
        """Whether step ``step`` (1-based) is followed by an evaluation."""
        if self.eval_strategy != "steps" or self.eval_steps is None:
            return False
        return step % _step_count(self.eval_steps, self.max_steps) == 0

    @property
    def admission_limit(self) -> int:
        """Groups in flight plus buffered that the scheduler allows: (max_staleness + 1) × groups_per_step."""
        assert self.groups_per_step is not None
        return (self.max_staleness + 1) * self.groups_per_step

    @property
    def mixed_precision(self) -> str | None:
        """accelerate's ``mixed_precision`` for ``bf16`` / ``fp16``; None leaves it to the launcher."""
        return "bf16" if self.bf16 else "fp16" if self.fp16 else None

    @property
    def warmup_step_count(self) -> int:
        """Warm-up steps, a fraction of ``max_steps`` resolved."""
        return _step_count(self.warmup_steps, self.max_steps)

    @property
    def save_interval(self) -> int:
        """Steps between checkpoints; 0: only at the end (and on SIGTERM)."""
        return _step_count(self.save_steps, self.max_steps)

    def should_log(self, step: int) -> bool:
        """Whether step ``step`` (1-based) writes its metrics (and, with ``log_completions``, prints)."""
        every = _step_count(self.logging_steps, self.max_steps)
        return step % every == 0 or (self.logging_first_step and step == 1)

    def steps_done(self, step: int) -> bool:
        """Whether ``step`` steps reach ``max_steps`` (never, when the run is bounded by epochs)."""
        return 0 < self.max_steps <= step

    def epochs_done(self, groups_taken: int, num_rows: int) -> bool:
        """Whether ``groups_taken`` groups (dropped ones included) make ``num_train_epochs`` passes over
        ``num_rows`` rows; only when ``max_steps`` ≤ 0 (``max_steps`` > 0 wins, as in TRL)."""
        return self.max_steps <= 0 and groups_taken >= math.ceil(self.num_train_epochs * num_rows)

    def check_processes(self, processes: int) -> None:
        """Raise ``ValueError`` unless the run has the processes ``per_device_train_batch_size`` was resolved
        for (``WORLD_SIZE`` at construction)."""
        built = getattr(self, "_world_size", 1)
        if self.per_device_train_batch_size is not None and processes != built:
            raise ValueError(
                f"per_device_train_batch_size was resolved into groups_per_step for {built} process(es) "
                f"(WORLD_SIZE at construction) but the run has {processes}: build the config in each process"
            )

    @property
    def rollouts_per_step(self) -> int:
        assert self.groups_per_step is not None
        return self.groups_per_step * self.num_generations

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict, ``hub_token`` masked (it is logged and saved with checkpoints)."""
        values = asdict(self)
        if values["hub_token"] is not None:
            values["hub_token"] = "<HUB_TOKEN>"
        return values


class AsyncGRPOConfig(_ConfigFields):
    """Configuration of an async GRPO run on captured agent traces.

    Accepts, besides its fields, every name of TRL's config classes (the aliases, refused and ignored
    names of :mod:`.trl_fields`; see the module docstring).

    Raises:
        ValueError: every problem with the values given, named, in one message.
        TypeError: a name that is neither a field nor one of TRL's.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._loss_values = {name: kwargs.pop(name) for name in list(kwargs) if name in LOSS_FIELDS}
        self._trl_values = {name: kwargs.pop(name) for name in list(kwargs) if name in TRL_ONLY}
        super().__init__(*args, **kwargs)


def _policy_json(policy: SamplingPolicy) -> dict[str, float | int]:
    return policy.model_dump(exclude_none=True, exclude={"top_p", "top_k"})


def _processes() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _step_count(value: float, max_steps: int) -> int:
    """A TRL step count: a whole number of steps, or below 1 a fraction of ``max_steps``, rounded up."""
    if 0 < value < 1:
        return max(1, math.ceil(value * max_steps))
    return int(value)


def parse_config(args: Sequence[str] | None = None, *, yaml_file: str | None = None) -> AsyncGRPOConfig:
    """Build a config from CLI flags (``--num_generations 4`` …) or a YAML file of the same names; TRL's
    other names are taken too (``--max_inflight_tasks 16``, ``top_p: 1.0``).

    Raises:
        ValueError: a name that is neither a field nor TRL's, or what :class:`AsyncGRPOConfig` refuses.
    """
    if yaml_file is not None:
        import yaml

        values = yaml.safe_load(Path(yaml_file).read_text()) or {}
        _check_names(values)
        return AsyncGRPOConfig(**values)
    from transformers import HfArgumentParser

    parser = HfArgumentParser(AsyncGRPOConfig)
    namespace, rest = parser.parse_known_args(args=list(args) if args is not None else None)
    trl = trl_flags(rest)
    _check_names(trl)
    return AsyncGRPOConfig(**vars(namespace), **trl)


def _check_names(values: dict[str, Any]) -> None:
    known = {f.name for f in fields(_ConfigFields)} | LOSS_FIELDS | TRL_ONLY
    unknown = sorted(name for name in values if name not in known)
    if unknown:
        raise ValueError(f"not AsyncGRPOConfig fields, nor TRL's: {unknown}")
