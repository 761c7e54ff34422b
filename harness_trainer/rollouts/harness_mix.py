"""Several harnesses in one run: which agent each GRPO group's rollouts use.

A run names its harness as one name (``"opencode"``), a list (``["opencode", "mini-swe-agent"]``:
round-robin over the groups) or a mapping of positive weights (``{"opencode": 2, "mini-swe-agent": 1}``:
weighted). On the command line the same three are ``opencode``, ``opencode,mini-swe-agent`` and
``opencode=2,mini-swe-agent=1``.

Contract:

- **Per group.** Every member of a group uses its group's harness, so a group's advantages compare
  rollouts of one agent with one another, never one agent's with another's.
- **A pure schedule.** :meth:`HarnessMix.for_group` is a function of the group index alone: round-robin
  gives group ``g`` the ``g mod n``-th name; weighted gives each group, in index order, to the harness
  furthest below its share of the groups so far (ties to the one listed first), a fixed interleaving
  (``{a: 2, b: 1}``: a b a a b a …) whose counts stay within one group of the weights at every prefix.
  A resumed run resumes its group index, so its schedule goes on where it stopped.
- **Checked once.** :func:`harness_mix` refuses, naming the value, an empty list, a repeated name, a
  name that is not a non-empty string, and a weight that is not a positive finite number. Whether each
  name is a registered harness is the registry's to say (preflight, the rollout server): this module,
  on the rollout client's side, imports none.
- **Or asked for by name.** A session factory's ``create(..., harness=NAME)`` runs that harness of the mix
  instead of the group's (:meth:`HarnessMix.chosen`): evaluation rolls every eval task out under each
  harness (:mod:`harness_trainer.trainer.feed.evaluation`). A name outside the mix is refused.
- **Options per harness.** With several harnesses, ``harness_options`` is keyed by harness name
  (``{"mini-swe-agent": {"agent_config": …}}``); :meth:`HarnessMix.options_for` gives each its own.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

HarnessValue = str | list[str] | dict[str, float]
"""What a config holds: one name, a round-robin list, or a mapping of weights."""
ROUND_ROBIN, WEIGHTED, SINGLE = "round-robin", "weighted", "single"


@dataclass(frozen=True)
class HarnessMix:
    """The run's harnesses and how groups are dealt to them (module docstring)."""

    names: tuple[str, ...]
    weights: tuple[float, ...]
    schedule: str

    @property
    def mixed(self) -> bool:
        """Whether the run uses more than one harness."""
        return len(self.names) > 1

    @property
    def first(self) -> str:
        return self.names[0]

    def for_group(self, index: int | None) -> str:
        """The harness of group ``index`` (≥ 0); the first for None (an episode of no group)."""
        if index is None:
            return self.first
        if index < 0:
            raise ValueError(f"a group index is ≥ 0, got {index}")
        if self.schedule == WEIGHTED:
            return self.names[_weighted_order(self.weights, index)]
        return self.names[index % len(self.names)]

    def chosen(self, harness: str | None, group: int | None) -> str:
        """``harness`` when one is named, else group ``group``'s (:meth:`for_group`).

        Raises:
            ValueError: ``harness`` is not one of the mix.
        """
        if harness is None:
            return self.for_group(group)
        if harness not in self.names:
            raise ValueError(f"harness {harness!r} is not one of this run's: {', '.join(self.names)}")
        return harness

    def options_for(self, harness_options: Mapping[str, Any], name: str) -> dict[str, Any]:
        """``name``'s own keyword options: all of ``harness_options`` for a single harness, its entry for a
        mix (none when it has none)."""
        if not self.mixed:
            return dict(harness_options)
        return dict(harness_options.get(name) or {})

    def options_problems(self, harness_options: Mapping[str, Any]) -> list[str]:
        """What is wrong with ``harness_options`` for this mix: keyed by harness names, each a mapping."""
        if not self.mixed:
            return []
        problems = []
        for key, value in harness_options.items():
            if key not in self.names:
                problems.append(
                    f"harness_options: with several harnesses, give each its options under its name "
                    f"({', '.join(self.names)}); {key!r} is not one of them"
                )
            elif not isinstance(value, dict):
                problems.append(f"harness_options.{key}: expected a mapping of options, got {value!r}")
        return problems

    def value(self) -> HarnessValue:
        """The mix as a config holds it (what :func:`harness_mix` reads back to this mix)."""
        if self.schedule == SINGLE:
            return self.first
        if self.schedule == ROUND_ROBIN:
            return list(self.names)
        return dict(zip(self.names, self.weights, strict=True))

    def __str__(self) -> str:
        if self.schedule == SINGLE:
            return self.first
        if self.schedule == ROUND_ROBIN:
            return f"{', '.join(self.names)} (round-robin per group)"
        shares = ", ".join(f"{n} × {w:g}" for n, w in zip(self.names, self.weights, strict=True))
        return f"{shares} (weighted per group)"


