"""A verifier in a sandbox of its own (Harbor's ``[verifier] environment_mode = "separate"``): the agent's
sandbox is archived to its artifacts (``/logs/artifacts`` and the task's ``artifacts``), a second sandbox is
started from the verifier's environment (``tests/``'s Dockerfile, whose image holds ``/tests``; or, without
one, a fresh sandbox of the task's environment with ``tests/`` copied in), the artifacts are unpacked there,
and the verifier runs; that sandbox is closed on every path.

The task (``tests/harbor_shaped/separate/price-summary``, written here in Harbor's shape) grades one
artifact, ``/app/summary.json``, and also scores ``isolated``: 1 when its sandbox holds neither the task's
input file nor the scratch file the solution leaves beside the artifact. The toy agent replays the
solution on the local sandbox (fast tier), real mini-swe-agent on Docker, where the verifier's image is
built from ``tests/`` (``FROM python:3.12-slim``, stood in for by the local base with Python).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness_trainer.net import free_port
from harness_trainer.rollouts.result import RolloutOptions
from harness_trainer.rollouts.server.runtime import RolloutRuntime, RuntimeConfig
from harness_trainer.tasks.loader import load_task
from harness_trainer.tasks.task import TaskError
from tests.conftest import EngineProcess
from tests.rollouts.test_multi_step import Replies, for_the_local_sandbox, give_up, replay

TASK = Path(__file__).resolve().parents[1] / "harbor_shaped" / "separate" / "price-summary"


def solution(folder: Path = TASK) -> str:
    return (folder / "solution" / "solve.sh").read_text()


def test_the_task_loads_with_its_verifiers_environment_and_artifacts() -> None:
    task = load_task(TASK)
    separate = task.separate_verifier
    assert separate is not None and separate.from_tests
    assert separate.artifacts == ("/logs/artifacts", "/app/summary.json")
    assert (separate.environment.memory_mb, separate.environment.allow_internet) == (512, False)
    verifier = task.verifier_task()
    assert verifier.name == "price-summary-verifier" and verifier.dockerfile == TASK / "tests" / "Dockerfile"
    assert verifier.environment_dir == TASK / "tests" and verifier.artifact_dirs == ("/app", "/logs")
    assert task.dockerfile == TASK / "environment" / "Dockerfile"  # the agent's own is untouched


@pytest.mark.parametrize(
    ("verifier", "message"),
    [
        ('environment_mode = "apart"', "environment_mode: expected shared or separate"),
        (
            'environment_mode = "shared"\n[verifier.environment]\ncpus = 1',
            'environment_mode = "shared" with a',
        ),
    ],
)
def test_a_verifier_mode_harbor_refuses_is_refused(tmp_path: Path, verifier: str, message: str) -> None:
    folder = tmp_path / "t"
    shutil.copytree(TASK, folder)
    text = (folder / "task.toml").read_text()
    start = text.index("[verifier]")
    (folder / "task.toml").write_text(text[:start] + f"[verifier]\n{verifier}\n")
    with pytest.raises(TaskError, match="verifier"):
        load_task(folder)
    with pytest.raises(TaskError) as refused:
        load_task(folder)
    assert message in str(refused.value)


def spy_on_lifetimes(runtime: RolloutRuntime, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The lifetimes of the local sandboxes ``runtime`` starts from now on, each from its backend's start
    returning to its close ending (the local sandbox's ``on_close``), as they close."""
    backend = runtime.backend("local").backend
    start, lifetimes = backend.start, []

    async def spied(*args: Any, **kwargs: Any) -> Any:
        sandbox = await start(*args, **kwargs)
        opened = time.monotonic()
        sandbox.on_close.append(lambda _: lifetimes.append(time.monotonic() - opened))
        return sandbox

    monkeypatch.setattr(backend, "start", spied)
    return lifetimes


