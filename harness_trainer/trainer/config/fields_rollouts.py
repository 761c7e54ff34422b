"""The rollouts section of :class:`~.async_grpo.AsyncGRPOConfig`: groups, batch and concurrency, the
rollouts' bounds, zero-variance groups, and the curriculum that picks each group's task."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness_trainer.trainer.config.choices import (
    CURRICULA,
    DEFAULT_GROUPS_PER_STEP,
    DEFAULT_MAX_CONCURRENT_ROLLOUTS,
)
from harness_trainer.trainer.config.field_help import field_help


@dataclass
class RolloutFields:
    """The rollouts: groups, batch, concurrency, failures, the curriculum."""

    # Rollouts.
    num_generations: int = field(default=8, metadata=field_help("Rollouts per task (one group)."))
    max_concurrent_rollouts: int | None = field(
        default=None,
        metadata=field_help(
            f"Sessions live at once (default {DEFAULT_MAX_CONCURRENT_ROLLOUTS}). TRL's max_inflight_tasks is "
            "accepted as its alias, -1 there meaning max(max_staleness, 1) × rollouts per step; the default "
            "is a number rather than that because every session here holds a sandbox."
        ),
    )
    adaptive_concurrency: bool = field(
        default=False,
        metadata=field_help(
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
        metadata=field_help(
            "The floor of adaptive_concurrency, where its limit starts unless resumed (1 to "
            "max_concurrent_rollouts)."
        ),
    )
    kv_cache_low_water: float = field(
        default=0.8,
        metadata=field_help(
            "adaptive_concurrency grows the limit only while the engine's KV-cache usage (0 to 1) "
            "is below this."
        ),
    )
    kv_cache_high_water: float = field(
        default=0.9,
        metadata=field_help(
            "adaptive_concurrency shrinks the limit when the engine's KV-cache usage is above this (from "
            "kv_cache_low_water to 1; the band between them holds the limit)."
        ),
    )
    concurrency_poll_interval: float = field(
        default=5.0,
        metadata=field_help(
            "Seconds between two readings of the engines' /metrics under adaptive_concurrency; each reading "
            "changes the limit at most once."
        ),
    )
    max_staleness: int = field(
        default=1,
        metadata=field_help("Policy versions a rollout may lag behind the weights it is trained on."),
    )
    groups_per_step: int | None = field(
        default=None,
        metadata=field_help(
            f"Rollout groups trained per optimizer step (default {DEFAULT_GROUPS_PER_STEP}, or what "
            "per_device_train_batch_size gives)."
        ),
    )
    per_device_train_batch_size: int | None = field(
        default=None,
        metadata=field_help(
            "TRL's batch size: each optimizer step trains per_device_train_batch_size × "
            "gradient_accumulation_steps × processes (WORLD_SIZE) rollouts, which must be whole groups of "
            "num_generations; it sets groups_per_step. None: groups_per_step decides (TRL's default, 8, is "
            "one group of 8, as here). TRL counts each row of a forked conversation; a rollout counts once "
            "here."
        ),
    )
    gradient_accumulation_steps: int = field(
        default=1,
        metadata=field_help(
            "Counts only in the rollouts per step (see per_device_train_batch_size): micro-batches are "
            "packed by token_budget, so how many a step takes follows its tokens."
        ),
    )
    server_capacity: int | None = field(
        default=None,
        metadata=field_help(
            "The rollout server's MAX_CONCURRENT_ENVS, when known: must be ≥ concurrency + 1."
        ),
    )
    rollout_timeout: float | None = field(
        default=None,
        metadata=field_help(
            "Seconds the trainer waits for a rollout before it stops the agent (its captured turns stay "
            "trainable). None: each session's own bound, which for HarborSessionFactory and "
            "LocalSessionFactory covers sandbox start, install, agent and verifier (the factory's timeouts "
            "plus setup_timeout_sec), so a slow start never cuts an agent short. The commands derive it "
            "from the agent's timeout (RunOptions.agent_timeout_sec plus 600 s)."
        ),
    )
    max_unexpected_errors: int = field(
        default=3,
        metadata=field_help(
            "Rollouts that may fail with an unexpected exception (a bug: not a sandbox, harness, capture, "
            "transport or rollout-server failure; a rollout_reward_fn that raises counts too) before the run "
            "stops with that error. Each is logged with its traceback and leaves its rollout unscorable; 0 "
            "stops at the first."
        ),
    )
    fail_fast_rollouts: int = field(
        default=8,
        metadata=field_help(
            "When the run's first this many rollouts all fail one infrastructure way (one exception type "
            "and kind: every sandbox refusing to start, every agent failing to install), the run stops at "
            "once with that error instead of dropping group after group; one success or one other kind "
            "among them, and the check is over. 0: off."
        ),
    )
    dataset_shuffle: bool = field(default=False, metadata=field_help("Shuffle rows each pass (seeded)."))
    drop_zero_variance_groups: bool = field(
        default=True,
        metadata=field_help(
            "Leave out of the step a group whose scored rollouts all got the same reward (its advantages are "
            "all 0: every task solved, or none) and take further groups in its place: DAPO's dynamic "
            "sampling (TRL has no such option). Dropped groups still go to rollouts.jsonl (advantage null) "
            "and the step's reward metrics, and count in rollout/zero_variance_dropped. With beta > 0 they "
            "are dropped too, so their tokens no longer carry the KL term: set False to keep them."
        ),
    )
    max_zero_variance_groups_in_a_row: int = field(
        default=64,
        metadata=field_help(
            "Zero-variance groups dropped in a row after which the run stops: as done (stop_reason "
            "'solved') when every rollout of them passed (pass_reward), else with NoLearningSignal naming "
            "the rewards they got (use curriculum='pass_rate', other tasks, or "
            "drop_zero_variance_groups=False)."
        ),
    )
    curriculum: str = field(
        default="none",
        metadata=field_help(
            f"How each group's row is chosen, one of {CURRICULA}: 'none' cycles the rows in order "
            "(dataset_shuffle: reshuffled each pass); 'pass_rate' draws each group's row by weight from "
            "each task's pass rate over its last curriculum_window groups: solved tasks are retired, tasks "
            "never solved retried less often. An epoch is then as many groups as rows, not a pass over "
            "every row."
        ),
    )
    curriculum_window: int = field(
        default=2, metadata=field_help("Last groups of a task its pass rate is measured over (≥ 1).")
    )
    curriculum_retire_threshold: float = field(
        default=1.0,
        metadata=field_help(
            "A task whose pass rate over its last curriculum_window groups is at least this (in (0, 1]) is "
            "retired: sampled with curriculum_retired_weight."
        ),
    )
    curriculum_retired_weight: float = field(
        default=0.0,
        metadata=field_help(
            "Sampling weight of a retired task, in [0, 1] (other tasks weigh 1; 0: never again)."
        ),
    )
    curriculum_unsolved_weight: float = field(
        default=0.25,
        metadata=field_help(
            "Sampling weight, in [0, 1], of a task that had curriculum_window groups and never passed."
        ),
    )
    chat_template_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata=field_help(
            "TRL passes these to apply_chat_template. Here the engine renders each agent call's prompt and "
            "the trainer trains on the captured token ids (it renders no template), and the capture proxy "
            "sends no template arguments upstream: kept with the run's config and warned about; set them on "
            "the engine (its default chat template arguments) to apply them. In white-box mode "
            "(harness_adapter=) the trainer renders each turn itself, with them. A dict, or JSON text."
        ),
    )
