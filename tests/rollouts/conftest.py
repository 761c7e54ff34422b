"""Fixtures: a scripted dev engine (real process) and the toy tasks shipped in ``examples/tasks``."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import EngineProcess, start_engine

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tasks"


def bash_call(command: str) -> dict[str, Any]:
    """A scripted assistant reply that calls the ``bash`` tool once."""
    return {
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "bash", "arguments": {"command": command}}}],
    }


@pytest.fixture
def scripted_engine(
    tiny_model_dir: Path, tmp_path: Path
) -> Iterator[Callable[[list[dict[str, Any]]], EngineProcess]]:
    """Start a dev engine that replies with the given assistant messages, in order."""
    started: list[EngineProcess] = []

    def start(replies: list[dict[str, Any]]) -> EngineProcess:
        script = tmp_path / f"script-{len(started)}.jsonl"
        script.write_text("\n".join(json.dumps(reply) for reply in replies))
        engine = start_engine(tiny_model_dir, "--script", str(script), name="tiny")
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.stop()


def live_sandbox_processes() -> list[str]:
    """Processes still running in a mount namespace made by a local sandbox (should be none)."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "toy_agent.py" in line and str(os.getpid()) not in line]
