"""Shared fixtures: the tiny model, and dev engines running as real processes on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness_trainer.demo import free_port, wait_until_healthy
from harness_trainer.models.tiny import ensure_tiny_model

os.environ["HF_HUB_OFFLINE"] = "1"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return ensure_tiny_model()


@dataclass
class EngineProcess:
    """A ``harness-trainer engine`` subprocess; ``url`` has no trailing ``/v1``."""

    url: str
    process: subprocess.Popen
    model: str

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_engine(model_dir: Path, *extra: str, name: str = "tiny") -> EngineProcess:
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "harness_trainer.cli",
            "engine",
            "--model",
            str(model_dir),
            "--port",
            str(port),
            "--served-model-name",
            name,
            *extra,
        ],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    engine = EngineProcess(url=f"http://127.0.0.1:{port}", process=process, model=name)
    try:
        wait_until_healthy(engine.url, process)
    except BaseException:
        engine.stop()
        raise
    return engine


@pytest.fixture(scope="session")
def engine(tiny_model_dir: Path) -> Iterator[EngineProcess]:
    """One sampling engine shared by the tests that do not change its weights."""
    running = start_engine(tiny_model_dir)
    yield running
    running.stop()
    assert running.process.returncode is not None
