"""The trainer's one config surface: :class:`~.async_grpo.AsyncGRPOConfig` (its fields, one dataclass per
section in the ``fields_*`` modules, composed into it; the flags and the sectioned YAML generated from them),
the loss's knobs (:mod:`.loss`), the values fields may take (:mod:`.choices`), the rules that resolve and
check its values (:mod:`.checks`, raising one :class:`~.problems.ConfigProblems`), and TRL's config names as
it takes them (:mod:`.trl_fields`). Torch-free, so the CLI can build its flags at once."""
