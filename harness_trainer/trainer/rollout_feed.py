"""Rank 0's rollout feed: the session factories, the scheduler rolling out on its own thread, the
evaluator, the curriculum, the adaptive concurrency limit, the metrics and rollout logs, and each step's
groups (:class:`.StepGroups`).

:class:`RolloutFeed` is made and started by the trainer's ``setup`` and closed by its ``cleanup``; the
functions below make each of its pieces from the config.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness_trainer.trainer.checkpoint import TrainerState
from harness_trainer.trainer.config.async_grpo import AsyncGRPOConfig
from harness_trainer.trainer.feed.concurrency import AdaptiveConcurrency, ConcurrencyRule
from harness_trainer.trainer.feed.coverage import Coverage
from harness_trainer.trainer.feed.curriculum import PassRateCurriculum, PassRateRule
from harness_trainer.trainer.feed.evaluation import Evaluator, overlapping_tasks
from harness_trainer.trainer.feed.load_poller import ConcurrencyPoller
from harness_trainer.trainer.feed.rollout_log import RolloutLog
from harness_trainer.trainer.feed.rollout_records import RunStart, member_record
from harness_trainer.trainer.feed.scheduling import RolloutScheduler, SchedulerConfig
from harness_trainer.trainer.publish import PolicyPublisher
from harness_trainer.trainer.reporting import MetricsReporter
from harness_trainer.trainer.step.groups import Group, Rollout
from harness_trainer.trainer.step.outcome import HarnessRolloutOutcome
from harness_trainer.trainer.step_groups import StepGroups

logger = logging.getLogger(__name__)


class RolloutFeed:
    """Rank 0: the rollouts the trainer trains on, and what it records of them and of the run.

    Args:
        builder: the trainer's factory builder (``harness_session_factory``).
        args: the run's config.
        train_dataset, eval_dataset: the trainer's rows (default: the factories' ``prompt_rows()``).
        reward_fn: the trainer's ``rollout_reward_fn``.
        harness_adapter, harness_limits: white-box mode (:mod:`harness_trainer.trainer.feed.whitebox`).
        tokenizer: the policy's tokenizer, loaded when first asked for (white-box factories render with it).
        policy_version: the version the engine serves now.
        output_dir: where the metrics, rollouts and evaluations are written.
    """

    def __init__(
        self,
        builder: Callable[..., Any],
        args: AsyncGRPOConfig,
        *,
        train_dataset: Any,
        eval_dataset: Any,
        reward_fn: Callable[[HarnessRolloutOutcome], float | None] | None,
        harness_adapter: Any,
        harness_limits: Any,
        tokenizer: Callable[[], Any],
        policy_version: Callable[[], int],
        output_dir: Path,
    ) -> None:
        self.builder = builder
        self.args = args
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.reward_fn = reward_fn
        self.harness_adapter = harness_adapter
        self.harness_limits = harness_limits
        self.tokenizer = tokenizer
        self.policy_version = policy_version
        self.output_dir = output_dir
        self.factory: Any = None
        self.eval_factory: Any = None
        self.evaluator: Evaluator | None = None
        self.curriculum: PassRateCurriculum | None = None
        self.reporter: MetricsReporter | None = None
        self.rollout_log: RolloutLog | None = None
        self.scheduler: RolloutScheduler | None = None
        self.poller: ConcurrencyPoller | None = None
        """With ``adaptive_concurrency``: sets the scheduler's concurrency limit from the engines' load."""
        self.groups: StepGroups | None = None

    def start(
        self,
        state: TrainerState,
        *,
        vocab_size: int,
        publisher: PolicyPublisher | None,
        check_engine: bool,
        on_rollout_done: Callable[[Group, Rollout], None],
        stop: threading.Event,
        counters: dict[str, int],
        trained_groups: list[int],
        world_size: int,
    ) -> None:
        """Make the factories (told what ``publisher``'s engine serves, and checked against it with
        ``check_engine``), the evaluator, the curriculum and the logs; evaluate on start; start the
        scheduler (each finished rollout to ``on_rollout_done``) and the concurrency poller. Pieces made
        before a failure are closed by :meth:`close`."""
        args = self.args
        self.factory = self._build_factory(args.sampling)
        if check_engine and args.vllm_server_base_url and hasattr(self.factory, "check_engine"):
            self.factory.check_engine(args.vllm_server_base_url)  # rollouts and trainer on one model
        if publisher is not None:  # what the engine serves now: the rollouts' first calls go there
            publisher.attach(self.factory, state.policy_version)
        rows = self._rows()
        if args.evaluates:
            split: dict[str, Any] = {} if args.eval_split is None else {"split": args.eval_split}
            self.eval_factory = self._build_factory(args.eval_sampling, **split)
            if publisher is not None:
                publisher.attach_eval(self.eval_factory)
            self.evaluator = make_evaluator(
                self.eval_factory, self.eval_dataset, rows, args, vocab_size=vocab_size,
                reward_fn=self.reward_fn, output_dir=self.output_dir,
            )  # fmt: skip
        self.curriculum = make_curriculum(args, len(rows), state)
        self.reporter = MetricsReporter(
            self.output_dir, args.report_to, run_name=args.run_name, config=args.to_dict(),
            project=args.project,
        )  # fmt: skip
        self.rollout_log = RolloutLog(self.output_dir)
        # What an earlier run wrote of the groups and steps this one does again is superseded by this line.
        self.rollout_log.write([RunStart(step=state.step, start_group=state.groups_consumed)])
        adaptive = adaptive_concurrency(args, state)
        self.scheduler = RolloutScheduler(
            self.factory, rows, scheduler_config(args, vocab_size, adaptive), reward_fn=self.reward_fn,
            policy_version=self.policy_version, start_group=state.groups_consumed,
            row_chooser=self.curriculum, on_rollout_done=on_rollout_done,
        )  # fmt: skip
        if args.eval_on_start and state.step == 0:  # a resumed run logged its start step already
            self.evaluate(state, stop)
        self.scheduler.start()
        if adaptive is not None:
            self.poller = concurrency_poller(args, adaptive, self.scheduler)
            self.poller.start()
        self.groups = StepGroups(
            args, self.scheduler, counters, trained_groups, curriculum=self.curriculum, poller=self.poller,
            rollout_log=self.rollout_log, reward_name=_reward_name(self.reward_fn), world_size=world_size,
            coverage=Coverage(state.extra.get("coverage")), output_dir=self.output_dir,
        )  # fmt: skip

    def evaluate(self, state: TrainerState, stop: threading.Event) -> dict[str, float]:
        """One evaluation at the weights the engine serves now; at step 0 (``eval_on_start``) its metrics
        are logged on their own line, later ones go with the step's. {} when the run is stopping."""
        assert self.evaluator is not None and self.reporter is not None
        evaluated = self.evaluator.evaluate(state.step, state.policy_version, stop)
        if evaluated is None:
            return {}
        metrics, _ = evaluated
        if state.step == 0:
            self.reporter.log(metrics, 0)
        return metrics

    def evaluates(self, step: int) -> bool:
        """Whether ``step`` evaluates (``eval_steps``)."""
        return self.evaluator is not None and self.args.should_evaluate(step)

    def evaluate_at_the_end(self, state: TrainerState, stop: threading.Event) -> None:
        """A run that ended before ``max_steps`` on its own: the evaluation its last step would have had,
        unless that step had one already."""
        args, step = self.args, state.step
        if self.evaluator is None or args.should_evaluate(step) or (step == 0 and args.eval_on_start):
            return
        metrics = self.evaluate(state, stop)
        if metrics and step > 0:
            self.log(metrics, step)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """``metrics`` as ``step``'s line of metrics.jsonl and to the trackers."""
        if self.reporter is not None:
            self.reporter.log(metrics, step)

    def log_rollout(self, group: Group, rollout: Rollout) -> None:
        """A finished rollout to rollouts.jsonl, its trace when ``rollout_log_steps`` keeps its group's
        (the groups that would train at every N-th step were none dropped)."""
        if self.rollout_log is None:
            return
        every = self.args.rollout_log_steps
        with_trace = bool(every) and (group.index // self.args.groups_per_step + 1) % every == 0
        self.rollout_log.write([member_record(group, rollout, with_trace=with_trace)])

    def step_done(self) -> None:
        """The step trained the groups it took (or dropped them) and pushed its weights: their admission
        places go to new groups, which sample on those weights."""
        if self.scheduler is not None:
            self.scheduler.release()

    def live_sessions(self) -> int:
        """The sessions rolling out now."""
        return self.scheduler.live_sessions() if self.scheduler is not None else 0

    def server_metrics(self) -> dict[str, float]:
        """With a factory over several rollout servers: how many are down, and the rollouts they lost."""
        if len(servers := getattr(self.factory, "servers_report", list)()) <= 1:
            return {}
        return {
            "rollout/servers_down": float(sum(not server["up"] for server in servers)),
            "rollout/server_lost_total": float(sum(server["lost"] for server in servers)),
        }

    def close(self, step: int) -> None:
        """Stop the poller and the scheduler, close every session, the factories, the trackers and the
        rollout log (the groups taken and dropped for step ``step`` + 1, which never came, get their
        outcomes first). Safe to call more than once."""
        if self.poller is not None:  # before the scheduler it steers stops
            self.poller.stop()
            self.poller = None
        if self.scheduler is not None:
            self.scheduler.stop()
        _close_factory(self.factory, "session factory")
        self.factory = None
        _close_factory(self.eval_factory, "eval session factory")
        self.eval_factory = None
        if self.reporter is not None:
            self.reporter.close()
        if self.rollout_log is not None:
            if self.groups is not None:  # taken and dropped by a step that never came: their reason is known
                self.groups.log_dropped(step + 1)
            self.rollout_log.close()

    def _build_factory(self, sampling: dict[str, Any], **kwargs: Any) -> Any:
        return build_factory(
            self.builder, self.args, sampling, harness_adapter=self.harness_adapter,
            harness_limits=self.harness_limits, tokenizer=self.tokenizer, policy_version=self.policy_version,
            **kwargs,
        )  # fmt: skip

    def _rows(self) -> list[dict[str, Any]]:
        if self.train_dataset is None:
            if not hasattr(self.factory, "prompt_rows"):
                raise ValueError("pass train_dataset: the factory has no prompt_rows() to list its tasks")
            return list(self.factory.prompt_rows())
        return [dict(row) for row in self.train_dataset]


def check_rollout_arguments(
    builder: Any, args: AsyncGRPOConfig, eval_dataset: Any, harness_adapter: Any
) -> None:
    """Refuse a trainer's arguments that could not roll out (see the trainer's Raises)."""
    if not callable(builder):
        raise TypeError("harness_session_factory must be a factory builder: partial(HarborSessionFactory, …)")
    if args.evaluates and args.eval_split is None and eval_dataset is None:
        raise ValueError(
            "evaluation is on (eval_steps / eval_on_start) but there is nothing to evaluate on: set "
            "eval_split (the factory's split of eval tasks) or pass eval_dataset= to the trainer"
        )
    if harness_adapter is not None:
        from harness_trainer.trainer.feed.whitebox import check_white_box

        check_white_box(harness_adapter, builder)
        if not args.vllm_server_base_url:
            raise ValueError("harness_adapter samples from the engine: set vllm_server_base_url")


def build_factory(
    builder: Callable[..., Any],
    args: AsyncGRPOConfig,
    sampling: dict[str, Any],
    *,
    harness_adapter: Any,
    harness_limits: Any,
    tokenizer: Callable[[], Any],
    policy_version: Callable[[], int],
    **kwargs: Any,
) -> Any:
    """The builder's factory; with a harness adapter, wrapped so each session is a white-box episode
    that samples under ``sampling`` (the builder then gets no ``sampling=``)."""
    if harness_adapter is None:
        return builder(sampling=sampling, **kwargs)
    from harness_trainer.trainer.feed.whitebox import white_box_factory

    assert args.vllm_server_base_url is not None  # checked at construction
    return white_box_factory(
        builder(**kwargs), harness_adapter, tokenizer=tokenizer(),
        base_url=args.vllm_server_base_url, sampling=sampling,
        max_completion_length=args.max_completion_length, chat_template_kwargs=args.chat_template_kwargs,
        limits=harness_limits, policy_version=policy_version,
    )  # fmt: skip


def make_evaluator(
    eval_factory: Any,
    eval_dataset: Any,
    train_rows: list[dict[str, Any]],
    args: AsyncGRPOConfig,
    *,
    vocab_size: int,
    reward_fn: Callable[[HarnessRolloutOutcome], float | None] | None,
    output_dir: Path,
) -> Evaluator:
    """The evaluator over ``eval_dataset``'s rows (default: the eval factory's ``prompt_rows()``), with a
    warning for each eval task that is a training task too."""
    if eval_dataset is not None:
        rows = [dict(row) for row in eval_dataset]
    elif hasattr(eval_factory, "prompt_rows"):
        rows = list(eval_factory.prompt_rows())
    else:
        raise ValueError("pass eval_dataset: the eval factory has no prompt_rows() to list its tasks")
    if overlap := overlapping_tasks(train_rows, rows):
        logger.warning(
            "%d eval task(s) have a training task's instruction, so they are not held out: %s",
            len(overlap), ", ".join(overlap),
        )  # fmt: skip
    assert args.max_concurrent_rollouts is not None  # resolved at construction
    return Evaluator(
        eval_factory, rows, k=args.eval_num_generations, seed=args.seed,
        temperature=args.eval_temperature, pass_reward=args.pass_reward,
        max_concurrent_rollouts=args.max_concurrent_rollouts, rollout_timeout=args.rollout_timeout,
        vocab_size=vocab_size, max_unexpected_errors=args.max_unexpected_errors,
        reward_fn=reward_fn, output_dir=output_dir, split=args.eval_split,
    )  # fmt: skip


def make_curriculum(args: AsyncGRPOConfig, num_rows: int, state: TrainerState) -> PassRateCurriculum | None:
    """With ``curriculum="pass_rate"``, the curriculum over ``num_rows`` rows, where ``state``'s run was."""
    if args.curriculum != "pass_rate":
        return None
    rule = PassRateRule(
        window=args.curriculum_window,
        pass_reward=args.pass_reward,
        retire_threshold=args.curriculum_retire_threshold,
        retired_weight=args.curriculum_retired_weight,
        unsolved_weight=args.curriculum_unsolved_weight,
    )
    return PassRateCurriculum(
        num_rows, rule, seed=args.seed, lag=args.admission_limit,
        state=state.extra.get("curriculum"), start=state.groups_consumed,
    )  # fmt: skip


def adaptive_concurrency(args: AsyncGRPOConfig, state: TrainerState) -> AdaptiveConcurrency | None:
    """With ``adaptive_concurrency``, the limit's controller; a resumed run starts where its checkpoint's
    limit was (clamped to this run's bounds)."""
    if not args.adaptive_concurrency:
        return None
    assert args.max_concurrent_rollouts is not None  # resolved at construction
    rule = ConcurrencyRule(
        floor=args.min_concurrent_rollouts, ceiling=args.max_concurrent_rollouts,
        low_water=args.kv_cache_low_water, high_water=args.kv_cache_high_water,
    )  # fmt: skip
    return AdaptiveConcurrency(rule, start=state.extra.get("concurrency_limit"))


def scheduler_config(
    args: AsyncGRPOConfig, vocab_size: int, adaptive: AdaptiveConcurrency | None
) -> SchedulerConfig:
    """The scheduler's settings from the config."""
    return SchedulerConfig(
        num_generations=args.num_generations,
        max_concurrent_rollouts=args.max_concurrent_rollouts,
        admission_limit=args.admission_limit,
        rollout_timeout=args.rollout_timeout,
        seed=args.seed,
        shuffle=args.dataset_shuffle,
        vocab_size=vocab_size,
        temperature=args.temperature,
        max_unexpected_errors=args.max_unexpected_errors,
        concurrency_limit=adaptive.limit if adaptive is not None else None,
        fail_fast_rollouts=args.fail_fast_rollouts,
        hold_taken=True,  # a group's place is freed after its step's push: max_staleness holds exactly
    )


def concurrency_poller(
    args: AsyncGRPOConfig, adaptive: AdaptiveConcurrency, scheduler: RolloutScheduler
) -> ConcurrencyPoller:
    """The poller that sets ``scheduler``'s concurrency limit from the engines' load (not started)."""
    assert args.vllm_server_base_url is not None  # the config refuses adaptive_concurrency without it
    return ConcurrencyPoller(
        [args.vllm_server_base_url, *args.vllm_replica_urls], adaptive, scheduler,
        interval_s=args.concurrency_poll_interval,
    )  # fmt: skip


def _close_factory(factory: Any, what: str) -> None:
    """Close ``factory`` (if any, and if it closes); a failure is logged, so cleanup goes on."""
    if factory is not None and hasattr(factory, "close"):
        try:
            factory.close()
        except Exception:
            logger.warning("closing the %s failed", what, exc_info=True)


def _reward_name(fn: Callable[..., Any] | None) -> str | None:
    return getattr(fn, "__name__", type(fn).__name__) if fn is not None else None
