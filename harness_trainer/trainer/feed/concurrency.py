"""Adaptive rollout concurrency: how many rollouts may be in flight, from the engine's load (pure).

:class:`AdaptiveConcurrency` turns a stream of engine readings (:class:`~harness_trainer.engines.
engine_metrics.EngineLoad`, one per poll) into a limit on rollouts in flight, between a floor and a ceiling
(``min_concurrent_rollouts`` and ``max_concurrent_rollouts``). The aim: keep the engine's batch full without
thrashing its KV cache. Each reading makes at most one change, by this rule, first match wins:

1. **Shrink** when the engine preempted a request since the previous reading (its preemption counter
   rose: it evicted a request to free KV blocks and will recompute it, wasted work), by a quarter of the
   limit; or when the KV-cache usage is above the high-water mark, by an eighth (at least 1, never below
   the floor). The limit only stops new rollouts from starting (nothing in flight is cancelled), so a
   shrink waits until the rollouts in flight are within the current limit: shrinking again before an
   earlier shrink took effect would only lower where the limit ends up, not the load now.
2. **Grow** by an eighth (at least 1, never above the ceiling) when the KV usage is below the low-water
   mark, no request waits in the engine's queue (a queue means the engine's batch is full already), and
   rollouts wait for a slot (the limit is what holds them back: growing a limit that does not bind only
   makes it meaningless later). Not within ``grow_wait`` readings of the last shrink.
3. Otherwise **hold**.

Against oscillation: the band between the water marks holds; a grow waits 3 readings after a shrink; and a
shrink that follows a grow (the grown limit did not fit) doubles that wait, up to 96 readings, until a
reading in the band shows a limit that fits (the wait is back to 3). A steady load whose rollouts each
take more of the cache than the band is wide (the limit alternates between too low and too high) thus
changes the limit ever more rarely instead of every few readings.

The first reading only notes the preemption counter; a counter that went down (the engine restarted) is
noted afresh, not read as preemptions.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness_trainer.engines.engine_metrics import EngineLoad

GROW_WAIT = 3
"""Readings after a shrink before the limit may grow again."""
MAX_GROW_WAIT = 96
"""The most that wait doubles to (at a 5 s poll, 8 minutes)."""


@dataclass(frozen=True)
class ConcurrencyRule:
    """The bounds and water marks of :class:`AdaptiveConcurrency`.

    Raises:
        ValueError: ``1 ≤ floor ≤ ceiling`` or ``0 < low_water ≤ high_water ≤ 1`` does not hold.
    """

    floor: int
    ceiling: int
    low_water: float = 0.8
    high_water: float = 0.9

    def __post_init__(self) -> None:
        if not 1 <= self.floor <= self.ceiling:
            raise ValueError(f"the concurrency floor {self.floor} must be in [1, ceiling {self.ceiling}]")
        if not 0 < self.low_water <= self.high_water <= 1:
            raise ValueError(
                f"the KV-cache water marks must satisfy 0 < low ({self.low_water}) ≤ high "
                f"({self.high_water}) ≤ 1"
            )


@dataclass(frozen=True)
class Decision:
    """What one reading did: the limit after it, ``"grow"``, ``"shrink"`` or ``"hold"``, and why."""

    limit: int
    change: str
    reason: str


class AdaptiveConcurrency:
    """The limit on rollouts in flight, updated by :meth:`update` once per engine reading (module rule).

    Not thread-safe: one poller owns it.
    """

    def __init__(self, rule: ConcurrencyRule, start: int | None = None) -> None:
        """``start``: the first limit (default the floor: a slow start, since a rollout's KV footprint grows
        as its conversation does, after it started)."""
        self.rule = rule
        self.limit = rule.floor if start is None else min(max(start, rule.floor), rule.ceiling)
        self.grow_wait = GROW_WAIT
        self._preemptions: int | None = None
        self._since_shrink = GROW_WAIT  # no shrink yet: the first reading may grow
        self._last_change: str | None = None

    def update(self, load: EngineLoad, *, in_flight: int, queued: int) -> Decision:
        """Apply one reading; ``in_flight``: rollouts holding a slot now, ``queued``: rollouts waiting for
        one."""
        rule = self.rule
        preempted = self._preemptions is not None and load.preemptions_total > self._preemptions
        new = 0 if self._preemptions is None else load.preemptions_total - self._preemptions
        self._preemptions = load.preemptions_total
        self._since_shrink += 1
        usage = f"KV cache {load.kv_cache_usage:.2f}"
        if preempted or load.kv_cache_usage > rule.high_water:
            why = f"{new} preemption(s)" if preempted else f"{usage} > high water {rule.high_water}"
            if self.limit == rule.floor:
                return self._hold(f"{why}, at the floor")
            if in_flight > self.limit:
                return self._hold(
                    f"{why}; {in_flight} in flight, above the limit: the last shrink is pending"
                )
            step = max(1, self.limit // 4) if preempted else _eighth(self.limit)
            if self._last_change == "grow":  # the grown limit did not fit: wait longer before the next grow
                self.grow_wait = min(2 * self.grow_wait, MAX_GROW_WAIT)
            self._since_shrink = 0
            return self._change(max(rule.floor, self.limit - step), "shrink", why)
        if load.kv_cache_usage < rule.low_water and load.waiting == 0 and queued > 0:
            why = (
                f"{usage} < low water {rule.low_water}, none waiting in the engine, {queued} rollout(s) wait"
            )
            if self.limit == rule.ceiling:
                return self._hold(f"{why}, at the ceiling")
            if self._since_shrink < self.grow_wait:
                return self._hold(f"{why}; {self._since_shrink} of {self.grow_wait} readings since a shrink")
            return self._change(min(rule.ceiling, self.limit + _eighth(self.limit)), "grow", why)
        if rule.low_water <= load.kv_cache_usage <= rule.high_water:
            self.grow_wait = GROW_WAIT  # the limit fits the engine
        return self._hold(f"{usage}, {load.waiting} waiting in the engine, {queued} rollout(s) queued")

    def _change(self, limit: int, change: str, reason: str) -> Decision:
        self.limit = limit
        self._last_change = change
        return Decision(limit, change, reason)

    def _hold(self, reason: str) -> Decision:
        return Decision(self.limit, "hold", reason)


def _eighth(limit: int) -> int:
    return max(1, limit // 8)
