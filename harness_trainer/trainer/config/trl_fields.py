"""TRL's config names as ``AsyncGRPOConfig`` takes them: every field of TRL's ``AsyncGRPOConfig`` and
``GRPOConfig`` (``TrainingArguments``' included) sits in exactly one of three tables.

- :data:`TRL_SUPPORTED`: the same idea in ``AsyncGRPOConfig``, under TRL's name and with TRL's meaning (one
  alias: ``max_inflight_tasks`` is ``max_concurrent_rollouts``);
- :data:`TRL_REFUSED`: the idea does not apply here, or is not wired in. Only the value that means what the
  trainer does anyway is accepted (``top_p=1.0`` is, ``top_p=0.9`` is refused with the group's reason);
- :data:`TRL_IGNORED`: settings of machinery this trainer does not have, where ignoring them changes
  nothing; accepted, and logged with the group's reason.

``tests/trainer/test_config_trl.py`` checks the tables against the installed TRL.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

TRL_SUPPORTED: dict[str, str] = {
    **{
        name: name
        for name in (
            "output_dir per_device_train_batch_size gradient_accumulation_steps num_train_epochs max_steps "
            "learning_rate lr_scheduler_type warmup_steps optim weight_decay max_grad_norm bf16 fp16 "
            "gradient_checkpointing logging_steps logging_first_step disable_tqdm report_to run_name project "
            "save_steps save_total_limit push_to_hub hub_model_id hub_token hub_private_repo hub_revision "
            "seed resume_from_checkpoint "
            "model_init_kwargs dtype num_generations max_completion_length temperature chat_template_kwargs "
            "vllm_server_base_url weight_sync_timeout token_budget max_staleness "
            "weight_sync_steps log_completions num_completions_to_print "
            "eval_strategy eval_steps eval_on_start"
        ).split()
    },
    **{name: f"loss.{name}" for name in ("epsilon", "epsilon_high", "beta")},
    "max_inflight_tasks": "max_concurrent_rollouts",
    "num_generations_eval": "eval_num_generations",
}
"""TRL field → the field here that holds it: the same name; the loss's knobs in the nested ``loss``
(``AsyncGRPOConfig`` takes them flat too); two aliases."""


def _same(names: str, *accepted: Any) -> dict[str, tuple[Any, ...]]:
    return dict.fromkeys(names.split(), accepted)


# fmt: off
TRL_REFUSED: tuple[tuple[str, dict[str, tuple[Any, ...]]], ...] = (
    (
        "the policy stays plain temperature sampling over the whole vocabulary, so that the engine's "
        "behaviour logprobs are the probabilities the trainer computes (the capture proxy enforces it on "
        "every call)",
        {
            "top_p": (1.0,), "top_k": (0, -1), "min_p": (None, 0.0), "repetition_penalty": (1.0,),
            **_same("generation_kwargs", None, {}),
            **_same("vllm_structured_outputs_regex neftune_noise_alpha", None),
        },
    ),
    (
        "the loss is one clipped token-level surrogate with truncated (or masked) importance sampling "
        "against the engine's logprobs, per-group normalised advantages, the loss normalised over the whole "
        "step across processes, and an optional k3 KL: set epsilon, epsilon_high, importance_sampling, "
        "importance_sampling_cap, beta, advantage_epsilon and loss_normalization ('rollout' is TRL's "
        "'grpo', 'step' its 'dr_grpo'); TRL's other loss variants are not implemented",
        {
            "importance_sampling_level": ("token",), "scale_rewards": ("group", True), "num_iterations": (1,),
            "top_entropy_quantile": (1.0,), "entropy_coef": (0.0,), "label_smoothing_factor": (0.0,),
            "vllm_importance_sampling_correction": (True,), "average_tokens_across_devices": (True,),
            **_same("use_adaptive_entropy mask_truncated_completions sync_ref_model", False),
            **_same("use_bias_correction_kl", False),
            **_same("delta off_policy_mask_threshold vllm_importance_sampling_cap", None),
            **_same("vllm_importance_sampling_clip_min reward_weights", None),
            **_same("loss_type vllm_importance_sampling_mode vllm_importance_sampling_clip_max"),
        },
    ),
    (
        "the optimizer is torch's AdamW (or SGD) built from optim, learning_rate and weight_decay with "
        "torch's own betas and eps, scheduled by lr_scheduler_type and warmup_steps; nothing else reaches it",
        {
            "adam_beta1": (0.9,), "adam_beta2": (0.999,), "adam_epsilon": (1e-8,),
            **_same("optim_args", None, ""), **_same("lr_scheduler_kwargs", None, {}),
            **_same("optim_target_modules", None),
        },
    ),
    (
        "the model runs in plain PyTorch with this trainer's packed attention, loaded with "
        "model_init_kwargs (trust_remote_code goes there); compilers, fused kernels and these memory, "
        "device and determinism switches are not wired in",
        {
            **_same("tf32 torch_compile_backend torch_compile_mode liger_kernel_config", None),
            **_same("activation_checkpointing_kwargs gradient_checkpointing_kwargs", None),
            **_same("torch_empty_cache_steps router_aux_loss_coef", None),
            **_same("activation_checkpointing", None, False),
            **_same("torch_compile use_liger_kernel auto_find_batch_size cast_lm_head_to_fp32", False),
            **_same("disable_dropout use_cpu full_determinism trust_remote_code", False),
        },
    ),
    (
        "processes and sharding come from the launcher (accelerate launch or torchrun) and its config: "
        "DDP, or FSDP; rank 0 runs the rollouts and deals each step's micro-batches to every rank",
        {
            **_same("accelerator_config parallelism_config ddp_find_unused_parameters", None),
            **_same("ddp_bucket_cap_mb ddp_broadcast_buffers ddp_static_graph ddp_backend", None),
            **_same("fsdp_config deepspeed", None), "fsdp": (None, ""), "ddp_timeout": (1800,),
        },
    ),
    (
        "evaluation rolls the eval tasks out and logs eval/ metrics (eval_strategy 'steps', eval_on_start); "
        "there is no prediction loop and no best-model tracking",
        {"metric_for_best_model": (None,), **_same("do_predict load_best_model_at_end", False)},
    ),
    (
        "dataset rows are taken in order, one pass after another, reshuffled each pass from seed when "
        "dataset_shuffle is set, or drawn by curriculum='pass_rate': set those instead",
        {"data_seed": (None,), **_same("train_sampling_strategy shuffle_dataset")},
    ),
    (
        "checkpoints are written every save_steps, at the end and on SIGTERM, each with the optimizer, "
        "scheduler and RNG state that resuming needs",
        {"save_strategy": ("steps",), "save_only_model": (False,)},
    ),
    (
        "metrics go to metrics.jsonl and the report_to trackers every logging_steps steps; trackio logs to "
        "its local database (TRACKIO_DIR), deploying to a Space is not wired in",
        {
            "logging_strategy": ("steps",), "trackio_static_space_id": (None, False),
            **_same("trackio_space_id trackio_bucket_id", None),
        },
    ),
    (
        "push_to_hub uploads the model once, at the end of the run (hub_strategy 'end', or call "
        "trainer.push_to_hub()); pushing at every save or pushing checkpoints is not implemented",
        {"hub_strategy": ("end",)},
    ),
    (
        "completions are kept in output_dir/rollouts.jsonl (and printed with log_completions); uploading "
        "them to a Hub dataset is not implemented",
        {"log_completions_hub_repo": (None,)},
    ),
    (
        "the agent harness decides its own turns: bound a rollout with rollout_timeout (and the harness's "
        "own step limit)",
        {"max_tool_calling_iterations": (None,)},
    ),
    (
        "the engine is reached at vllm_server_base_url alone",
        {"vllm_server_host": ("0.0.0.0",), "vllm_server_port": (8000,)},
    ),
)
# fmt: on
"""(reason, {TRL field: the values accepted because they mean what this trainer does}); any other value is
refused with the reason. An empty tuple: every value is refused."""

TRL_IGNORED: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "transformers.Trainer's own machinery, which this trainer does not have; what it governs is fixed "
        "here: rank 0 alone logs and checkpoints, non-finite metrics are written as null, num_tokens is "
        "logged every step, SIGTERM always checkpoints, a resumed run continues at the next group, the "
        "training forward keeps no cache",
        tuple(
            "log_on_each_node logging_nan_inf_filter log_level log_level_replica skip_memory_metrics debug "
            "include_num_input_tokens_seen save_on_each_node restore_callback_states_from_checkpoint "
            "enable_jit_checkpoint local_rank ignore_data_skip do_train use_cache log_multimodal "
            "log_unique_prompts".split()
        ),
    ),
    (
        "there is no DataLoader: each dataset row goes whole to the session factory, and rollouts are packed "
        "by token_budget",
        tuple(
            "dataloader_drop_last dataloader_num_workers dataloader_pin_memory dataloader_persistent_workers "
            "dataloader_prefetch_factor dataloader_multiprocessing_context dataloader_in_order "
            "remove_unused_columns label_names length_column_name pad_to_multiple_of".split()
        ),
    ),
    (
        "settings of transformers' batched evaluation loop: evaluation here is k rollouts per eval task "
        "(eval_num_generations), run by the scheduler at the current weights; do_eval is informational, as "
        "in transformers (eval_strategy and eval_on_start decide)",
        tuple(
            "do_eval eval_delay per_device_eval_batch_size prediction_loss_only eval_do_concat_batches "
            "eval_use_gather_object eval_accumulation_steps include_for_metrics batch_eval_metrics "
            "bf16_full_eval fp16_full_eval greater_is_better".split()
        ),
    ),
    (
        "it decides whether a push at a save waits for the previous one, and the only push here is the one "
        "at the end (hub_strategy 'end')",
        ("hub_always_push",),
    ),
    (
        "settings of TRL's in-process rollout worker and generation: here rollouts are agent sessions run by "
        "the scheduler (bounded by max_concurrent_rollouts, the admission limit and rollout_timeout; a "
        "failure reaches the trainer) against the engine server at vllm_server_base_url, and rows are the "
        "captured token ids, never re-tokenized, so nothing drifts",
        tuple(
            "vllm_server_timeout request_timeout queue_maxsize heartbeat_stale_after_s fork_threshold_tokens "
            "use_vllm vllm_mode vllm_model_impl vllm_enable_sleep_mode vllm_group_port "
            "vllm_gpu_memory_utilization vllm_max_model_length vllm_tensor_parallel_size "
            "generation_batch_size steps_per_generation use_transformers_continuous_batching "
            "transformers_continuous_batching_config use_transformers_paged cache_implementation "
            "ds3_gather_for_generation".split()
        ),
    ),
    (
        "parameters of loss variants and reward aggregations that are refused here when switched on "
        "(loss_type, use_adaptive_entropy, sync_ref_model, reward_weights); alone they change nothing",
        tuple(
            "sapo_temperature_neg sapo_temperature_pos vespo_k_pos vespo_lambda_pos vespo_k_neg "
            "vespo_lambda_neg entropy_coef_min entropy_coef_max entropy_coef_delta entropy_target "
            "ref_model_mixup_alpha ref_model_sync_steps multi_objective_aggregation".split()
        ),
    ),
)
"""(reason, TRL fields): accepted, ignored, and logged with the reason."""

TRL_ALIASES = {trl: ours for trl, ours in TRL_SUPPORTED.items() if trl != ours and "." not in ours}
TRL_ONLY = frozenset(
    [
        *TRL_ALIASES,
        *(name for _, names in TRL_REFUSED for name in names),
        *(n for _, g in TRL_IGNORED for n in g),
    ]
)
"""Every TRL name that is no field of ``AsyncGRPOConfig``: accepted by it, checked by :func:`trl_problems`."""


def trl_problems(values: dict[str, Any]) -> list[str]:
    """The refused TRL values, one message per group; logs the ignored ones (their names only)."""
    problems = []
    for reason, accepted in TRL_REFUSED:
        refused = [f"{n}={values[n]!r}" for n in accepted if n in values and values[n] not in accepted[n]]
        if refused:
            problems.append(f"{', '.join(refused)} not supported: {reason}")
    for reason, names in TRL_IGNORED:
        given = [name for name in names if name in values]
        if given:
            logger.warning("TRL's %s accepted and ignored: %s", ", ".join(given), reason)
    return problems