def harness_mix(value: HarnessValue | Sequence[str] | Mapping[str, float] | HarnessMix) -> HarnessMix:
    """The mix a config's ``harness`` value means (module docstring).

    Raises:
        ValueError: an empty list, a repeated or blank name, a weight that is not positive and finite.
    """
    if isinstance(value, HarnessMix):
        return value
    if isinstance(value, str):
        return HarnessMix((_name(value),), (1.0,), SINGLE)
    if isinstance(value, Mapping):
        names = tuple(_name(n) for n in value)
        weights = tuple(_weight(n, w) for n, w in value.items())
        schedule = WEIGHTED
    elif isinstance(value, Sequence):
        names = tuple(_name(n) for n in value)
        weights = tuple(1.0 for _ in names)
        schedule = ROUND_ROBIN
    else:
        raise ValueError(f"harness: give a name, a list of names or a mapping of weights, got {value!r}")
    if not names:
        raise ValueError("harness: an empty list names no harness")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"harness: {', '.join(repeated)} listed more than once")
    if len(names) == 1:
        return HarnessMix(names, (1.0,), SINGLE)
    return HarnessMix(names, weights, schedule)


def parse_harness_text(text: str) -> HarnessValue:
    """A ``--harness`` flag's text as a config value: ``a``, ``a,b`` (a list), ``a=2,b=1`` (weights).

    Raises:
        ValueError: a weight that is not a number, or a list mixing weighted and unweighted names.
    """
    items = [item.strip() for item in text.split(",")]
    if len(items) == 1 and "=" not in items[0]:
        return items[0]
    weighted = ["=" in item for item in items]
    if not any(weighted):
        return items
    if not all(weighted):
        raise ValueError(f"harness {text!r}: give every harness a weight (a=2,b=1) or none (a,b)")
    out: dict[str, float] = {}
    for item in items:
        name, _, weight = item.partition("=")
        try:
            out[name.strip()] = float(weight)
        except ValueError:
            raise ValueError(f"harness {text!r}: the weight of {name.strip()!r} is not a number") from None
    return out


def _name(name: Any) -> str:
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"harness: a harness name is a non-empty string, got {name!r}")
    return name.strip()


def _weight(name: str, weight: Any) -> float:
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
        raise ValueError(f"harness: the weight of {name!r} must be a positive number, got {weight!r}")
    if weight <= 0:
        raise ValueError(f"harness: the weight of {name!r} must be positive, got {weight!r}")
    return float(weight)


_orders: dict[tuple[float, ...], tuple[list[int], list[int]]] = {}
"""Per weights: the order dealt so far and how many groups each harness got in it."""
_orders_lock = threading.Lock()


def _weighted_order(weights: tuple[float, ...], index: int) -> int:
    """Which harness (by position) weighted scheduling gives group ``index``: the one furthest below its
    share ``weight / total × groups so far``, ties to the first; extended and kept per weights (each group
    once, however often it is asked for)."""
    total = sum(weights)
    with _orders_lock:
        order, counts = _orders.setdefault(weights, ([], [0] * len(weights)))
        while len(order) <= index:
            dealt = len(order) + 1
            # Compared as weight × dealt − count × total: the shares' fractions without a division.
            behind = [w * dealt - c * total for w, c in zip(weights, counts, strict=True)]
            chosen = max(range(len(weights)), key=lambda i: (behind[i], -i))
            order.append(chosen)
            counts[chosen] += 1
        return order[index]
