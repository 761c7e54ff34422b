"""Resolving and checking an :class:`~harness_trainer.trainer.config.async_grpo.AsyncGRPOConfig`'s values at
construction: the loss's knobs laid over ``loss``, TRL's batch and concurrency names resolved into
``groups_per_step`` and ``max_concurrent_rollouts``, then every rule its fields must keep together.

Each function returns (or yields) the problems it found as sentences naming the fields; the config raises
them all at once in one :class:`~harness_trainer.trainer.config.problems.ConfigProblems`. Nothing here
changes a value it was given: it only fills ``None`` fields it resolves.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from harness_trainer.engines.kinds import ENGINE_KINDS, PAUSE_MODES, WEIGHT_SYNCS, syncs_adapters
from harness_trainer.trainer.config.choices import (
    CURRICULA,
    DECAYING_SCHEDULERS,
    DEFAULT_GROUPS_PER_STEP,
    DEFAULT_MAX_CONCURRENT_ROLLOUTS,
    DTYPES,
    EVAL_STRATEGIES,
    LORA_SAVES,
    LORA_SYNCS,
    LR_SCHEDULERS,
    OPTIMIZERS,
    REPORT_TO,
)
from harness_trainer.trainer.config.hub_names import repo_name_problem
from harness_trainer.trainer.config.loss import LOSS_FIELDS, LossConfig
from harness_trainer.trainer.config.problems import ConfigProblems

if TYPE_CHECKING:
    from harness_trainer.trainer.config.async_grpo import _ConfigFields


def resolve_loss(c: _ConfigFields, flat: dict[str, Any]) -> list[str]:
    """Make ``c.loss`` a :class:`LossConfig`: from one, or from a dict (a YAML or JSON config), with the
    knobs given flat laid over it."""
    given = c.loss
    if isinstance(given, LossConfig):
        base = {f.name: getattr(given, f.name) for f in fields(LossConfig)}
    elif isinstance(given, dict):
        base = dict(given)
    else:
        return [f"loss must be a LossConfig or a dict of its fields, got {type(given).__name__}"]
    unknown = sorted(set(base) - LOSS_FIELDS)
    if unknown:
        return [f"loss has no field {', '.join(unknown)} (its fields: {', '.join(sorted(LOSS_FIELDS))})"]
    try:
        c.loss = LossConfig(**{**base, **flat})
    except ConfigProblems as exc:
        return exc.problems
    return []


def policy_problems(c: _ConfigFields) -> list[str]:
    """What the capture proxy's :class:`SamplingPolicy` refuses, under this config's names."""
    try:
        _ = c.sampling_policy  # type: ignore[attr-defined]
    except ValidationError as exc:
        names = {"max_tokens": "max_completion_length"}
        return [
            f"sampling policy: {names.get(str(error['loc'][0]), error['loc'][0])} {error['msg']}, got "
            f"{error['input']!r}"
            for error in exc.errors()
        ]
    return []


def resolve_batch(c: _ConfigFields, processes: int) -> list[str]:
    """Set ``groups_per_step`` from TRL's batch fields when given, else to its default."""
    if c.gradient_accumulation_steps < 1:
        return ["gradient_accumulation_steps must be at least 1"]
    per_device = c.per_device_train_batch_size
    if per_device is None:
        if c.gradient_accumulation_steps != 1:
            return [
                "gradient_accumulation_steps counts only with per_device_train_batch_size (rollouts per "
                "step = per_device_train_batch_size × gradient_accumulation_steps × processes): set it too, "
                "or set groups_per_step"
            ]
        c.groups_per_step = DEFAULT_GROUPS_PER_STEP if c.groups_per_step is None else c.groups_per_step
        return []
    rollouts = per_device * c.gradient_accumulation_steps * processes
    if per_device < 1 or c.num_generations < 1 or rollouts % c.num_generations:
        return [
            f"per_device_train_batch_size × gradient_accumulation_steps × processes = {per_device} × "
            f"{c.gradient_accumulation_steps} × {processes} = {rollouts} rollouts per step must be a "
            f"positive multiple of num_generations ({c.num_generations}): a step trains whole groups"
        ]
    groups = rollouts // c.num_generations
    given = f"per_device_train_batch_size gives {groups} groups per step ({rollouts} rollouts)"
    return _set_once(c, "groups_per_step", groups, given)


