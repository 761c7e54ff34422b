"""The dev engine as a child process: started on a free loopback port, ready once healthy, always stopped."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from harness_trainer.net import free_port, wait_until_healthy


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


def start_engine(
    model_dir: str | Path,
    *extra: str,
    name: str = "tiny",
    output: IO[bytes] | int | None = None,
    own_session: bool = False,
    port: int | None = None,
    started: Callable[[EngineProcess], None] | None = None,
) -> EngineProcess:
    """Start a dev engine serving ``model_dir`` as ``name`` (``extra``: more ``engine`` flags) on ``port``
    (default: a free one); returns once it answers ``/health``. ``output`` takes the engine's stdout and
    stderr (default: inherited); ``own_session`` keeps a terminal's Ctrl-C away from it, so its owner
    decides when it stops. ``started`` is handed the engine as soon as its process exists, before the wait:
    an owner stopped while the engine comes up has it to stop."""
    port = free_port() if port is None else port
    process = subprocess.Popen(
        [sys.executable, "-m", "harness_trainer.cli", "engine", "--model", str(model_dir),
         "--port", str(port), "--served-model-name", name, *extra],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdout=output,
        stderr=subprocess.STDOUT if output is not None else None,
        start_new_session=own_session,
    )  # fmt: skip
    engine = EngineProcess(url=f"http://127.0.0.1:{port}", process=process, model=name)
    if started is not None:
        started(engine)
    try:
        wait_until_healthy(engine.url, process)
    except BaseException:
        engine.stop()
        raise
    return engine
