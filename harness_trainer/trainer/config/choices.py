"""The values :class:`~harness_trainer.trainer.config.async_grpo.AsyncGRPOConfig`'s fields may take, and the
defaults it resolves at construction: named once, for the fields' help texts and for :mod:`.checks`."""

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