async def test_the_verifier_sees_only_the_artifacts_in_its_own_sandbox(
    runtime_for: Callable[[Replies], Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = for_the_local_sandbox(TASK, tmp_path)
    task = load_task(local, split="separate")
    runtime = await runtime_for([*replay("toy", solution()), *give_up("toy"), *replay("toy", solution())])
    options = RolloutOptions(harness="toy", sandbox="local", agent_timeout_sec=120)
    lifetimes = spy_on_lifetimes(runtime, monkeypatch)
    solved = await runtime.rollout(task, options)
    assert solved.error is None, solved.error
    assert (solved.reward, solved.rewards) == (1.0, {"reward": 1.0, "isolated": 1.0}), solved.log_tail
    # Its sandbox-seconds: the agent's sandbox and the verifier's, each from start to close, summed.
    assert len(lifetimes) == 2 and solved.sandbox_seconds == pytest.approx(sum(lifetimes), abs=0.02)
    unsolved = await runtime.rollout(task, options)
    assert unsolved.error is None and unsolved.rewards == {"reward": 0.0, "isolated": 1.0}
    # Without tests/Dockerfile: a fresh sandbox of the task's own environment, tests/ copied in; it has the
    # task's input (the image's), but still not the agent's scratch file.
    plain = tmp_path / "plain"
    shutil.copytree(local, plain)
    (plain / "tests" / "Dockerfile").unlink()
    fresh = load_task(plain, split="separate")
    assert fresh.separate_verifier is not None and not fresh.separate_verifier.from_tests
    result = await runtime.rollout(fresh, options)
    assert result.error is None and result.rewards == {"reward": 1.0, "isolated": 0.0}  # prices.csv is there
    assert not Path("/app/summary.json").exists()  # the local verifier's /app was its own, not this machine's


async def test_a_verifier_environment_that_cannot_start_makes_the_rollout_unscorable(
    runtime_for: Callable[[Replies], Any], tmp_path: Path
) -> None:
    broken = for_the_local_sandbox(TASK, tmp_path)
    (broken / "tests" / "Dockerfile").write_text("FROM scratch\nCOPY missing.txt /tests/\n")
    task = load_task(broken, split="separate")
    runtime = await runtime_for([*replay("toy", solution(broken))])
    result = await runtime.rollout(
        task, RolloutOptions(harness="toy", sandbox="local", agent_timeout_sec=120)
    )
    assert result.reward is None and result.error_kind == "sandbox", result.error
    assert "missing.txt" in (result.error or "")


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_mini_swe_agent_is_graded_by_a_verifier_image_built_from_tests_on_docker(
    runtime_for: Callable[[Replies], Any],
) -> None:
    task = load_task(TASK, split="separate")
    runtime = await runtime_for(replay("mini-swe-agent", solution()))
    assert await runtime.prepare([task], "docker") == 1  # the verifier's image is built beside the agent's
    options = RolloutOptions(harness="mini-swe-agent", sandbox="docker", agent_timeout_sec=300)
    result = await runtime.rollout(task, options)
    assert result.error is None, result.error
    assert result.rewards == {"reward": 1.0, "isolated": 1.0}, result.log_tail[-3000:]


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_the_verifier_gets_a_template_of_its_own_in_the_fake_e2b_cloud(
    scripted_engine: Callable[[Replies], EngineProcess], tmp_path: Path
) -> None:
    """E2B: the verifier's template is built from ``tests/`` beside the agent's; both sandboxes are killed."""
    import tempfile

    from tests.sandboxes.fake_e2b import FakeE2BCloud

    task = load_task(TASK, split="separate")
    engine = scripted_engine(replay("toy", solution()))
    with tempfile.TemporaryDirectory(prefix="ht-separate-e2b-", dir="/var/tmp") as scratch:
        cloud = FakeE2BCloud(Path(scratch) / "cloud")
        e2b = {"sandbox_class": cloud, "template_class": cloud.template_class, "build_log_dir": Path(scratch)}
        config = RuntimeConfig(
            upstream=engine.url, data_dir=tmp_path / "capture", capture_port=free_port(),
            sandbox_options={"e2b": e2b},
        )  # fmt: skip
        runtime = RolloutRuntime(config)
        await runtime.start()
        try:
            assert await runtime.prepare([task], "e2b") == 1
            options = RolloutOptions(harness="toy", sandbox="e2b", agent_timeout_sec=300)
            result = await runtime.rollout(task, options)
            assert result.error is None, result.error
            assert result.rewards == {"reward": 1.0, "isolated": 1.0}, result.reward_detail
            assert await runtime.open_capture_sessions() == 0
        finally:
            await runtime.aclose()
        # The preparation's probe (it reaches the capture proxy), the agent's, the verifier's: all killed.
        assert len(cloud.sandboxes) == 3 and all(sandbox.killed for sandbox in cloud.sandboxes)
        assert len(cloud.template_class.builds) == 2  # the agent's and the verifier's
