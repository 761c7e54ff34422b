"""The trainer's one config surface: :class:`~.async_grpo.AsyncGRPOConfig` (its fields, the flags and the
sectioned YAML generated from them), the rules that resolve and check its values (:mod:`.checks`), and TRL's
config names as it takes them (:mod:`.trl_fields`). Torch-free, so the CLI can build its flags at once."""
