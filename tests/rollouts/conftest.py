"""Fixtures: a scripted dev engine (real process) and the toy tasks shipped in the package
(``harness_trainer/examples/tasks``)."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from harness_trainer.examples import TASKS as EXAMPLES  # noqa: F401 - for the tests here
from tests.conftest import EngineProcess, start_engine


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
    """Agent processes descended from this test process that are still running (should be none)."""
    parents: dict[int, int] = {}
    commands: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            commands[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])

    def descends(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == os.getpid():
                return True
        return False

    return [f"{pid} {cmd}" for pid, cmd in commands.items() if "toy_agent.py" in cmd and descends(pid)]


@pytest.fixture
async def runtime_for(
    scripted_engine: Callable[[list[dict[str, Any]]], EngineProcess], tmp_path: Path
) -> AsyncIterator[Callable[[list[dict[str, Any]]], Any]]:
    """``await runtime_for(replies)``: a started in-process rollout runtime (capture proxy on a free port)
    whose engine replies with ``replies``; every one is checked to leave no capture session open, then
    closed."""
    from harness_trainer.net import free_port
    from harness_trainer.rollouts.server.runtime import RolloutRuntime, RuntimeConfig

    started: list[RolloutRuntime] = []

    async def start(script: list[dict[str, Any]]) -> RolloutRuntime:
        engine = scripted_engine(script)
        config = RuntimeConfig(upstream=engine.url, data_dir=tmp_path / "capture", capture_port=free_port())
        runtime = RolloutRuntime(config)
        started.append(runtime)
        await runtime.start()
        return runtime

    yield start
    for runtime in started:
        assert await runtime.open_capture_sessions() == 0
        await runtime.aclose()
