"""``HarnessAsyncGRPOTrainer``: async GRPO on the captured behaviour of black-box agents.

The loop is visible: :meth:`setup` (policy, optimizer, engine, sessions, resume), :meth:`train` (take
finished groups → rows and advantages → packed micro-batches → clipped, importance-corrected loss → one
optimizer step → push weights → log, checkpoint), :meth:`cleanup` (close every session and tracker).
Rollouts run on the scheduler's thread the whole time, so the engine keeps sampling while the trainer
trains; it only waits for a weight push.
"""

from __future__ import annotations

import asyncio
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

from harness_trainer.engines import EngineUnavailable, make_engine
from harness_trainer.trainer.batch import StepBatch, assemble, rollout_metrics
from harness_trainer.trainer.checkpoint import (
    TrainerState,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from harness_trainer.trainer.config import AsyncGRPOConfig
from harness_trainer.trainer.logprobs import token_logprobs
from harness_trainer.trainer.loss import LossConfig, LossStats, policy_loss
from harness_trainer.trainer.outcome import HarnessRolloutOutcome
from harness_trainer.trainer.packing import collate, plan_micro_batches
from harness_trainer.trainer.policy import Reference, engine_weights, load_policy, vocab_size
from harness_trainer.trainer.reporting import MetricsReporter
from harness_trainer.trainer.scheduling import Group, RolloutScheduler, SchedulerConfig

logger = logging.getLogger(__name__)

# Consecutive groups without two scored members after which the run stops: every rollout failing is a
# setup problem (no sandbox, no engine), not something more rollouts fix.
MAX_CONSECUTIVE_DROPPED_GROUPS = 32


class WeightSyncError(RuntimeError):
    """The engine could not take the new weights after every retry; a checkpoint was written first."""


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
    ) -> None:
        if not callable(harness_session_factory):
            raise TypeError(
                "harness_session_factory must be a factory builder: partial(HarborSessionFactory, …)"
            )
        self.args = args or AsyncGRPOConfig()
        self.model_source = model
        self.factory_builder = harness_session_factory
        self.train_dataset = train_dataset
        self.rollout_reward_fn = rollout_reward_fn
        self.peft_config = peft_config
        self.engine = engine
        self.state = TrainerState(step=0, groups_consumed=0, policy_version=0, rng={}, extra={})
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: Any = None
        self.factory: Any = None
        self.scheduler: RolloutScheduler | None = None
        self.reporter: MetricsReporter | None = None
        self.reference: Reference | None = None
        self.last_metrics: dict[str, float] = {}
        self.trained_groups: list[int] = []
        self._stop = threading.Event()
        self._counters = {"rollout/unscorable_total": 0, "rollout/dropped_groups_total": 0}

    # -- setup ---------------------------------------------------------------------------------------

    def setup(self) -> None:
        """Build the policy, optimizer, engine client and factory; resume; start rolling out."""
        args = self.args
        _seed_everything(args.seed)
        self.output_dir = Path(args.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.model = load_policy(self.model_source, args, self.peft_config)
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay)
        from transformers import get_scheduler

        self.lr_scheduler = get_scheduler(
            args.lr_scheduler_type, self.optimizer, num_warmup_steps=args.warmup_steps,
            num_training_steps=args.max_steps,
        )  # fmt: skip
        self.loss_config = LossConfig(
            epsilon=args.epsilon, epsilon_high=float(args.epsilon_high or args.epsilon),
            is_mode=args.importance_sampling, is_cap=args.importance_sampling_cap, beta=args.beta,
        )  # fmt: skip
        self.reference = Reference(self.model) if args.beta > 0 else None
        if self.engine is None and args.engine != "none":
            self.engine = self._make_engine()

        resume = resolve_resume(_resume_flag(args.resume_from_checkpoint), self.output_dir)
        if resume is not None:
            self.state = load_checkpoint(resume, self.model, self.optimizer, self.lr_scheduler)
            logger.info("resumed from %s at step %d", resume, self.state.step)
            self._push_weights()
        self.factory = self.factory_builder(sampling=args.sampling)
        rows = self._rows()
        self.reporter = MetricsReporter(
            self.output_dir, args.report_to, run_name=args.run_name, config=args.to_dict()
        )
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
            ),
            reward_fn=self.rollout_reward_fn,
            policy_version=lambda: self.state.policy_version,
            start_group=self.state.groups_consumed,
        )
        self.scheduler.start()

    def _make_engine(self) -> Any:
        args = self.args
        assert args.vllm_server_base_url is not None and self.model is not None
        if args.engine == "vllm":
            from harness_trainer.engines import NcclTransport

            # LoRA is merged into the full weights before a push, so vLLM serves one model name throughout.
            device = next(self.model.parameters()).device
            return make_engine(
                "vllm", args.vllm_server_base_url, timeout=args.weight_sync_timeout,
                weight_sync=NcclTransport(str(device)), weight_sync_timeout=args.weight_sync_timeout,
            )  # fmt: skip
        return make_engine(args.engine, args.vllm_server_base_url, timeout=args.weight_sync_timeout)

    def _rows(self) -> list[dict[str, Any]]:
        if self.train_dataset is None:
            if not hasattr(self.factory, "prompt_rows"):
                raise ValueError("pass train_dataset: the factory has no prompt_rows() to list its tasks")
            return list(self.factory.prompt_rows())
        return [dict(row) for row in self.train_dataset]

    # -- train ---------------------------------------------------------------------------------------

    def train(self) -> Any:
        """Run to ``max_steps`` or until stopped (SIGTERM, Ctrl-C); returns transformers' ``TrainOutput``."""
        from transformers.trainer_utils import TrainOutput

        previous = self._install_sigterm()
        try:
            self.setup()
            self._loop()
        finally:
            try:
                self._save()
            finally:
                self.cleanup()
                if previous is not None:
                    signal.signal(signal.SIGTERM, previous)
        return TrainOutput(
            self.state.step, float(self.last_metrics.get("loss", 0.0)), dict(self.last_metrics)
        )

    def stop(self) -> None:
        """Ask the loop to stop after the current step (what SIGTERM does)."""
        self._stop.set()

    def _loop(self) -> None:
        from tqdm.auto import tqdm

        args = self.args
        bar = tqdm(total=args.max_steps, initial=self.state.step, desc="train", disable=args.disable_tqdm)
        try:
            while self.state.step < args.max_steps and not self._stop.is_set():
                started = time.monotonic()
                groups = self._take_groups()
                if groups is None:
                    break
                waited = time.monotonic() - started
                metrics = self._step(groups)
                metrics["perf/wait_s"] = waited
                metrics["perf/step_s"] = time.monotonic() - started
                self.last_metrics = metrics
                if self.state.step % args.logging_steps == 0 and self.reporter is not None:
                    self.reporter.log(metrics, self.state.step)
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['reward']:.3f}", step_s=f"{metrics['perf/step_s']:.1f}")
                if args.save_steps and self.state.step % args.save_steps == 0:
                    self._save()
        finally:
            bar.close()

    def _take_groups(self) -> list[Group] | None:
        """The next ``groups_per_step`` groups with at least two scored members, in admission order."""
        assert self.scheduler is not None
        taken: list[Group] = []
        dropped_in_a_row = 0
        while len(taken) < self.args.groups_per_step:
            if self._stop.is_set():
                return None
            group = self.scheduler.next_group(timeout=0.5)
            if group is None:
                continue
            if len(group.scored) >= 2:
                taken.append(group)
                dropped_in_a_row = 0
                continue
            self._note_dropped(group)
            dropped_in_a_row += 1
            if dropped_in_a_row >= MAX_CONSECUTIVE_DROPPED_GROUPS:
                reasons = sorted({r.unscorable or "ungraded" for r in group.rollouts})
                raise RuntimeError(
                    f"{dropped_in_a_row} groups in a row had fewer than two scored rollouts; the last one's "
                    f"rollouts failed with: {reasons}"
                )
        return taken

    def _note_dropped(self, group: Group) -> None:
        self._counters["rollout/dropped_groups_total"] += 1
        self._counters["rollout/unscorable_total"] += sum(r.unscorable is not None for r in group.rollouts)
        logger.warning(
            "group %d dropped: %d of %d rollouts scored",
            group.index, len(group.scored), len(group.rollouts),
        )  # fmt: skip

    def _step(self, groups: list[Group]) -> dict[str, float]:
        assert self.scheduler is not None
        args = self.args
        metrics = rollout_metrics(
            groups, policy_version=self.state.policy_version, reward_name=_reward_name(self.rollout_reward_fn)
        )
        self.trained_groups.extend(group.index for group in groups)
        batch = assemble(groups, advantage_epsilon=args.advantage_epsilon, keep_zero_advantage=args.beta > 0)
        trained = time.monotonic()
        loss_metrics, forwarded = self._optimize(batch)
        train_s = time.monotonic() - trained
        self.state.step += 1
        self.state.groups_consumed = self.scheduler.next_to_take
        sync_s = 0.0
        if self.state.step % args.weight_sync_steps == 0:
            sync_s = self._push_weights(version=self.state.step)
        self._counters["rollout/unscorable_total"] += int(metrics["rollout/unscorable"])
        metrics.update(loss_metrics)
        metrics.update(self._counters)
        metrics.update({
            "rollout/dropped_groups": float(batch.dropped_groups),
            "learning_rate": float(self.lr_scheduler.get_last_lr()[0]),
            "num_tokens": float(batch.trained_tokens),
            "perf/train_s": train_s,
            "perf/tokens_per_s": forwarded / train_s if train_s > 0 else 0.0,
            "perf/weight_sync_s": sync_s,
            "policy_version": float(self.state.policy_version),
            "epoch": self.state.groups_consumed / max(len(self.scheduler.rows), 1),
        })  # fmt: skip
        return metrics

    def _optimize(self, batch: StepBatch) -> tuple[dict[str, float], int]:
        """One optimizer step over ``batch``: packed micro-batches, backward on each, clip, step."""
        assert self.model is not None and self.optimizer is not None
        args = self.args
        total: LossStats | None = None
        forwarded = 0
        device = next(self.model.parameters()).device
        for rows in plan_micro_batches(batch.rows, args.token_budget):
            micro = collate(rows, batch.advantages, batch.weights).to(device)
            forwarded += micro.n_tokens
            logps, entropy = token_logprobs(self.model, micro, args.temperature, targets_only=True)
            ref_logps = None
            if self.reference is not None:
                with torch.no_grad(), self.reference.model() as reference:
                    ref_logps, _ = token_logprobs(
                        reference, micro, args.temperature, with_entropy=False, targets_only=True
                    )
            loss, stats = policy_loss(logps, micro, self.loss_config, ref_logps=ref_logps, entropy=entropy)
            loss.backward()
            total = stats if total is None else total.merge(stats)
        grad_norm = 0.0
        if total is not None:
            params = [p for p in self.model.parameters() if p.requires_grad]
            if args.max_grad_norm > 0:
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm))
            else:
                grad_norm = float(
                    torch.norm(torch.stack([p.grad.norm() for p in params if p.grad is not None]))
                )
            if not math.isfinite(grad_norm):
                logger.warning(
                    "non-finite gradient norm at step %d; the update is skipped", self.state.step + 1
                )
                self.optimizer.zero_grad(set_to_none=True)
            else:
                self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics = total.metrics() if total is not None else {}
        metrics.setdefault("loss", 0.0)
        metrics["grad_norm"] = grad_norm
        return metrics, forwarded

    # -- weights, checkpoints, cleanup ---------------------------------------------------------------

    def _push_weights(self, version: int | None = None) -> float:
        """Pause the engine, push the weights as ``version``, resume; seconds spent. Retries, then stops."""
        version = self.state.step if version is None else version
        if self.engine is None:
            self.state.policy_version = version
            return 0.0
        assert self.model is not None
        started = time.monotonic()
        weights = engine_weights(self.model)
        error: Exception | None = None
        for attempt in range(self.args.weight_sync_retries):
            try:
                served = asyncio.run(_pause_push_resume(self.engine, weights, version))
            except EngineUnavailable as exc:
                error = exc
                logger.warning(
                    "weight push %d/%d failed: %s", attempt + 1, self.args.weight_sync_retries, exc
                )
                time.sleep(min(2.0**attempt, 10.0))
                continue
            self.state.policy_version = served
            return time.monotonic() - started
        self._save()
        raise WeightSyncError(
            f"the engine did not take weights version {version} after {self.args.weight_sync_retries} "
            f"attempts ({error}); a checkpoint of step {self.state.step} is in {self.output_dir}"
        ) from error

    def _save(self) -> Path | None:
        if self.model is None or self.optimizer is None or self.state.step == 0:
            return None
        existing = self.output_dir / f"checkpoint-{self.state.step}"
        if existing.exists():
            return existing
        self.state.extra = {"config": self.args.to_dict(), "counters": dict(self._counters)}
        return save_checkpoint(
            self.output_dir, self.state, self.model, self.optimizer, self.lr_scheduler,
            save_total_limit=self.args.save_total_limit,
        )  # fmt: skip

    def save_model(self, path: str | Path) -> None:
        """Save the policy (or its adapter) with ``save_pretrained``."""
        assert self.model is not None
        self.model.save_pretrained(str(path))

    def cleanup(self) -> None:
        """Close every session, the factory, the trackers. Safe to call more than once."""
        if self.scheduler is not None:
            self.scheduler.stop()
        if self.factory is not None and hasattr(self.factory, "close"):
            try:
                self.factory.close()
            except Exception:
                logger.warning("closing the session factory failed", exc_info=True)
            self.factory = None
        if self.reporter is not None:
            self.reporter.close()

    def _install_sigterm(self) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return None

        def on_sigterm(signum: int, frame: Any) -> None:
            logger.warning("SIGTERM: checkpointing and closing every session")
            self._stop.set()

        return signal.signal(signal.SIGTERM, on_sigterm)


async def _pause_push_resume(engine: Any, weights: dict[str, torch.Tensor], version: int) -> int:
    # A failed push leaves the engine paused: better idle than sampling from half-updated weights; the
    # retry (or the run's stop) follows.
    await engine.pause()
    served = await engine.push_weights(weights, version)
    await engine.resume()
    return served


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