def resolve_concurrency(c: _ConfigFields, inflight: Any) -> list[str]:
    """Set ``max_concurrent_rollouts`` from TRL's ``max_inflight_tasks`` when given, else to its default."""
    if inflight is None:
        if c.max_concurrent_rollouts is None:
            c.max_concurrent_rollouts = DEFAULT_MAX_CONCURRENT_ROLLOUTS
        return []
    if inflight == -1:
        if c.groups_per_step is None:  # the batch did not resolve (reported)
            return []
        value = max(c.max_staleness, 1) * c.groups_per_step * c.num_generations
    elif isinstance(inflight, int) and inflight >= 1:
        value = inflight
    else:
        return [f"max_inflight_tasks must be at least 1, or -1 (auto), got {inflight!r}"]
    given = f"max_inflight_tasks (TRL's name for max_concurrent_rollouts) gives {value}"
    return _set_once(c, "max_concurrent_rollouts", value, given)


def _set_once(c: _ConfigFields, name: str, value: int, given: str) -> list[str]:
    """Set field ``name`` to ``value``, what one of TRL's names ``given`` it; a problem when the field was
    also set, to another value."""
    current = getattr(c, name)
    if current is not None and current != value:
        return [f"{given} but {name} is {current}: set one of them"]
    setattr(c, name, value)
    return []


def problems(c: _ConfigFields) -> list[str]:
    return list(_checks(c))


