"""``AsyncGRPOConfig``: every knob of ``HarnessAsyncGRPOTrainer``, usable from Python, the CLI and YAML.

It speaks TRL: every field of TRL's ``AsyncGRPOConfig`` and ``GRPOConfig`` (``TrainingArguments``'
included) is accepted by name: supported under TRL's meaning, refused with a reason unless its value means
what this trainer does anyway, or ignored with a logged reason (the tables of :mod:`.trl_fields`).

A name in no table is a ``TypeError``, as for any dataclass. The fields added for TRL take TRL's defaults
unless their help says why not; older fields kept theirs (``gradient_checkpointing``, ``max_staleness``,
``max_completion_length``, ``token_budget``, ``optim`` and ``weight_sync_timeout`` differ from TRL's).

The loss's knobs live once, in the nested :class:`~.loss.LossConfig` (``config.loss.beta``); they are also
taken flat, as TRL takes them (``AsyncGRPOConfig(beta=0.04)``). The session sampling policy is the capture
proxy's own :class:`~capture_proxy.sampling.SamplingPolicy`, built from ``temperature`` and
``max_completion_length`` and checked at construction.

Invalid combinations are rejected at construction (the rules: :mod:`.checks`), every problem in
one :class:`~.problems.ConfigProblems` (a ``ValueError``), so a run never starts on settings that cannot work;
validation never rewrites a value it was given (``None`` fields are resolved: ``loss.epsilon_high``,
``groups_per_step``, ``max_concurrent_rollouts``, ``output_dir``).
Commands read it from a config file's ``trainer`` section and a flag per field
(:mod:`harness_trainer.launch.config_file`); ``HfArgumentParser(AsyncGRPOConfig)`` parses its fields as
it does TRL's configs.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass
from typing import Any

from capture_proxy.sampling import SamplingPolicy
from harness_trainer.trainer.config import checks
from harness_trainer.trainer.config.fields_engine import EngineFields
from harness_trainer.trainer.config.fields_evaluation import EvaluationFields
from harness_trainer.trainer.config.fields_model import ModelFields
from harness_trainer.trainer.config.fields_optimisation import OptimisationFields
from harness_trainer.trainer.config.fields_rollouts import RolloutFields
from harness_trainer.trainer.config.fields_run import RunFields
from harness_trainer.trainer.config.loss import LOSS_FIELDS
from harness_trainer.trainer.config.problems import ConfigProblems
from harness_trainer.trainer.config.trl_fields import TRL_ONLY, trl_problems

logger = logging.getLogger(__name__)


# A dataclass orders its fields from the last base to the first: the sections are listed last one first, so
# the fields (the flags, --help, the docs' tables) come in the sections' order, the model's first.
@dataclass
class _ConfigFields(
    EngineFields, EvaluationFields, RunFields, OptimisationFields, RolloutFields, ModelFields
):
    """The fields, one base per section, and their checks; :class:`AsyncGRPOConfig` adds TRL's other
    names."""

    def __post_init__(self) -> None:
        # TRL's names that are not fields, set aside by AsyncGRPOConfig.__init__; dropped once checked.
        trl: dict[str, Any] = self.__dict__.pop("_trl_values", {})
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
    def forwards_by_prefix(self) -> bool:
        """Whether the step forwards shared prefixes once (``shared_prefix``): not under
        ``gradient_checkpointing``, which drops the key/value cache the rows after a prefix attend to."""
        return self.shared_prefix and not self.gradient_checkpointing

    @property
    def admission_limit(self) -> int:
        """Groups in flight, buffered, or taken by a step whose weights are not pushed yet, that the
        scheduler allows: (max_staleness + 1) × groups_per_step."""
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
