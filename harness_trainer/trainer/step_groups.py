"""Rank 0: each step's groups, taken from the scheduler as they finish, and what the step makes of them.

:class:`StepGroups` takes the next ``groups_per_step`` groups worth training on (dropping those with fewer
than two scored members, and by default those whose rewards are all equal), assembles them into rows and
advantages, writes each rollout's outcome to ``rollouts.jsonl``, and deals the step's micro-batches to the
ranks with its metrics (:func:`harness_trainer.trainer.distributed.split_step`).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from harness_trainer.trainer.checkpoint import TrainerState
from harness_trainer.trainer.config.async_grpo import AsyncGRPOConfig
from harness_trainer.trainer.distributed import StepShare, split_step
from harness_trainer.trainer.feed.coverage import Coverage
from harness_trainer.trainer.feed.curriculum import PassRateCurriculum
from harness_trainer.trainer.feed.load_poller import ConcurrencyPoller
from harness_trainer.trainer.feed.rollout_log import RolloutLog
from harness_trainer.trainer.feed.rollout_records import step_outcomes
from harness_trainer.trainer.feed.scheduling import RolloutScheduler
from harness_trainer.trainer.step.batch import StepBatch, assemble, rollout_metrics
from harness_trainer.trainer.step.groups import Group
from harness_trainer.trainer.step.harness_metrics import harness_metrics

logger = logging.getLogger(__name__)

# Consecutive groups without two scored members after which the run stops: every rollout failing is a
# setup problem (no sandbox, no engine), not something more rollouts fix.
MAX_CONSECUTIVE_DROPPED_GROUPS = 32


class NoLearningSignal(RuntimeError):
    """``max_zero_variance_groups_in_a_row`` groups in a row gave every member the same reward."""


class StepGroups:
    """Rank 0: the groups of each step, from the scheduler to each rank's share of the step.

    Args:
        args: the run's config.
        scheduler: the rollouts, started.
        counters: the run's running totals (``rollout/…_total``), updated here and logged each step.
        trained_groups: the index of each group trained, in order, appended to here.
        curriculum, poller: their metrics go with each step's.
        rollout_log: where each step writes what it did with each rollout of the groups it took.
        reward_name: the reward function's name, for the ``rewards/<name>/…`` metrics.
        world_size: how many ranks share each step.
        coverage: the task × harness counts (a run that mixes harnesses), written to ``output_dir``.
    """

    def __init__(
        self,
        args: AsyncGRPOConfig,
        scheduler: RolloutScheduler,
        counters: dict[str, int],
        trained_groups: list[int],
        *,
        curriculum: PassRateCurriculum | None,
        poller: ConcurrencyPoller | None,
        rollout_log: RolloutLog,
        reward_name: str | None,
        world_size: int,
        coverage: Coverage,
        output_dir: Path,
    ) -> None:
        self.args = args
        self.scheduler = scheduler
        self.counters = counters
        self.trained_groups = trained_groups
        self.curriculum = curriculum
        self.poller = poller
        self.rollout_log = rollout_log
        self.reward_name = reward_name
        self.world_size = world_size
        self.coverage, self.output_dir = coverage, output_dir
        self.dropped: list[Group] = []  # taken and dropped since the last step wrote their outcomes
        self.zero_variance: list[Group] = []  # the step's groups dropped for equal rewards (metrics)
        self.stop_reason: str | None = None
        """``"solved"`` once :meth:`take` ended the run on its own."""

    def deal(self, stop: threading.Event, state: TrainerState) -> list[StepShare] | None:
        """The next groups as rows, advantages and metrics, a share per rank; None to stop."""
        args, scheduler = self.args, self.scheduler
        if stop.is_set() or args.epochs_done(scheduler.next_to_take, len(scheduler.rows)):
            return None
        if self.curriculum is not None:  # every earlier step is done: no resume goes back before it
            self.curriculum.settle(state.groups_consumed)
        groups = self.take(stop, state.step)
        if groups is None:
            return None
        # Over the groups dropped for equal rewards too, so reward and frac_reward_zero_std read the same
        # whether they are dropped or not.
        metrics = rollout_metrics(
            [*self.zero_variance, *groups], policy_version=state.policy_version, reward_name=self.reward_name
        )
        # Per harness over every group the step took, dropped ones too: a harness that fails shows it.
        metrics.update(harness_metrics([*self.dropped, *groups]))
        if self.coverage.add([*self.dropped, *groups]):
            self.coverage.write(self.output_dir)
        self.trained_groups.extend(group.index for group in groups)
        batch = assemble(
            groups, advantage_epsilon=args.loss.advantage_epsilon, keep_zero_advantage=args.loss.beta > 0,
            normalization=args.loss.loss_normalization,
        )  # fmt: skip
        self.log_outcomes(groups, batch, state.step + 1)
        if args.log_completions and args.should_log(state.step + 1):
            from tqdm.auto import tqdm

            tqdm.write(completions_text(batch, state.step + 1, args.num_completions_to_print))
        self.counters["rollout/unscorable_total"] += int(metrics["rollout/unscorable"])
        self.counters["rollout/zero_variance_dropped_total"] += len(self.zero_variance)
        metrics.update(self.counters)
        if self.curriculum is not None:
            metrics.update(self.curriculum.summary())
        if self.poller is not None:
            metrics.update(self.poller.metrics())
        metrics.update({
            "rollout/zero_variance_dropped": float(len(self.zero_variance)),
            "rollout/dropped_groups": float(batch.dropped_groups),
            "num_tokens": float(batch.trained_tokens),
            "epoch": scheduler.next_to_take / max(len(scheduler.rows), 1),
        })  # fmt: skip
        self.zero_variance.clear()
        return split_step(
            batch, token_budget=args.token_budget, world_size=self.world_size, metrics=metrics,
            groups_consumed=scheduler.next_to_take, shared_prefix=args.forwards_by_prefix,
        )  # fmt: skip

    def take(self, stop: threading.Event, step: int) -> list[Group] | None:
        """The next ``groups_per_step`` groups with at least two scored members, in admission order; with
        ``drop_zero_variance_groups``, only groups whose scored members' rewards differ.

        Every group dropped is replaced by the next one, its admission place freed at once (the trainer
        frees the kept ones' after the step's push: :meth:`.RolloutFeed.step_done`). That stays within the
        staleness bound: the replacement samples on weights no older than the dropped group's did.

        None when the run stops: asked to (``stop``), or ``max_zero_variance_groups_in_a_row`` groups in a
        row were dropped with every scored member passing (``pass_reward``): the policy has solved what it
        trains on, and the run ends as at ``max_steps`` (``stop_reason`` ``"solved"``).

        Raises:
            RuntimeError: ``MAX_CONSECUTIVE_DROPPED_GROUPS`` groups in a row had fewer than two scored
                members.
            NoLearningSignal: ``max_zero_variance_groups_in_a_row`` groups in a row were dropped for equal
                rewards, not all of them passing.
        """
        args = self.args
        taken: list[Group] = []
        dropped_in_a_row = zero_variance_in_a_row = 0
        while len(taken) < args.groups_per_step:
            if stop.is_set():
                return None
            group = self.scheduler.next_group(timeout=0.5)
            if group is None:
                continue
            if len(group.scored) < 2:
                self._note_dropped(group)
                self.dropped.append(group)
                self.scheduler.release(1)  # never trained: its place goes to the group replacing it
                dropped_in_a_row += 1
                if dropped_in_a_row >= MAX_CONSECUTIVE_DROPPED_GROUPS:
                    reasons = sorted({r.unscorable or "ungraded" for r in group.rollouts})
                    raise RuntimeError(
                        f"{dropped_in_a_row} groups in a row had fewer than two scored rollouts; the last "
                        f"one's rollouts failed with: {reasons}"
                    )
                continue
            dropped_in_a_row = 0
            if args.drop_zero_variance_groups and _zero_variance(group):
                self.dropped.append(group)
                self.zero_variance.append(group)
                self.scheduler.release(1)
                zero_variance_in_a_row += 1
                if zero_variance_in_a_row >= args.max_zero_variance_groups_in_a_row:
                    streak = self.zero_variance[-zero_variance_in_a_row:]
                    if not _all_passed(streak, args.pass_reward):
                        raise NoLearningSignal(_no_signal_message(streak, args.curriculum))
                    # The policy passes every task it draws: the run is done, not broken.
                    self.stop_reason = "solved"
                    logger.warning(_solved_message(streak, step, args.max_steps))
                    return None
                continue
            taken.append(group)
            zero_variance_in_a_row = 0
        return taken

    def log_dropped(self, step: int) -> None:
        """Groups taken and dropped for a ``step`` that never came (the run stopped): their outcomes, whose
        reason is known."""
        if self.dropped:
            self.log_outcomes([], StepBatch(), step)

    def log_outcomes(self, groups: list[Group], batch: StepBatch, step: int) -> None:
        """What ``step`` did with each rollout of the groups it took (trained with an advantage, or why not)
        to rollouts.jsonl, the groups it dropped included; the rollouts themselves were written as they
        finished."""
        trained = {(r.group, r.member): batch.advantages[i] for i, r in enumerate(batch.rollouts)}
        self.rollout_log.write(step_outcomes(step, self.dropped, groups, trained))
        self.dropped.clear()

    def _note_dropped(self, group: Group) -> None:
        self.counters["rollout/dropped_groups_total"] += 1
        self.counters["rollout/unscorable_total"] += sum(r.unscorable is not None for r in group.rollouts)
        logger.warning(
            "group %d dropped: %d of %d rollouts scored",
            group.index, len(group.scored), len(group.rollouts),
        )  # fmt: skip


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
