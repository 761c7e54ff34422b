"""95 % confidence intervals for a mean over a few seeds (Student t), without scipy.

Pure functions. :func:`mean_interval` is the textbook interval ``mean ± t(0.975, n - 1) · s / √n`` (``s``
the sample standard deviation), which assumes the values are independent draws from a roughly normal
distribution; :func:`paired_difference` is the same interval on per-pair differences (a paired t
interval), which removes what the two members of a pair share (here: a seed's tasks order and sampling).

The t quantile comes from a table for 1 to 30 degrees of freedom (3 decimals, as printed in every
statistics textbook); beyond 30, the normal quantile ``z`` = 1.960 plus the first two terms of its
Cornish-Fisher expansion, ``(z³ + z) / (4 df) + (5z⁵ + 16z³ + 3z) / (96 df²)``, within 0.001 of the true
quantile there (2.040 at 31 df, 2.021 at 40, 1.980 at 120).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

T_975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
"""The 0.975 quantile of Student's t for 1, 2, ..., 30 degrees of freedom."""
Z_975 = 1.959964
"""The 0.975 quantile of the standard normal."""


def t_975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (two-sided 95 %).

    Raises:
        ValueError: ``df`` below 1.
    """
    if df < 1:
        raise ValueError(f"a t quantile needs at least 1 degree of freedom, got {df}")
    if df <= len(T_975):
        return T_975[df - 1]
    z = Z_975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


@dataclass(frozen=True)
class Interval:
    """A mean and its 95 % confidence interval ``[low, high]`` over ``n`` values (``low <= mean <= high``)."""

    mean: float
    low: float
    high: float
    n: int

    def __post_init__(self) -> None:
        if not self.low <= self.mean <= self.high:
            raise ValueError(f"an interval must hold its mean: {self.low} <= {self.mean} <= {self.high}")

    def above(self, value: float = 0.0) -> bool:
        """Whether the whole interval lies above ``value`` (its lower bound strictly)."""
        return self.low > value

    def text(self, signed: bool = False) -> str:
        """``0.62 [0.51, 0.73]``; ``signed``: ``+0.22 [+0.08, +0.36]``."""
        f = "+.2f" if signed else ".2f"
        return f"{self.mean:{f}} [{self.low:{f}}, {self.high:{f}}]"

    def as_dict(self) -> dict[str, float | int]:
        return {"mean": self.mean, "low": self.low, "high": self.high, "n": self.n}


def mean_interval(values: Sequence[float]) -> Interval:
    """The mean of ``values`` and its 95 % Student t interval.

    Raises:
        ValueError: fewer than 2 values (no spread to measure).
    """
    if len(values) < 2:
        raise ValueError(f"an interval needs at least 2 values, got {len(values)}")
    mean = statistics.fmean(values)
    half = t_975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return Interval(mean, mean - half, mean + half, len(values))


def paired_difference(first: Sequence[float], second: Sequence[float]) -> Interval:
    """The mean of ``first[i] - second[i]`` and its 95 % interval (a paired t interval).

    Raises:
        ValueError: the sequences differ in length, or hold fewer than 2 pairs.
    """
    if len(first) != len(second):
        raise ValueError(f"paired values need equal lengths, got {len(first)} and {len(second)}")
    return mean_interval([a - b for a, b in zip(first, second, strict=True)])
