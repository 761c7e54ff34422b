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

import logging
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

from harness_trainer.engines.kinds import syncs_adapters
from harness_trainer.engines.replicas import EngineReplicas
from harness_trainer.trainer.checkpoint import TrainerState
from harness_trainer.trainer.config.async_grpo import AsyncGRPOConfig
from harness_trainer.trainer.distributed import Collective, StepShare, make_accelerator
from harness_trainer.trainer.engine_link import engine_client, engine_kind
from harness_trainer.trainer.export import upload
from harness_trainer.trainer.feed.load_poller import ConcurrencyPoller
from harness_trainer.trainer.feed.scheduling import RolloutScheduler
from harness_trainer.trainer.optimize import OptimizerStep, prepare_training
from harness_trainer.trainer.policy import Reference, vocab_size
from harness_trainer.trainer.publish import PolicyPublisher, make_publisher
from harness_trainer.trainer.rollout_feed import RolloutFeed, check_rollout_arguments
from harness_trainer.trainer.saving import load_tokenizer, open_hub_repo, save_model_folder, write_checkpoint
from harness_trainer.trainer.step.groups import Group, Rollout
from harness_trainer.trainer.step.outcome import HarnessRolloutOutcome

logger = logging.getLogger(__name__)


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
        self.args = args or AsyncGRPOConfig()
        check_rollout_arguments(harness_session_factory, self.args, eval_dataset, harness_adapter)
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
        self.reference: Reference | None = None
        self._optimizer_step: OptimizerStep | None = None
        self._publisher: PolicyPublisher | None = None  # every rank, when an engine takes the weights
        self._feed: RolloutFeed | None = None  # rank 0: the rollouts, evaluation, metrics and logs
        self.last_metrics: dict[str, float] = {}
        self.stop_reason: str | None = None
        """Why the run ended before ``max_steps`` on its own: ``"solved"`` (see :meth:`.StepGroups.take`)."""
        self.trained_groups: list[int] = []
        self._stop = threading.Event()
        self._counters = {
            "rollout/unscorable_total": 0,
            "rollout/dropped_groups_total": 0,
            "rollout/zero_variance_dropped_total": 0,
        }

    @property
    def _adapter_sync(self) -> bool:
        """LoRA published as an adapter per version (vLLM loads it) instead of merged weights."""
        return self.args.use_peft and self.args.lora_sync == "adapter" and syncs_adapters(self.args.engine)

    @property
    def scheduler(self) -> RolloutScheduler | None:
        """Rank 0, once set up: the scheduler rolling out on its own thread."""
        return self._feed.scheduler if self._feed is not None else None

    @property
    def poller(self) -> ConcurrencyPoller | None:
        """With ``adaptive_concurrency``, until cleanup: sets the scheduler's concurrency limit from the
        engines' load."""
        return self._feed.poller if self._feed is not None else None

    # -- setup ---------------------------------------------------------------------------------------

    def setup(self) -> None:
        """Build the policy, optimizer, engine client and factory; resume; start rolling out.

        Every rank builds and (on resume) restores the policy; rank 0 alone builds the engine client,
        the factory and the metrics reporter, and starts the rollouts.
        """
        args = self.args
        if args.engine == "auto":  # the kind decides the weight path: tell it before anything else
            args.engine = engine_kind(self.engine, args.vllm_server_base_url)
        _seed_everything(args.seed)
        self.accelerator = make_accelerator(args.mixed_precision)
        if args.fp16 and self.accelerator.device.type == "cpu":
            raise ValueError("fp16=True needs a GPU (float16 autocast, loss scaling): on CPU use bf16=True")
        args.check_processes(self.accelerator.num_processes)
        self.collective = Collective(self.accelerator.process_index, self.accelerator.num_processes)
        if args.push_to_hub:  # the token, tokenizer and repository of the final push, before training
            open_hub_repo(
                self.collective, args, token=args.hub_token, private=args.hub_private_repo,
                revision=args.hub_revision, tokenizer=self._tokenizer,
            )  # fmt: skip
        self.output_dir = Path(args.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._optimizer_step, resumed, resume = prepare_training(
            self.model_source, args, self.peft_config, self.accelerator, self.collective, self.output_dir
        )
        step = self._optimizer_step
        self.model, self._trained, self.reference = step.model, step.trained, step.reference
        self.optimizer, self.lr_scheduler = step.optimizer, step.lr_scheduler
        if not self.collective.is_main:
            self.engine = None  # rank 0 alone talks to the engine
        elif self.engine is None and args.engine != "none":
            device = str(next(self.model.parameters()).device)
            self.engine = engine_client(args, adapter_sync=self._adapter_sync, device=device)
        self._publisher = make_publisher(
            self.engine, args, self.accelerator, self.collective, adapter_sync=self._adapter_sync,
            output_dir=self.output_dir, checkpoint=self._save,
        )  # fmt: skip
        if resumed is not None:
            self.state = resumed
            self._counters.update(resumed.extra.get("counters", {}))
            logger.info("resumed from %s at step %d", resume, self.state.step)
            self._push_weights()
        if self.collective.is_main:
            self._feed = RolloutFeed(
                self.factory_builder, args, train_dataset=self.train_dataset, eval_dataset=self.eval_dataset,
                reward_fn=self.rollout_reward_fn, harness_adapter=self.harness_adapter,
                harness_limits=self.harness_limits, tokenizer=self._tokenizer,
                policy_version=lambda: self.state.policy_version, output_dir=self.output_dir,
            )  # fmt: skip
            self._feed.start(
                self.state, vocab_size=vocab_size(step.model), publisher=self._publisher,
                check_engine=self.engine is not None, on_rollout_done=self._log_rollout, stop=self._stop,
                counters=self._counters, trained_groups=self.trained_groups,
                world_size=self.collective.world_size,
            )  # fmt: skip

    # -- train ---------------------------------------------------------------------------------------

    def train(self) -> Any:
        """Run to ``max_steps`` or until stopped (SIGTERM, Ctrl-C); returns transformers' ``TrainOutput``.

        With ``push_to_hub``, a run that reached its end then pushes (:meth:`push_to_hub`), after every
        session is closed; a run stopped early is checkpointed but not pushed.

        Raises:
            HubError: the push at the end failed (the model stays in ``output_dir``).
        """
        from transformers.trainer_utils import TrainOutput

        previous = _install_sigterm(self._stop)
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

        args, feed = self.args, self._feed  # the feed is rank 0's; None on the other ranks
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
                if feed is not None:
                    feed.step_done()
                metrics["perf/wait_s"] = waited
                metrics["perf/step_s"] = time.monotonic() - started
                # The share of the step the trainer was ready but no group was complete.
                metrics["perf/trainer_wait_frac"] = waited / metrics["perf/step_s"]
                live = feed.live_sessions() if feed is not None else 0
                metrics["rollout/in_flight"] = float(live)
                evaluated = feed is not None and feed.evaluates(self.state.step)
                if evaluated:  # after the step's push: at the weights it made
                    metrics.update(feed.evaluate(self.state, self._stop))
                self.last_metrics = metrics
                if (args.should_log(self.state.step) or evaluated) and feed is not None:
                    feed.log(metrics, self.state.step)
                bar.update(1)
                bar.set_postfix(
                    reward=f"{metrics['reward']:.3f}", step_s=f"{metrics['perf/step_s']:.1f}", rollouts=live
                )
                if args.save_interval and self.state.step % args.save_interval == 0:
                    self._save()
            if self.stop_reason == "solved" and feed is not None:
                feed.evaluate_at_the_end(self.state, self._stop)
        finally:
            bar.close()

    def _log_rollout(self, group: Group, rollout: Rollout) -> None:
        """The scheduler's threads: each finished rollout to rollouts.jsonl
        (:meth:`.RolloutFeed.log_rollout`)."""
        if self._feed is not None:
            self._feed.log_rollout(group, rollout)

    def _deal_step(self) -> list[StepShare] | None:
        """Rank 0: the next groups as rows, advantages and metrics, a share per rank; None to stop."""
        assert self._feed is not None and self._feed.groups is not None
        shares = self._feed.groups.deal(self._stop, self.state)
        self.stop_reason = self._feed.groups.stop_reason
        return shares

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
            "perf/forwarded_tokens": float(forwarded),
            "perf/trained_tokens_per_s": share.metrics.get("num_tokens", 0.0) / max(train_s, 1e-9),
            "perf/weight_sync_s": sync_s,
            "policy_version": float(self.state.policy_version),
        })  # fmt: skip
        if sync_s and (paused := getattr(self.engine, "last_pause_s", None)) is not None:
            metrics["perf/engine_pause_s"] = paused  # the part of the push the engine stood still
        if isinstance(self.engine, EngineReplicas):
            metrics["engine/replicas_out"] = float(len(self.engine.out_of_rotation))
        if self._feed is not None:
            metrics.update(self._feed.server_metrics())
        return metrics

    def _optimize(self, share: StepShare) -> tuple[dict[str, float], int]:
        """One optimizer step on this rank's share (:class:`.OptimizerStep`): its loss metrics and the
        tokens forwarded on every rank."""
        assert self._optimizer_step is not None
        return self._optimizer_step(share, self.state.step)

    # -- weights, checkpoints, cleanup ---------------------------------------------------------------

    def _push_weights(self, version: int | None = None) -> float:
        """Pause the engine, push the weights as ``version``, resume; seconds spent. Retries, then stops
        (:meth:`.PolicyPublisher.push`).

        Rank 0 pushes (the weights gathered first under FSDP); the other ranks wait for its outcome.
        """
        version = self.state.step if version is None else version
        if self._publisher is None:
            self.state.policy_version = version
            return 0.0
        assert self._trained is not None and self.model is not None
        started = time.monotonic()
        self.state.policy_version = self._publisher.push(self._trained, self.model, version, self.state.step)
        return time.monotonic() - started

    def _save(self) -> Path | None:
        """Write ``checkpoint-{step}`` on rank 0 (every rank takes part: FSDP gathers); its path there."""
        if self._trained is None or self.model is None or self.optimizer is None or self.state.step == 0:
            return None
        feed = self._feed
        return write_checkpoint(
            self.accelerator, self.collective, self._trained, self.model, self.optimizer, self.lr_scheduler,
            state=self.state, output_dir=self.output_dir, args=self.args, counters=self._counters,
            model_source=self.model_source, curriculum=feed.curriculum if feed is not None else None,
            poller=feed.poller if feed is not None else None,
            coverage=feed.groups.coverage if feed is not None and feed.groups is not None else None,
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
        return save_model_folder(
            self.accelerator, self.collective, self._trained, self.model, folder,
            merged=self.args.lora_save == "merged", tokenizer=self._tokenizer,
        )  # fmt: skip

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
        repo = open_hub_repo(
            self.collective, args, token=token, private=private, revision=revision, tokenizer=self._tokenizer
        )
        saved = self._save_model(None)
        if saved is None or repo is None:
            return None
        repo_id, token = repo
        return upload(
            repo_id, *saved, token=token, revision=revision, commit_message=commit_message, blocking=blocking
        )

    def _tokenizer(self) -> Any:
        """The tokenizer saved with the model: ``processing_class``, loaded once from the model's source."""
        if self.processing_class is None:
            self.processing_class = load_tokenizer(self.model_source)
        return self.processing_class

    def cleanup(self) -> None:
        """Close every session, the factory, the trackers, the engine client's weight files. Safe to call
        more than once."""
        if self._feed is not None:
            self._feed.close(self.state.step)
        # The weight files in /dev/shm (vLLM holds what it loaded in its own memory).
        if self.engine is not None and hasattr(self.engine, "close"):
            self.engine.close()
        if self._publisher is not None:
            self._publisher.close()


def _install_sigterm(stop: threading.Event) -> Any:
    """On the main thread: SIGTERM sets ``stop``; the handler it replaces (None elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def on_sigterm(signum: int, frame: Any) -> None:
        logger.warning("SIGTERM: checkpointing and closing every session")
        stop.set()

    return signal.signal(signal.SIGTERM, on_sigterm)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
