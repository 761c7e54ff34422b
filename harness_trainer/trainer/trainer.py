"""``HarnessAsyncGRPOTrainer``: async GRPO on the captured behaviour of black-box agents.

The loop is visible: :meth:`setup` (policy, optimizer, engine, sessions, resume), :meth:`train` (take
finished groups → rows and advantages → packed micro-batches → clipped, importance-corrected loss → one
optimizer step → push weights → log, checkpoint), :meth:`cleanup` (close every session and tracker).
Rollouts run on the scheduler's thread the whole time, so the engine keeps sampling while the trainer
trains; it only waits for a weight push.

Several processes (``accelerate launch`` / ``torchrun``: DDP, or FSDP) train one policy together. Rank 0
alone builds the session factory, runs the rollouts, talks to the engine and writes metrics and
checkpoints; each step it deals the micro-batches to every rank and decides when all stop
(:mod:`harness_trainer.trainer.distributed`). In one process everything runs as if it were alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from harness_trainer.engines import (
    EngineReplicas,
)
from harness_trainer.trainer.adapter_sync import AdapterFolders
from harness_trainer.trainer.checkpoint import (
    TrainerState,
    resolve_resume,
    save_checkpoint,
)
from harness_trainer.trainer.config.async_grpo import AsyncGRPOConfig
from harness_trainer.trainer.config.hub_names import repo_name
from harness_trainer.trainer.distributed import (
    Collective,
    GatheredModel,
    StepShare,
    checkpoint_parts,
    engine_state,
    prepare,
    savable_model,
    split_step,
)
from harness_trainer.trainer.engine_link import engine_client, engine_kind, push_with_retries
from harness_trainer.trainer.export import (
    HubError,
    create_repo,
    resolve_token,
    tokenizer_source,
    upload,
    write_model_folder,
)
from harness_trainer.trainer.feed.concurrency import AdaptiveConcurrency, ConcurrencyRule
from harness_trainer.trainer.feed.curriculum import PassRateCurriculum, PassRateRule
from harness_trainer.trainer.feed.evaluation import Evaluator, overlapping_tasks
from harness_trainer.trainer.feed.load_poller import ConcurrencyPoller
from harness_trainer.trainer.feed.rollout_log import RolloutLog
from harness_trainer.trainer.feed.rollout_records import RunStart, member_record, step_outcomes
from harness_trainer.trainer.feed.scheduling import RolloutScheduler, SchedulerConfig
from harness_trainer.trainer.fsdp2 import clip_grad_norm, map_large_allocations, no_sync, shards_itself
from harness_trainer.trainer.optim import build_optimizer
from harness_trainer.trainer.policy import Reference, is_peft, load_policy, vocab_size
from harness_trainer.trainer.reporting import MetricsReporter
from harness_trainer.trainer.step.batch import StepBatch, assemble, rollout_metrics
from harness_trainer.trainer.step.groups import Group, Rollout
from harness_trainer.trainer.step.logprobs import token_logprobs
from harness_trainer.trainer.step.loss import LossConfig, LossStats, policy_loss
from harness_trainer.trainer.step.outcome import HarnessRolloutOutcome
from harness_trainer.trainer.step.packing import MicroBatch, collate

logger = logging.getLogger(__name__)

# Consecutive groups without two scored members after which the run stops: every rollout failing is a
# setup problem (no sandbox, no engine), not something more rollouts fix.
MAX_CONSECUTIVE_DROPPED_GROUPS = 32


class WeightSyncError(RuntimeError):
    """The engine could not take the new weights after every retry; a checkpoint was written first."""


class NoLearningSignal(RuntimeError):
    """``max_zero_variance_groups_in_a_row`` groups in a row gave every member the same reward."""


class HarnessAsyncGRPOTrainer:
    """Train ``model`` by async GRPO on rollouts from ``harness_session_factory(sampling=...)``.

    Args:
        model: a path / hub name, or an ``nn.Module`` (a transformers causal LM).
        harness_session_factory: a factory *builder* (e.g. ``partial(HarborSessionFactory, url, ...)``),
            called once with ``sampling=`` the trainer's policy; its sessions follow OpenEnv's loop-owning
            protocol.
        args: the :class:`AsyncGRPOConfig`.
        train_dataset: rows (dicts, or a ``datasets.Dataset``) passed to ``factory.create``; default: the
            factory's ``prompt_rows()``.
        rollout_reward_fn: ``fn(HarnessRolloutOutcome) -> float | None``; default: the verifier's reward.
        peft_config: a peft config to train an adapter (or ``args.use_peft``).
        engine: an ``InferenceEngine`` to push weights to (default: made from ``args``).
        processing_class: the tokenizer :meth:`save_model` writes beside the model (TRL's name; default:
            ``AutoTokenizer.from_pretrained`` of ``model``'s path, Hub id or ``name_or_path``).
        eval_dataset: the rows to evaluate on (TRL's name; :mod:`.evaluation`), passed to the eval factory's
            ``create``; default: the eval factory's ``prompt_rows()`` (``args.eval_split``'s tasks).
        harness_adapter: white-box mode (issue 23): an OpenEnv ``HarnessAdapter`` (``MCPHarnessAdapter()``)
            that runs each rollout as ``run_white_box(model_step, session, limits)``, the trainer sampling
            each turn by token ids from ``args.vllm_server_base_url``. The builder must make an OpenEnv
            ``ResourceSessionFactory`` (e.g. ``partial(WhiteBoxSessionFactory, url)``) and is called without
            ``sampling=`` (``split=`` for eval as before); :mod:`harness_trainer.trainer.feed.whitebox`.
        harness_limits: OpenEnv's ``HarnessRunLimits`` for each white-box episode (turns, tool calls);
            default: OpenEnv's.

    Raises:
        ValueError: ``args`` asks for evaluation (``eval_steps``, ``eval_on_start``) with neither an
            ``eval_split`` nor an ``eval_dataset`` to evaluate on.
        TypeError: ``harness_adapter`` is no adapter, or the builder's factory is known not to make
            sessions with tools (not a ``ResourceSessionFactory``).
    """

    def __init__(
        self,
        model: str | nn.Module,
        harness_session_factory: Callable[..., Any],
        args: AsyncGRPOConfig | None = None,
        train_dataset: Any = None,
        rollout_reward_fn: Callable[[HarnessRolloutOutcome], float | None] | None = None,
        peft_config: Any = None,
        engine: Any = None,
        processing_class: Any = None,
        eval_dataset: Any = None,
        *,
        harness_adapter: Any = None,
        harness_limits: Any = None,
    ) -> None:
        if not callable(harness_session_factory):
            raise TypeError(
                "harness_session_factory must be a factory builder: partial(HarborSessionFactory, …)"
            )
        self.args = args or AsyncGRPOConfig()
        if self.args.evaluates and self.args.eval_split is None and eval_dataset is None:
            raise ValueError(
                "evaluation is on (eval_steps / eval_on_start) but there is nothing to evaluate on: set "
                "eval_split (the factory's split of eval tasks) or pass eval_dataset= to the trainer"
            )
        if harness_adapter is not None:
            from harness_trainer.trainer.feed.whitebox import check_white_box

            check_white_box(harness_adapter, harness_session_factory)
            if not self.args.vllm_server_base_url:
                raise ValueError("harness_adapter samples from the engine: set vllm_server_base_url")
        self.harness_adapter, self.harness_limits = harness_adapter, harness_limits
        self.eval_dataset = eval_dataset
        self.model_source = model
        self.factory_builder = harness_session_factory
        self.train_dataset = train_dataset
        self.rollout_reward_fn = rollout_reward_fn
        self.peft_config = peft_config
        self.engine = engine
        self.processing_class = processing_class
        self.state = TrainerState(step=0, groups_consumed=0, policy_version=0, rng={}, extra={})
        self.model: nn.Module | None = None
        """The policy itself (for LoRA, the PeftModel), trained in place."""
        self._trained: nn.Module | None = None  # the model as trained: its DDP or FSDP wrapper, or itself
        self.accelerator: Any = None
        self.collective = Collective(rank=0, world_size=1)
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: Any = None
        self.factory: Any = None
        self.scheduler: RolloutScheduler | None = None
        self.poller: ConcurrencyPoller | None = None
        """With ``adaptive_concurrency``: sets the scheduler's concurrency limit from the engines' load."""
        self.evaluator: Evaluator | None = None
        self._eval_factory: Any = None
        self.reporter: MetricsReporter | None = None
        self.rollout_log: RolloutLog | None = None
        self._dropped: list[Group] = []
        self._zero_variance: list[Group] = []  # the step's groups dropped for equal rewards (metrics)
        self.curriculum: PassRateCurriculum | None = None
        self.reference: Reference | None = None
        self.last_metrics: dict[str, float] = {}
        self.stop_reason: str | None = None
        """Why the run ended before ``max_steps`` on its own: ``"solved"`` (see :meth:`_take_groups`)."""
        self.trained_groups: list[int] = []
        self._stop = threading.Event()
        self._pushes = False
        self._adapter_folders: AdapterFolders | None = None
        self._policy: tuple[str, int] | None = None
        self._counters = {
            "rollout/unscorable_total": 0,
            "rollout/dropped_groups_total": 0,
            "rollout/zero_variance_dropped_total": 0,
        }

    @property
    def _adapter_sync(self) -> bool:
        """LoRA published as an adapter per version (vLLM loads it) instead of merged weights."""
        return self.args.use_peft and self.args.lora_sync == "adapter" and self.args.engine == "vllm"

    # -- setup ---------------------------------------------------------------------------------------

    def setup(self) -> None:
        """Build the policy, optimizer, engine client and factory; resume; start rolling out.

        Every rank builds and (on resume) restores the policy; rank 0 alone builds the engine client,
        the factory and the metrics reporter, and starts the rollouts.
        """
        from accelerate import Accelerator
        from transformers import get_scheduler

        args = self.args
        if args.engine == "auto":  # the kind decides the weight path: tell it before anything else
            args.engine = engine_kind(self.engine, args.vllm_server_base_url)
        _seed_everything(args.seed)
        self.accelerator = Accelerator(mixed_precision=args.mixed_precision)
        if args.fp16 and self.accelerator.device.type == "cpu":
            raise ValueError("fp16=True needs a GPU (float16 autocast, loss scaling): on CPU use bf16=True")
        args.check_processes(self.accelerator.num_processes)
        self.collective = Collective(self.accelerator.process_index, self.accelerator.num_processes)
        if args.push_to_hub:  # the token, tokenizer and repository of the final push, before training
            self._open_hub_repo(args.hub_token, args.hub_private_repo, args.hub_revision)
        self.output_dir = Path(args.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if shards_itself(self.accelerator):  # before the model is loaded: what FSDP2 frees goes back
            map_large_allocations()
        # On this rank's device before the reference copies it, so both sit where the forwards run.
        model = load_policy(self.model_source, args, self.peft_config).to(self.accelerator.device)
        model.train()
        self.reference = Reference(model) if args.loss.beta > 0 else None
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = build_optimizer(args.optim, params, args.learning_rate, args.weight_decay)
        self.lr_scheduler = get_scheduler(
            args.lr_scheduler_type, optimizer, num_warmup_steps=args.warmup_step_count,
            num_training_steps=args.max_steps,
        )  # fmt: skip
        self.loss_config: LossConfig = args.loss
        resume = resolve_resume(_resume_flag(args.resume_from_checkpoint), self.output_dir)
        self._trained, self.optimizer, resumed = prepare(
            self.accelerator, model, optimizer, self.lr_scheduler, resume
        )
        self.model = model
        if self.reference is not None and shards_itself(self.accelerator):
            self.reference.shard(self.accelerator.num_processes)
        if not self.collective.is_main:
            self.engine = None  # rank 0 alone talks to the engine
        elif self.engine is None and args.engine != "none":
            device = str(next(self.model.parameters()).device)
            self.engine = engine_client(args, adapter_sync=self._adapter_sync, device=device)
        self._pushes = self.collective.broadcast(self.engine is not None)
        if self._adapter_sync and self.engine is not None:
            if self.accelerator.num_processes > 1:
                raise ValueError("lora_sync='adapter' runs on one process; use lora_sync='merged' with FSDP")
            asyncio.run(self.engine.check_lora_rank(args.lora_r))
            self._adapter_folders = AdapterFolders(args.weight_sync_dir, keep=args.max_staleness + 1)
        if resumed is not None:
            self.state = resumed
            self._counters.update(resumed.extra.get("counters", {}))
            logger.info("resumed from %s at step %d", resume, self.state.step)
            self._push_weights()
        if self.collective.is_main:
            self._start_rollouts()

    def _start_rollouts(self) -> None:
        args = self.args
        assert self.model is not None
        self.factory = self._build_factory(args.sampling)
        if self.engine is not None and args.vllm_server_base_url and hasattr(self.factory, "check_engine"):
            self.factory.check_engine(args.vllm_server_base_url)  # rollouts and trainer on one model
        if self._policy is not None:  # an adapter pushed on resume, before the factory existed
            self._publish_policy(*self._policy)
        elif self._pushes:  # the version the engine serves now: the proxy stamps it on the first calls
            self._publish_version(self.state.policy_version)
        rows = self._rows()
        if args.evaluates:
            self.evaluator = self._make_evaluator(rows)
        if args.curriculum == "pass_rate":
            rule = PassRateRule(
                window=args.curriculum_window,
                pass_reward=args.pass_reward,
                retire_threshold=args.curriculum_retire_threshold,
                retired_weight=args.curriculum_retired_weight,
                unsolved_weight=args.curriculum_unsolved_weight,
            )
            self.curriculum = PassRateCurriculum(
                len(rows), rule, seed=args.seed, lag=args.admission_limit,
                state=self.state.extra.get("curriculum"), start=self.state.groups_consumed,
            )  # fmt: skip
        self.reporter = MetricsReporter(
            self.output_dir, args.report_to, run_name=args.run_name, config=args.to_dict(),
            project=args.project,
        )  # fmt: skip
        self.rollout_log = RolloutLog(self.output_dir)
        # What an earlier run wrote of the groups and steps this one does again is superseded by this line.
        self.rollout_log.write([RunStart(step=self.state.step, start_group=self.state.groups_consumed)])
        adaptive = None
        if args.adaptive_concurrency:
            assert args.max_concurrent_rollouts is not None  # resolved at construction
            rule = ConcurrencyRule(
                floor=args.min_concurrent_rollouts, ceiling=args.max_concurrent_rollouts,
                low_water=args.kv_cache_low_water, high_water=args.kv_cache_high_water,
            )  # fmt: skip
            # A resumed run starts where its checkpoint's limit was (clamped to this run's bounds).
            adaptive = AdaptiveConcurrency(rule, start=self.state.extra.get("concurrency_limit"))
        self.scheduler = RolloutScheduler(
            self.factory,
            rows,
            SchedulerConfig(
                num_generations=args.num_generations,
                max_concurrent_rollouts=args.max_concurrent_rollouts,
                admission_limit=args.admission_limit,
                agent_timeout=args.agent_timeout,
                seed=args.seed,
                shuffle=args.dataset_shuffle,
                vocab_size=vocab_size(self.model),
                temperature=args.temperature,
                max_unexpected_errors=args.max_unexpected_errors,
                concurrency_limit=adaptive.limit if adaptive is not None else None,
            ),
            reward_fn=self.rollout_reward_fn,
            policy_version=lambda: self.state.policy_version,
            start_group=self.state.groups_consumed,
            row_chooser=self.curriculum,
            on_rollout_done=self._log_rollout,
        )
        if args.eval_on_start and self.state.step == 0:  # a resumed run logged its start step already
            self._evaluate()
        self.scheduler.start()
        if adaptive is not None:
            assert args.vllm_server_base_url is not None  # the config refuses adaptive_concurrency without it
            self.poller = ConcurrencyPoller(
                [args.vllm_server_base_url, *args.vllm_replica_urls], adaptive, self.scheduler,
                interval_s=args.concurrency_poll_interval,
            )  # fmt: skip
            self.poller.start()

    def _build_factory(self, sampling: dict[str, Any], **kwargs: Any) -> Any:
        """The builder's factory; with a harness adapter, wrapped so each session is a white-box episode
        that samples under ``sampling`` (the builder then gets no ``sampling=``)."""
        if self.harness_adapter is None:
            return self.factory_builder(sampling=sampling, **kwargs)
        from harness_trainer.trainer.feed.whitebox import white_box_factory

        args = self.args
        assert args.vllm_server_base_url is not None  # checked at construction
        return white_box_factory(
            self.factory_builder(**kwargs), self.harness_adapter, tokenizer=self._tokenizer(),
            base_url=args.vllm_server_base_url, sampling=sampling,
            max_completion_length=args.max_completion_length, chat_template_kwargs=args.chat_template_kwargs,
            limits=self.harness_limits, policy_version=lambda: self.state.policy_version,
        )  # fmt: skip

    def _make_evaluator(self, train_rows: list[dict[str, Any]]) -> Evaluator:
        """The eval factory (the builder with the eval sampling and split) and its rows, checked."""
        args = self.args
        assert self.model is not None
        kwargs: dict[str, Any] = {} if args.eval_split is None else {"split": args.eval_split}
        self._eval_factory = self._build_factory(args.eval_sampling, **kwargs)
        if self._policy is not None and hasattr(self._eval_factory, "set_policy"):  # resumed on an adapter
            self._eval_factory.set_policy(*self._policy)
        if self.eval_dataset is not None:
            rows = [dict(row) for row in self.eval_dataset]
        elif hasattr(self._eval_factory, "prompt_rows"):
            rows = list(self._eval_factory.prompt_rows())
        else:
            raise ValueError("pass eval_dataset: the eval factory has no prompt_rows() to list its tasks")
        if overlap := overlapping_tasks(train_rows, rows):
            logger.warning(
                "%d eval task(s) have a training task's instruction, so they are not held out: %s",
                len(overlap), ", ".join(overlap),
            )  # fmt: skip
        assert args.max_concurrent_rollouts is not None  # resolved at construction
        return Evaluator(
            self._eval_factory, rows, k=args.eval_num_generations, seed=args.seed,
            temperature=args.eval_temperature, pass_reward=args.pass_reward,
            max_concurrent_rollouts=args.max_concurrent_rollouts, agent_timeout=args.agent_timeout,
            vocab_size=vocab_size(self.model), max_unexpected_errors=args.max_unexpected_errors,
            reward_fn=self.rollout_reward_fn, output_dir=self.output_dir, split=args.eval_split,
        )  # fmt: skip

    def _evaluate(self) -> dict[str, float]:
        """Rank 0: one evaluation at the weights the engine serves now; at step 0 (``eval_on_start``) its
        metrics are logged on their own line, later ones go with the step's. {} when the run is stopping."""
        assert self.evaluator is not None and self.reporter is not None
        evaluated = self.evaluator.evaluate(self.state.step, self.state.policy_version, self._stop)
        if evaluated is None:
            return {}
        metrics, _ = evaluated
        if self.state.step == 0:
            self.reporter.log(metrics, 0)
        return metrics

    def _rows(self) -> list[dict[str, Any]]:
        if self.train_dataset is None:
            if not hasattr(self.factory, "prompt_rows"):
                raise ValueError("pass train_dataset: the factory has no prompt_rows() to list its tasks")
            return list(self.factory.prompt_rows())
        return [dict(row) for row in self.train_dataset]

    # -- train ---------------------------------------------------------------------------------------

    def train(self) -> Any:
        """Run to ``max_steps`` or until stopped (SIGTERM, Ctrl-C); returns transformers' ``TrainOutput``.

        With ``push_to_hub``, a run that reached its end then pushes (:meth:`push_to_hub`), after every
        session is closed; a run stopped early is checkpointed but not pushed.

        Raises:
            HubError: the push at the end failed (the model stays in ``output_dir``).
        """
        from transformers.trainer_utils import TrainOutput

        previous = self._install_sigterm()
        ended = push = False
        try:
            self.setup()
            self._loop()
            ended = not self.stop_requested or self.args.steps_done(self.state.step)
        finally:
            try:
                self._save()
                # Rank 0 decides, and reaches this broadcast even when it raised, so no rank waits for it.
                push = self.args.push_to_hub and self.collective.broadcast(ended)
            finally:
                self.cleanup()
                if previous is not None:
                    signal.signal(signal.SIGTERM, previous)
        if push:
            self.push_to_hub()
        elif self.args.push_to_hub and self.collective.is_main:
            logger.warning(
                "the run stopped at step %d, before its end: not pushed to the Hub (the last checkpoint is "
                "in %s; trainer.push_to_hub() pushes the model as it is)",
                self.state.step,
                self.args.output_dir,
            )
        return TrainOutput(
            self.state.step, float(self.last_metrics.get("loss", 0.0)), dict(self.last_metrics)
        )

    def stop(self) -> None:
        """Ask the loop to stop after the current step (what SIGTERM does); on rank 0, every rank stops."""
        self._stop.set()

    @property
    def stop_requested(self) -> bool:
        """Whether :meth:`stop` was called or SIGTERM arrived: the run ends (or ended) before ``max_steps``
        unless the step in hand was the last."""
        return self._stop.is_set()

    def _loop(self) -> None:
        from tqdm.auto import tqdm

        args = self.args
        bar = tqdm(
            total=args.max_steps if args.max_steps > 0 else None, initial=self.state.step, desc="train",
            disable=args.disable_tqdm or not self.collective.is_main,
        )  # fmt: skip
        try:
            while not args.steps_done(self.state.step):
                started = time.monotonic()
                share = self.collective.deal(self._deal_step)
                if share is None:
                    break
                waited = time.monotonic() - started
                metrics = self._step(share)
                metrics["perf/wait_s"] = waited
                metrics["perf/step_s"] = time.monotonic() - started
                evaluated = self.evaluator is not None and args.should_evaluate(self.state.step)
                if evaluated:  # after the step's push: at the weights it made
                    metrics.update(self._evaluate())
                self.last_metrics = metrics
                if (args.should_log(self.state.step) or evaluated) and self.reporter is not None:
                    self.reporter.log(metrics, self.state.step)
                bar.update(1)
                live = self.scheduler.live_sessions() if self.scheduler is not None else 0
                bar.set_postfix(
                    reward=f"{metrics['reward']:.3f}", step_s=f"{metrics['perf/step_s']:.1f}", rollouts=live
                )
                if args.save_interval and self.state.step % args.save_interval == 0:
                    self._save()
            if self.stop_reason == "solved":
                self._evaluate_at_the_end()
        finally:
            bar.close()

    def _evaluate_at_the_end(self) -> None:
        """Rank 0, a run that ended before ``max_steps`` on its own: the evaluation its last step would
        have had, unless that step had one already."""
        args, step = self.args, self.state.step
        if self.evaluator is None or args.should_evaluate(step) or (step == 0 and args.eval_on_start):
            return
        metrics = self._evaluate()
        if metrics and step > 0 and self.reporter is not None:
            self.reporter.log(metrics, step)

    def _take_groups(self) -> list[Group] | None:
        """The next ``groups_per_step`` groups with at least two scored members, in admission order; with
        ``drop_zero_variance_groups``, only groups whose scored members' rewards differ.

        Every group dropped is replaced by the next one. That stays within the staleness bound: a step
        that drops groups takes more than ``groups_per_step`` of them, so fewer policy versions pass
        between a group's admission (bounded by the scheduler's admission limit) and its training.

        None when the run stops: asked to, or ``max_zero_variance_groups_in_a_row`` groups in a row were
        dropped with every scored member passing (``pass_reward``): the policy has solved what it trains on,
        and the run ends as at ``max_steps`` (``stop_reason`` ``"solved"``).

        Raises:
            RuntimeError: ``MAX_CONSECUTIVE_DROPPED_GROUPS`` groups in a row had fewer than two scored
                members.
            NoLearningSignal: ``max_zero_variance_groups_in_a_row`` groups in a row were dropped for equal
                rewards, not all of them passing.
        """
        assert self.scheduler is not None
        taken: list[Group] = []
        dropped_in_a_row = zero_variance_in_a_row = 0
        while len(taken) < self.args.groups_per_step:
            if self._stop.is_set():
                return None
            group = self.scheduler.next_group(timeout=0.5)
            if group is None:
                continue
            if len(group.scored) < 2:
                self._note_dropped(group)
                self._dropped.append(group)
                dropped_in_a_row += 1
                if dropped_in_a_row >= MAX_CONSECUTIVE_DROPPED_GROUPS:
                    reasons = sorted({r.unscorable or "ungraded" for r in group.rollouts})
                    raise RuntimeError(
                        f"{dropped_in_a_row} groups in a row had fewer than two scored rollouts; the last "
                        f"one's rollouts failed with: {reasons}"
                    )
                continue
            dropped_in_a_row = 0
            if self.args.drop_zero_variance_groups and _zero_variance(group):
                self._dropped.append(group)
                self._zero_variance.append(group)
                zero_variance_in_a_row += 1
                if zero_variance_in_a_row >= self.args.max_zero_variance_groups_in_a_row:
                    streak = self._zero_variance[-zero_variance_in_a_row:]
                    if not _all_passed(streak, self.args.pass_reward):
                        raise NoLearningSignal(_no_signal_message(streak, self.args.curriculum))
                    # The policy passes every task it draws: the run is done, not broken.
                    self.stop_reason = "solved"
                    logger.warning(_solved_message(streak, self.state.step, self.args.max_steps))
                    return None
                continue
            taken.append(group)
            zero_variance_in_a_row = 0
        return taken

    def _log_rollout(self, group: Group, rollout: Rollout) -> None:
        """The scheduler's threads: a finished rollout to rollouts.jsonl, its trace when
        ``rollout_log_steps`` keeps its group's (the groups that would train at every N-th step were none
        dropped)."""
        if self.rollout_log is None:
            return
        every = self.args.rollout_log_steps
        with_trace = bool(every) and (group.index // self.args.groups_per_step + 1) % every == 0
        self.rollout_log.write([member_record(group, rollout, with_trace=with_trace)])

    def _log_rollouts(self, dropped: list[Group], groups: list[Group], batch: StepBatch) -> None:
        """Rank 0: what the step did with each rollout of the groups it took (trained with an advantage, or
        why not) to rollouts.jsonl; the rollouts themselves were written as they finished."""
        if self.rollout_log is None:
            return
        trained = {(r.group, r.member): batch.advantages[i] for i, r in enumerate(batch.rollouts)}
        self.rollout_log.write(step_outcomes(self.state.step + 1, dropped, groups, trained))

    def _note_dropped(self, group: Group) -> None:
        self._counters["rollout/dropped_groups_total"] += 1
        self._counters["rollout/unscorable_total"] += sum(r.unscorable is not None for r in group.rollouts)
        logger.warning(
            "group %d dropped: %d of %d rollouts scored",
            group.index, len(group.scored), len(group.rollouts),
        )  # fmt: skip

    def _deal_step(self) -> list[StepShare] | None:
        """Rank 0: the next groups as rows, advantages and metrics, a share per rank; None to stop."""
        assert self.scheduler is not None
        args = self.args
        if self._stop.is_set() or args.epochs_done(self.scheduler.next_to_take, len(self.scheduler.rows)):
            return None
        if self.curriculum is not None:  # every earlier step is done: no resume goes back before it
            self.curriculum.settle(self.state.groups_consumed)
        groups = self._take_groups()
        if groups is None:
            return None
        # Over the groups dropped for equal rewards too, so reward and frac_reward_zero_std read the same
        # whether they are dropped or not.
        metrics = rollout_metrics(
            [*self._zero_variance, *groups], policy_version=self.state.policy_version,
            reward_name=_reward_name(self.rollout_reward_fn),
        )  # fmt: skip
        self.trained_groups.extend(group.index for group in groups)
        batch = assemble(
            groups, advantage_epsilon=args.loss.advantage_epsilon, keep_zero_advantage=args.loss.beta > 0,
            normalization=args.loss.loss_normalization,
        )  # fmt: skip
        self._log_rollouts(self._dropped, groups, batch)
        if args.log_completions and args.should_log(self.state.step + 1):
            from tqdm.auto import tqdm

            tqdm.write(completions_text(batch, self.state.step + 1, args.num_completions_to_print))
        self._dropped.clear()
        self._counters["rollout/unscorable_total"] += int(metrics["rollout/unscorable"])
        self._counters["rollout/zero_variance_dropped_total"] += len(self._zero_variance)
        metrics.update(self._counters)
        if self.curriculum is not None:
            metrics.update(self.curriculum.summary())
        if self.poller is not None:
            metrics.update(self.poller.metrics())
        metrics.update({
            "rollout/zero_variance_dropped": float(len(self._zero_variance)),
            "rollout/dropped_groups": float(batch.dropped_groups),
            "num_tokens": float(batch.trained_tokens),
            "epoch": self.scheduler.next_to_take / max(len(self.scheduler.rows), 1),
        })  # fmt: skip
        self._zero_variance.clear()
        return split_step(
            batch, token_budget=args.token_budget, world_size=self.collective.world_size, metrics=metrics,
            groups_consumed=self.scheduler.next_to_take,
        )  # fmt: skip

    def _step(self, share: StepShare) -> dict[str, float]:
        trained = time.monotonic()
        loss_metrics, forwarded = self._optimize(share)
        train_s = time.monotonic() - trained
        self.state.step += 1
        self.state.groups_consumed = share.groups_consumed
        sync_s = 0.0
        if self.state.step % self.args.weight_sync_steps == 0:
            sync_s = self._push_weights(version=self.state.step)
        metrics = dict(share.metrics)
        metrics.update(loss_metrics)
        metrics.update({
            "learning_rate": float(self.lr_scheduler.get_last_lr()[0]),
            "perf/train_s": train_s,
            "perf/tokens_per_s": forwarded / train_s if train_s > 0 else 0.0,
            "perf/weight_sync_s": sync_s,
            "policy_version": float(self.state.policy_version),
        })  # fmt: skip
        if isinstance(self.engine, EngineReplicas):
            metrics["engine/replicas_out"] = float(len(self.engine.out_of_rotation))
        if len(servers := getattr(self.factory, "servers_report", list)()) > 1:  # several rollout servers
            metrics["rollout/servers_down"] = float(sum(not server["up"] for server in servers))
            metrics["rollout/server_lost_total"] = float(sum(server["lost"] for server in servers))
        return metrics

    def _optimize(self, share: StepShare) -> tuple[dict[str, float], int]:
        """One optimizer step: backward on this rank's micro-batches, gradients averaged across ranks at
        the last one, stats summed across ranks, clip, step."""
        assert self._trained is not None and self.optimizer is not None and self.model is not None
        args = self.args
        total, forwarded = LossStats(), 0
        device = next(self.model.parameters()).device
        last = len(share.micro_batches) - 1
        for i, plan in enumerate(share.micro_batches):
            micro = collate(plan.rows, share.advantages, share.weights).to(device)
            if plan.padding:
                micro.token_weights.zero_()
            with no_sync(self.accelerator, self._trained) if i < last else contextlib.nullcontext():
                stats = self._backward(micro)
            if not plan.padding:
                total = total.merge(stats)
                forwarded += micro.n_tokens
        total, forwarded = self.collective.sum_stats(total, forwarded)
        grad_norm = 0.0
        if share.micro_batches:  # as many on every rank, so every rank steps or none does
            # An infinite max norm measures without clipping (the gradients are scaled by exactly 1).
            max_norm = args.max_grad_norm if args.max_grad_norm > 0 else math.inf
            grad_norm = clip_grad_norm(self.accelerator, self._trained, max_norm)
            # fp16: the loss scaler itself skips a step whose gradients overflowed, and lowers its scale.
            if not math.isfinite(grad_norm) and not args.fp16:
                logger.warning(
                    "non-finite gradient norm at step %d; the update is skipped", self.state.step + 1
                )
                self.optimizer.zero_grad(set_to_none=True)
            else:
                self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics = total.metrics() if share.micro_batches else {}
        metrics.setdefault("loss", 0.0)
        metrics["grad_norm"] = grad_norm
        return metrics, forwarded

    def _backward(self, micro: MicroBatch) -> LossStats:
        assert self._trained is not None
        args = self.args
        logps, entropy = token_logprobs(self._trained, micro, args.temperature, targets_only=True)
        ref_logps = None
        if self.reference is not None:
            with torch.no_grad(), self.reference.model() as reference, self.accelerator.autocast():
                ref_logps, _ = token_logprobs(
                    reference, micro, args.temperature, with_entropy=False, targets_only=True
                )
        loss, stats = policy_loss(logps, micro, self.loss_config, ref_logps=ref_logps, entropy=entropy)
        # The backend averages gradients over ranks; the step's gradient is their sum.
        self.accelerator.backward(loss * self.collective.world_size)
        return stats

    # -- weights, checkpoints, cleanup ---------------------------------------------------------------

    def _push_weights(self, version: int | None = None) -> float:
        """Pause the engine, push the weights as ``version``, resume; seconds spent. Retries, then stops.

        Rank 0 pushes (the weights gathered first under FSDP); the other ranks wait for its outcome.
        """
        version = self.state.step if version is None else version
        if not self._pushes:
            self.state.policy_version = version
            return 0.0
        assert self._trained is not None and self.model is not None
        started = time.monotonic()
        if self._adapter_folders is not None:
            payload: Any = self._adapter_folders.save(self.model, version)
        else:
            payload = engine_state(self.accelerator, self._trained, self.model)
        served, error = (
            push_with_retries(self.engine, payload, version, self.args.weight_sync_retries)
            if payload is not None
            else (None, None)
        )
        if self._adapter_folders is not None:
            if served is None:
                self._adapter_folders.discard(payload)
            else:
                self._adapter_folders.served(payload)
                self._publish_policy(self.engine.adapter_name(served), served)
        elif served is not None:
            self._publish_version(served)
        served = self.collective.broadcast(served)
        if served is None:
            self._save()
            raise WeightSyncError(
                f"the engine did not take weights version {version} after {self.args.weight_sync_retries} "
                f"attempts ({error or 'see rank 0'}); a checkpoint of step {self.state.step} is in "
                f"{self.output_dir}"
            ) from error
        self.state.policy_version = served
        return time.monotonic() - started

    def _publish_policy(self, model: str, version: int) -> None:
        """Send the rollouts' later model calls to served model ``model`` (``version``'s adapter)."""
        self._policy = (model, version)
        if self.factory is not None:
            if not hasattr(self.factory, "set_policy"):
                raise ValueError(
                    f"lora_sync='adapter' needs a session factory with set_policy(model, version) to move "
                    f"the rollouts to each new adapter; {type(self.factory).__name__} has none: use "
                    "lora_sync='merged'"
                )
            self.factory.set_policy(model, version)
        # Evaluation samples the current policy too: its own factory (a white-box wrapper, an in-process
        # proxy) is told as well; on a shared rollout server the second call changes nothing.
        if self._eval_factory is not None and hasattr(self._eval_factory, "set_policy"):
            self._eval_factory.set_policy(model, version)

    def _publish_version(self, version: int) -> None:
        """Tell the rollouts' capture proxy that the engine now serves ``version`` (weights pushed in place,
        the served model unchanged), so it stamps each later model call with the version it was sent at. A
        factory without ``set_policy_version`` leaves the calls unstamped: staleness then counts from each
        rollout's start."""
        if self.factory is not None and hasattr(self.factory, "set_policy_version"):
            self.factory.set_policy_version(version)

    def _save(self) -> Path | None:
        """Write ``checkpoint-{step}`` on rank 0 (every rank takes part: FSDP gathers); its path there."""
        if self._trained is None or self.model is None or self.optimizer is None or self.state.step == 0:
            return None
        path = self.output_dir / f"checkpoint-{self.state.step}"
        if self.collective.broadcast(self.collective.is_main and path.exists()):
            return path if self.collective.is_main else None
        self.state.extra = {"config": self.args.to_dict(), "counters": dict(self._counters)}
        if isinstance(self.model_source, str | Path):  # what `harness-trainer eval` takes a tokenizer from
            self.state.extra["model"] = str(self.model_source)
        if self.curriculum is not None:
            self.state.extra["curriculum"] = self.curriculum.state_dict(self.state.groups_consumed)
        if self.poller is not None:  # rank 0 only, which alone writes the state
            self.state.extra["concurrency_limit"] = self.poller.limit
        model, optimizer = checkpoint_parts(self.accelerator, self._trained, self.model, self.optimizer)
        if not self.collective.is_main:
            return None
        return save_checkpoint(
            self.output_dir, self.state, model, optimizer, self.lr_scheduler,
            save_total_limit=self.args.save_total_limit,
        )  # fmt: skip

    def save_model(self, output_dir: str | Path | None = None) -> None:
        """Save the policy for ``from_pretrained`` and vLLM into ``output_dir`` (default ``args.output_dir``):
        config, weights, generation config, tokenizer and chat template; for LoRA, the adapter, or the
        merged model with ``lora_save="merged"`` (:mod:`.export` lists the files). With several processes,
        call it on every rank: rank 0 writes (under FSDP, what the ranks gathered)."""
        self._save_model(output_dir)

    def _save_model(self, output_dir: str | Path | None) -> tuple[Path, list[str]] | None:
        """Rank 0: the folder and the files written; None elsewhere."""
        assert self._trained is not None and self.model is not None, "save_model needs setup() or train()"
        folder = Path(self.args.output_dir if output_dir is None else output_dir)
        if is_peft(self.model) and self.args.lora_save == "merged":
            weights = engine_state(self.accelerator, self._trained, self.model)  # the engine's merged weights
            model = GatheredModel(self.model.get_base_model(), weights) if weights is not None else None
        else:
            model = savable_model(self.accelerator, self._trained, self.model)
        if not self.collective.is_main:
            return None
        return folder, write_model_folder(model, self._tokenizer(), folder)

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        private: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        """:meth:`save_model` into ``args.output_dir``, then upload the files it wrote to ``hub_model_id``
        (default: ``output_dir``'s folder name), created if missing: transformers' ``Trainer.push_to_hub``.

        ``token``, ``revision`` (a branch, created from main if missing) and ``private`` default to
        ``hub_token``, ``hub_revision`` and ``hub_private_repo``. ``kwargs`` are transformers' model card
        arguments: no model card is written here, so they are logged and ignored. With several processes,
        call it on every rank; rank 0 uploads.

        Returns:
            On rank 0, huggingface_hub's ``CommitInfo`` (with ``blocking=False``, a ``Future`` of it); None
            on the other ranks.

        Raises:
            HubError: no token, the Hub refused the repository, or the upload failed.
        """
        assert self._trained is not None and self.model is not None, "push_to_hub needs setup() or train()"
        if kwargs:
            logger.warning("push_to_hub writes no model card: %s ignored", ", ".join(sorted(kwargs)))
        args = self.args
        token = token if token is not None else args.hub_token
        revision = revision if revision is not None else args.hub_revision
        private = private if private is not None else args.hub_private_repo
        repo = self._open_hub_repo(token, private, revision)
        saved = self._save_model(None)
        if saved is None or repo is None:
            return None
        repo_id, token = repo
        return upload(
            repo_id, *saved, token=token, revision=revision, commit_message=commit_message, blocking=blocking
        )

    def _open_hub_repo(
        self, token: str | None, private: bool | None, revision: str | None
    ) -> tuple[str, str] | None:
        """Rank 0: the token, the tokenizer, the repository (created if missing): its id and the token; None
        on the other ranks. A failure on rank 0 is raised on every rank (they would wait for it)."""
        found: tuple[str, str] | None = None
        error: Exception | None = None
        if self.collective.is_main:
            # Any failure here must reach the other ranks, or they wait for rank 0 in the next collective.
            try:
                found_token = resolve_token(token)
                self._tokenizer()
                name = repo_name(self.args.hub_model_id, str(self.args.output_dir))
                found = create_repo(name, token=found_token, private=private, revision=revision), found_token
            except Exception as exc:
                error = exc
        failed = self.collective.broadcast(None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        if failed is not None:
            raise HubError(f"rank 0 could not open the Hub repository: {failed}")
        return found

    def _tokenizer(self) -> Any:
        """The tokenizer saved with the model: ``processing_class``, loaded once from the model's source."""
        if self.processing_class is None:
            source = tokenizer_source(self.model_source)
            if source is None:
                raise ValueError(
                    "save_model writes the tokenizer beside the model, and the model was given as a module "
                    "that names no folder or Hub id (name_or_path): pass processing_class= to the trainer"
                )
            from transformers import AutoTokenizer

            self.processing_class = AutoTokenizer.from_pretrained(source)
        return self.processing_class

    def cleanup(self) -> None:
        """Close every session, the factory, the trackers, the engine client's weight files. Safe to call
        more than once."""
        if self.poller is not None:  # before the scheduler it steers stops
            self.poller.stop()
            self.poller = None
        if self.scheduler is not None:
            self.scheduler.stop()
        _close_factory(self.factory, "session factory")
        self.factory = None
        _close_factory(self._eval_factory, "eval session factory")
        self._eval_factory = None
        if self.reporter is not None:
            self.reporter.close()
        if self.rollout_log is not None:
            if self._dropped:  # taken and dropped by a step that never came: their reason is known
                self._log_rollouts(self._dropped, [], StepBatch())
                self._dropped.clear()
            self.rollout_log.close()
        # The weight files in /dev/shm (vLLM holds what it loaded in its own memory).
        if self.engine is not None and hasattr(self.engine, "close"):
            self.engine.close()
        if self._adapter_folders is not None:
            self._adapter_folders.close()

    def _install_sigterm(self) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return None

        def on_sigterm(signum: int, frame: Any) -> None:
            logger.warning("SIGTERM: checkpointing and closing every session")
            self._stop.set()

        return signal.signal(signal.SIGTERM, on_sigterm)


def completions_text(batch: StepBatch, step: int, limit: int | None) -> str:
    """What ``log_completions`` prints for a step: each trained rollout's group and member, reward, advantage
    and final reply (its last 200 characters), at most ``limit`` of them (None: all)."""
    shown = list(enumerate(batch.rollouts))[:limit]
    lines = [f"step {step}: {len(shown)} of {len(batch.rollouts)} trained rollouts"]
    for i, rollout in shown:
        completion = rollout.outcome.completion if rollout.outcome is not None else []
        reply = str(completion[-1].get("content") or "") if completion else ""
        lines.append(
            f"  group {rollout.group} member {rollout.member}: reward {rollout.reward}, "
            f"advantage {batch.advantages[i]:+.3f}, reply {reply[-200:]!r}"
        )
    return "\n".join(lines)


def _no_signal_message(groups: list[Group], curriculum: str) -> str:
    """Why the run stops after ``groups``, dropped in a row for equal rewards."""
    rewards = sorted({r.reward for g in groups for r in g.scored if r.reward is not None})
    remedy = (
        "other tasks"
        if curriculum != "none"
        else "curriculum='pass_rate' (it retires solved tasks), other tasks"
    )
    return (
        f"{len(groups)} groups in a row gave each of their scored rollouts the same reward (rewards seen: "
        f"{rewards}), so none had an advantage to train on (max_zero_variance_groups_in_a_row): the tasks "
        f"are all solved, or all too hard, for this policy. Use {remedy}, or drop_zero_variance_groups=False "
        "to train on such groups anyway"
    )


def _all_passed(groups: list[Group], pass_reward: float) -> bool:
    """Whether every scored rollout of ``groups`` passed (reward at least ``pass_reward``)."""
    return all(r.reward is not None and r.reward >= pass_reward for g in groups for r in g.scored)


def _solved_message(groups: list[Group], step: int, max_steps: int) -> str:
    """Why the run ends at ``step``: ``groups``, dropped in a row, all passed."""
    rewards = sorted({r.reward for g in groups for r in g.scored if r.reward is not None})
    return (
        f"stopping at step {step} of {max_steps}: the training set is solved ({len(groups)} groups in a row "
        f"passed every scored rollout, rewards {rewards}; max_zero_variance_groups_in_a_row), so no group "
        "has an advantage left to train on. Harder tasks, or curriculum='pass_rate' with more of them, give "
        "the policy more to learn"
    )


def _zero_variance(group: Group) -> bool:
    """Whether the group's scored members (two or more) all got the same reward: advantages all 0."""
    rewards = [r.reward for r in group.scored]
    return len(rewards) >= 2 and all(reward == rewards[0] for reward in rewards)


def _close_factory(factory: Any, what: str) -> None:
    """Close ``factory`` (if any, and if it closes); a failure is logged, so cleanup goes on."""
    if factory is not None and hasattr(factory, "close"):
        try:
            factory.close()
        except Exception:
            logger.warning("closing the %s failed", what, exc_info=True)


def _resume_flag(value: str | None) -> bool | str | None:
    if value in ("latest", "true", "True"):
        return True
    return value


def _reward_name(fn: Callable[..., Any] | None) -> str | None:
    return getattr(fn, "__name__", type(fn).__name__) if fn is not None else None


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
