"""The argparse types of the launch commands' flags (``serve``, ``e2b smoke``): a bad value is argparse's
usage error, not a traceback."""

from __future__ import annotations

import argparse


def non_negative_int(text: str) -> int:
    """``text`` as an int ≥ 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """``text`` as a float ≥ 0 (nan refused)."""
    value = float(text)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value