def _checks(c: _ConfigFields) -> Sequence[str]:
    # groups_per_step and max_concurrent_rollouts are None here only when resolving them failed (reported).
    if c.num_generations < 2:
        yield f"num_generations must be at least 2 (a group of {c.num_generations} has no baseline)"
    concurrency = c.max_concurrent_rollouts
    if concurrency is not None and concurrency < 1:
        yield "max_concurrent_rollouts must be at least 1"
    if concurrency is not None and c.server_capacity is not None and c.server_capacity < concurrency + 1:
        yield (
            f"the rollout server's capacity ({c.server_capacity}) must be at least "
            f"max_concurrent_rollouts + 1 = {concurrency + 1} (the factory keeps one "
            "session for metadata); raise MAX_CONCURRENT_ENVS or lower max_concurrent_rollouts"
        )
    yield from _adaptive_checks(c)
    if c.max_staleness < 0:
        yield "max_staleness must be ≥ 0"
    if c.groups_per_step is not None and c.groups_per_step < 1:
        yield "groups_per_step must be at least 1"
    if c.rollout_timeout is not None and c.rollout_timeout <= 0:
        yield "rollout_timeout must be positive (or None for each session's own bound)"
    if c.max_unexpected_errors < 0:
        yield "max_unexpected_errors must be ≥ 0 (0 stops the run at the first)"
    if c.fail_fast_rollouts < 0:
        yield "fail_fast_rollouts must be ≥ 0 (0: off)"
    yield from _curriculum_checks(c)
    if not c.learning_rate > 0:
        yield "learning_rate must be positive"
    if c.optim not in OPTIMIZERS:
        yield f"optim {c.optim!r} is not one of {OPTIMIZERS}"
    if c.lr_scheduler_type not in LR_SCHEDULERS:
        yield f"lr_scheduler_type {c.lr_scheduler_type!r} is not one of {LR_SCHEDULERS}"
    elif c.lr_scheduler_type in DECAYING_SCHEDULERS and c.max_steps <= 0:
        yield (
            f"lr_scheduler_type {c.lr_scheduler_type!r} decays over max_steps: set max_steps > 0 (a run "
            "bounded by num_train_epochs has no step count known up front)"
        )
    if c.weight_decay < 0 or c.max_grad_norm < 0:
        yield "weight_decay and max_grad_norm must be ≥ 0"
    for name in ("warmup_steps", "save_steps", "logging_steps"):
        value = getattr(c, name)
        if value < 0 or (value >= 1 and value != int(value)):
            yield f"{name} must be a whole number of steps, or below 1 a fraction of max_steps; got {value}"
        elif 0 < value < 1 and c.max_steps <= 0:
            yield f"{name}={value} is a fraction of max_steps: set max_steps > 0"
    if c.logging_steps == 0:
        yield "logging_steps must be positive"
    if c.token_budget is None or c.token_budget < 1:
        yield (
            f"token_budget must be a positive number of tokens per micro-batch, got {c.token_budget} (TRL's "
            "None, the engine's max_model_len, and ≤ 0, fixed-count batches, do not apply here)"
        )
    if not 0 < c.temperature < float("inf"):
        yield "temperature must be a finite positive number (the policy samples the full vocabulary)"
    if c.max_steps <= 0 and not c.num_train_epochs > 0:
        yield "set max_steps > 0 or num_train_epochs > 0: the run needs an end"
    if c.eval_strategy not in EVAL_STRATEGIES:
        yield f"eval_strategy {c.eval_strategy!r} is not one of {EVAL_STRATEGIES} (no per-epoch evaluation)"
    elif c.eval_strategy == "no" and c.eval_steps is not None:
        yield f"eval_steps={c.eval_steps} with eval_strategy 'no': drop one of them"
    if c.eval_steps is not None:
        value = c.eval_steps
        if value <= 0 or (value >= 1 and value != int(value)):
            yield f"eval_steps must be a whole number of steps, or below 1 a fraction of max_steps: {value}"
        elif value < 1 and c.max_steps <= 0:
            yield f"eval_steps={value} is a fraction of max_steps: set max_steps > 0"
    if c.eval_num_generations < 1:
        yield "eval_num_generations must be at least 1"
    if not 0 <= c.eval_temperature < float("inf"):
        yield "eval_temperature must be ≥ 0 and finite (0: greedy)"
    if not math.isfinite(c.pass_reward):
        yield f"pass_reward must be finite, got {c.pass_reward}"
    if c.rollout_log_steps < 0:
        yield "rollout_log_steps must be ≥ 0"
    if c.save_total_limit is not None and c.save_total_limit < 1:
        yield "save_total_limit must be at least 1"
    if c.num_completions_to_print is not None and c.num_completions_to_print < 1:
        yield "num_completions_to_print must be at least 1 (or None: all)"
    if c.dtype not in DTYPES:
        yield f"dtype {c.dtype!r} is not one of {DTYPES}"
    if c.bf16 and c.fp16:
        yield "bf16 and fp16 exclude each other"
    if (c.push_to_hub or c.hub_model_id is not None) and c.output_dir is not None:
        if (problem := repo_name_problem(c.hub_model_id, c.output_dir)) is not None:
            yield problem
    unknown = [name for name in c.report_to if name not in REPORT_TO]
    if unknown:
        yield f"report_to {unknown} not among {REPORT_TO}"
    if c.engine not in ENGINE_KINDS:
        yield f"engine {c.engine!r} is not one of {ENGINE_KINDS}"
    if c.engine != "none" and not c.vllm_server_base_url:
        yield f"engine {c.engine!r} needs vllm_server_base_url (or set engine='none' to push no weights)"
    if c.weight_sync not in WEIGHT_SYNCS:
        yield f"weight_sync {c.weight_sync!r} is not one of {WEIGHT_SYNCS}"
    if c.vllm_pause_mode not in PAUSE_MODES:
        yield f"vllm_pause_mode {c.vllm_pause_mode!r} is not one of {PAUSE_MODES}"
    if c.weight_sync_steps < 1 or c.weight_sync_retries < 1 or c.weight_sync_timeout <= 0:
        yield "weight_sync_steps and weight_sync_retries must be ≥ 1 and weight_sync_timeout positive"
    if c.lora_sync not in LORA_SYNCS:
        yield f"lora_sync {c.lora_sync!r} is not one of {LORA_SYNCS}"
    yield from _replica_checks(c)
    if c.lora_save not in LORA_SAVES:
        yield f"lora_save {c.lora_save!r} is not one of {LORA_SAVES}"
    if c.use_peft and c.lora_r < 1:
        yield "lora_r must be at least 1"


