"""Fixtures shared by the trainer's tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def fresh_accelerate():
    """accelerate keeps one mixed-precision setting per process: start from none, and leave none behind
    (a test that sets one, as TRL's SFTTrainer does with bf16, must not put later tests under it)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
