"""Shared fixtures: the tiny model, and dev engines running as real processes on loopback."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness_trainer.dev_engine.process import EngineProcess, start_engine
from harness_trainer.models.tiny import ensure_tiny_model

os.environ["HF_HUB_OFFLINE"] = "1"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return ensure_tiny_model()


@pytest.fixture(scope="session")
def engine(tiny_model_dir: Path) -> Iterator[EngineProcess]:
    """One sampling engine shared by the tests that do not change its weights."""
    running = start_engine(tiny_model_dir)
    yield running
    running.stop()
    assert running.process.returncode is not None