def _replica_checks(c: _ConfigFields) -> Sequence[str]:
    if not c.vllm_replica_urls:
        if c.replica_proxy_url:
            yield "replica_proxy_url drains replicas, but vllm_replica_urls names none: set both or neither"
        return
    roots = [_engine_root(url) for url in [c.vllm_server_base_url or "", *c.vllm_replica_urls]]
    if twice := sorted({root for root in roots if roots.count(root) > 1}):
        yield f"vllm_replica_urls name an engine twice (vllm_server_base_url included): {twice}"
    if c.engine == "none":
        yield "vllm_replica_urls with engine='none': no weights are pushed, so no replica needs any"
    if c.use_peft and c.lora_sync == "adapter" and syncs_adapters(c.engine):
        yield ADAPTER_ON_REPLICAS


ADAPTER_ON_REPLICAS = (
    "lora_sync='adapter' publishes each adapter on one engine; with vllm_replica_urls use lora_sync='merged' "
    "(every replica gets the merged weights)"
)


def _engine_root(url: str) -> str:
    return url.rstrip("/").removesuffix("/v1")


def _adaptive_checks(c: _ConfigFields) -> Sequence[str]:
    ceiling = c.max_concurrent_rollouts
    if c.min_concurrent_rollouts < 1 or (ceiling is not None and c.min_concurrent_rollouts > ceiling):
        yield (
            f"min_concurrent_rollouts must be in [1, max_concurrent_rollouts={ceiling}], got "
            f"{c.min_concurrent_rollouts}"
        )
    if not 0 < c.kv_cache_low_water <= c.kv_cache_high_water <= 1:
        yield (
            f"the KV-cache water marks must satisfy 0 < kv_cache_low_water ({c.kv_cache_low_water}) ≤ "
            f"kv_cache_high_water ({c.kv_cache_high_water}) ≤ 1"
        )
    if not 0 < c.concurrency_poll_interval < float("inf"):
        yield f"concurrency_poll_interval must be a positive number of seconds: {c.concurrency_poll_interval}"
    if c.adaptive_concurrency and not c.vllm_server_base_url:
        yield "adaptive_concurrency reads the engine's /metrics: set vllm_server_base_url"


def _curriculum_checks(c: _ConfigFields) -> Sequence[str]:
    if c.max_zero_variance_groups_in_a_row < 1:
        yield "max_zero_variance_groups_in_a_row must be at least 1 (a run needs a bound when nothing varies)"
    if c.curriculum not in CURRICULA:
        yield f"curriculum {c.curriculum!r} is not one of {CURRICULA}"
        return
    if c.curriculum == "none":
        return
    if c.dataset_shuffle:
        yield f"dataset_shuffle does nothing with curriculum={c.curriculum!r} (it chooses each row): unset it"
    if c.curriculum_window < 1:
        yield f"curriculum_window must be at least 1, got {c.curriculum_window}"
    if not 0 < c.curriculum_retire_threshold <= 1:
        yield (
            f"curriculum_retire_threshold must be in (0, 1], got {c.curriculum_retire_threshold} (at 0 every "
            "task is retired as soon as it was tried)"
        )
    for name in ("curriculum_retired_weight", "curriculum_unsolved_weight"):
        if not 0 <= getattr(c, name) <= 1:
            yield f"{name} must be in [0, 1], got {getattr(c, name)}"
