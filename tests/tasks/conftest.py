"""Builders for task folders on disk, so each test states only what it changes; a local sandbox backend."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from harness_trainer.examples import TASKS as EXAMPLES  # noqa: F401 - for the tests here
from harness_trainer.examples import TOY_SKILLS  # noqa: F401 - for the tests here
from harness_trainer.sandboxes import LocalSandboxBackend

MINIMAL_TOML = 'version = "1.0"\n'
PASSING_TEST_SH = "#!/bin/bash\nmkdir -p /logs/verifier\necho 1 > /logs/verifier/reward.txt\n"

TaskWriter = Callable[..., Path]


def write_task(
    folder: Path,
    *,
    toml: str | None = MINIMAL_TOML,
    instruction: str | None = "Do the thing.\n",
    test_sh: str | None = PASSING_TEST_SH,
) -> Path:
    """A task folder at ``folder``; pass None to leave a file out."""
    folder.mkdir(parents=True, exist_ok=True)
    if toml is not None:
        (folder / "task.toml").write_text(toml)
    if instruction is not None:
        (folder / "instruction.md").write_text(instruction)
    if test_sh is not None:
        (folder / "tests").mkdir(exist_ok=True)
        (folder / "tests" / "test.sh").write_text(test_sh)
    return folder


@pytest.fixture
def task_writer(tmp_path: Path) -> TaskWriter:
    """``task_writer("train/a", instruction=…)`` writes a task folder under ``tmp_path``."""

    def write(relative: str, **kwargs: str | None) -> Path:
        return write_task(tmp_path / relative, **kwargs)

    return write


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[LocalSandboxBackend]:
    """A local sandbox backend; every sandbox it started is gone when the test ends."""
    backend = LocalSandboxBackend(tmp_path, kill_grace_s=0.5)
    yield backend
    await backend.aclose()
    assert backend.live == []
