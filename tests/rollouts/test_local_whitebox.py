"""White-box sessions in process (``LocalWhiteBoxSessionFactory``): the bundled tasks in real local sandboxes,
no server and no engine; the test is the adapter, calling the session's tools."""

from __future__ import annotations

import random
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openenv.core.harness")  # white-box sessions speak OpenEnv's types: the `openenv` extra

from openenv.core.harness import ResourceSession, ResourceSessionFactory

from harness_trainer.rollouts.client.local_whitebox import LocalWhiteBoxSessionFactory
from harness_trainer.rollouts.errors import RolloutConfigError, RolloutUnscorable
from harness_trainer.rollouts.server.environment import EpisodeOver
from harness_trainer.sandboxes.tools import ToolLimits
from tests.rollouts.conftest import EXAMPLES
from tests.rollouts.test_whitebox_server import sleeping, wait_for

HELLO = "hello-file"
HELLO_INSTRUCTION = (EXAMPLES / "train" / HELLO / "instruction.md").read_text().strip()
VERIFY_METRICS = {
    "tool_calls_by_name", "tool_failures_by_name", "tool_failure_count", "rewards", "submitted",
    "verifier_exit_code", "verifier_timed_out", "phase_seconds", "sandbox_seconds", "session_id",
}  # fmt: skip
"""The metrics ``WhiteBoxSession.verify`` (the HTTP session) returns."""


def roots(base: Path) -> list[str]:
    """Local sandbox roots still on disk under ``base`` (each open sandbox has one)."""
    return sorted(p.name for p in base.glob("ht-*"))


def make_factory(base: Path, tasks: Any = EXAMPLES, **options: Any) -> LocalWhiteBoxSessionFactory:
    base.mkdir(parents=True, exist_ok=True)
    local = {"local": {"base_dir": str(base)}}
    return LocalWhiteBoxSessionFactory(str(tasks), sandbox_options=local, **options)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("local-whitebox")


@pytest.fixture(scope="module")
def module_factory(base: Path) -> Iterator[LocalWhiteBoxSessionFactory]:
    with make_factory(base) as made:
        yield made


@pytest.fixture
def factory(module_factory: LocalWhiteBoxSessionFactory, base: Path) -> Iterator[LocalWhiteBoxSessionFactory]:
    yield module_factory
    assert module_factory._sessions == set(), "a session was left open"
    assert module_factory.backend.live == [] and roots(base) == [], "a sandbox was left open"


def hello_row(factory: LocalWhiteBoxSessionFactory) -> dict[str, Any]:
    return next(row for row in factory.prompt_rows() if row["task_name"] == HELLO)


def test_the_factory_is_an_openenv_resource_session_factory_with_prompt_rows(
    factory: LocalWhiteBoxSessionFactory,
) -> None:
    assert isinstance(factory, ResourceSessionFactory)
    rows = factory.prompt_rows()
    assert [row["task_name"] for row in rows] == sorted(p.name for p in (EXAMPLES / "train").iterdir())
    assert all(set(row) == {"prompt", "task_index", "task_name"} for row in rows)
    assert hello_row(factory)["prompt"][0]["content"].strip() == HELLO_INSTRUCTION


def test_a_bash_command_solves_the_task_and_verify_gives_reward_1(
    factory: LocalWhiteBoxSessionFactory, base: Path
) -> None:
    row = hello_row(factory)
    with factory.create(row, seed=3, episode_id="e1") as session:
        assert isinstance(session, ResourceSession)
        assert session.initial_messages() == row["prompt"] and session.task["name"] == HELLO
        names = [t.name for t in session.list_tools()]
        assert names == ["bash", "read_file", "write_file", "list_dir", "submit"]
        assert len(roots(base)) == 1 and len(factory.backend.live) == 1
        ran = session.call_tool("bash", {"command": "printf 'Hello, Harbor!\\n' > /app/hello.txt && ls /app"})
        assert ran.error is None and "hello.txt" in ran.data and ran.metadata["exit_code"] == 0
        assert session.call_tool("read_file", {"path": "hello.txt"}).data == "Hello, Harbor!\n"
        submitted = session.call_tool("submit", {"summary": "wrote it"})
        assert submitted.done and submitted.error is None
        verdict = session.verify([])
        assert verdict.env_reward == 1.0 and verdict.done
        assert set(verdict.metrics) == VERIFY_METRICS
        assert verdict.metrics["tool_calls_by_name"] == {"bash": 1, "read_file": 1, "submit": 1}
        assert verdict.metrics["tool_failure_count"] == 0 and verdict.metrics["submitted"]
        assert verdict.metrics["session_id"] == session.session_id
        assert set(verdict.metrics["phase_seconds"]) == {"sandbox_start", "tools", "upload", "verifier"}
        assert verdict.metrics["phase_seconds"]["tools"] > 0  # the three calls, summed
        phases = verdict.metrics["phase_seconds"]  # its sandbox is open through the calls and the verifier
        assert phases["tools"] + phases["upload"] + phases["verifier"] <= verdict.metrics["sandbox_seconds"]
        assert verdict.artifacts["summary"] == "wrote it"
        assert roots(base) == [], "verify ends the episode: its sandbox is closed"
        assert session.verify([]).env_reward == 1.0  # again: the same verdict
        with pytest.raises(EpisodeOver):
            session.call_tool("bash", {"command": "true"})


def test_an_untouched_sandbox_gets_reward_0_and_write_file_changes_the_sandbox(
    factory: LocalWhiteBoxSessionFactory,
) -> None:
    with factory.create(HELLO_INSTRUCTION) as before:  # found by its instruction
        assert before.verify([]).env_reward == 0.0
    with factory.create(hello_row(factory)["prompt"]) as session:  # by its messages
        written = session.call_tool("write_file", {"path": "/app/hello.txt", "content": "Hello, Harbor!\n"})
        assert written.error is None and "/app/hello.txt" in written.data
        assert session.call_tool("bash", {"command": "cat /app/hello.txt"}).data.startswith("Hello, Harbor!")
        assert session.verify([]).env_reward == 1.0


def test_the_models_mistakes_come_back_as_error_results_and_are_counted(
    factory: LocalWhiteBoxSessionFactory,
) -> None:
    with factory.create(hello_row(factory)["task_index"]) as session:
        unknown = session.call_tool("nope", {})
        assert unknown.error is not None and "unknown tool 'nope'" in unknown.error
        bad = session.call_tool("write_file", {"path": "x"})
        assert bad.error is not None and "content" in bad.error and bad.data.endswith(bad.error)
        missing = session.call_tool("read_file", {"path": "/app/missing.txt"})
        assert missing.error == "no such file: /app/missing.txt"
        failing = session.call_tool("bash", {"command": "echo out; exit 3"})
        assert failing.error is None and failing.metadata["exit_code"] == 3  # the command's own failure
        metrics = session.verify([]).metrics
        assert metrics["tool_calls_by_name"] == {"nope": 1, "write_file": 1, "read_file": 1, "bash": 1}
        assert metrics["tool_failure_count"] == 3


def test_tool_limits_reach_the_sandbox_tools(base: Path) -> None:
    limits = ToolLimits(default_timeout_s=1.0, max_timeout_s=2.0, max_output_chars=100)
    with make_factory(base, tool_limits=limits) as factory, factory.create(0) as session:
        assert session.list_tools()[0].input_schema["properties"]["timeout"]["maximum"] == 2.0
        slow = session.call_tool("bash", {"command": "sleep 5"})
        assert slow.error is not None and "timeout" in slow.error and slow.metadata["timed_out"]
        assert session.call_tool("bash", {"command": "seq 1 1000"}).metadata["cut_chars"] > 0
    assert roots(base) == []


def test_close_kills_what_runs_in_the_sandbox_and_leaves_no_sandbox(
    factory: LocalWhiteBoxSessionFactory, base: Path
) -> None:
    marker = f"{random.randint(100_000, 999_999)}"
    session = factory.create(hello_row(factory))
    started = session.call_tool("bash", {"command": f"nohup sleep {marker} >/dev/null 2>&1 &"})
    assert started.error is None and wait_for(lambda: sleeping(marker))
    session.close()
    session.close()  # idempotent
    assert wait_for(lambda: not sleeping(marker)), "the sandbox's processes outlived its session"
    assert roots(base) == [] and factory.backend.live == []
    with pytest.raises(RuntimeError, match="closed"):
        session.call_tool("bash", {"command": "true"})


def test_close_during_a_tool_call_cancels_it(factory: LocalWhiteBoxSessionFactory, base: Path) -> None:
    marker = f"{random.randint(100_000, 999_999)}"
    session = factory.create(hello_row(factory))
    raised: list[BaseException] = []

    def call() -> None:
        try:
            session.call_tool("bash", {"command": f"sleep {marker}"})
        except BaseException as exc:
            raised.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    assert wait_for(lambda: sleeping(marker))
    session.close()
    caller.join(30)
    assert len(raised) == 1 and isinstance(raised[0], RolloutUnscorable) and raised[0].kind == "sandbox"
    assert wait_for(lambda: not sleeping(marker)) and roots(base) == []


def test_closing_the_factory_closes_every_open_session_and_stops_its_thread(tmp_path: Path) -> None:
    factory = make_factory(tmp_path)
    sessions = [factory.create(0), factory.create(1)]
    assert len(roots(tmp_path)) == 2
    factory.close()
    factory.close()  # idempotent
    assert roots(tmp_path) == [] and factory.backend.live == []
    assert not factory._thread.is_alive()
    for session in sessions:
        session.close()  # after the factory: nothing left to do, no error
    with pytest.raises(RuntimeError, match="closed"):
        factory.create(0)


def test_a_sandbox_that_fails_to_start_is_unscorable(tmp_path: Path) -> None:
    broken = tmp_path / "tasks" / "train" / "broken"
    shutil.copytree(EXAMPLES / "train" / HELLO, broken)
    (broken / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\nRUN exit 3\n")
    with make_factory(tmp_path / "sandboxes", tasks=tmp_path / "tasks") as factory:
        with pytest.raises(RolloutUnscorable, match="did not start") as raised:
            factory.create(0)
        assert raised.value.kind == "sandbox" and factory._sessions == set()
    assert roots(tmp_path / "sandboxes") == []


def test_bad_settings_are_refused_when_the_factory_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    loops = sum(t.name == "local-whitebox" for t in threading.enumerate())
    for options, says in [
        ({"split": "nope"}, "nope"),
        ({"sandbox": "nope"}, "known: docker, e2b, hf, local"),
        ({"sandbox": "e2b"}, "E2B_API_KEY"),
        ({"episode_timeout_sec": -1}, "episode_timeout_sec"),
    ]:
        with pytest.raises(RolloutConfigError, match=says):
            LocalWhiteBoxSessionFactory(str(EXAMPLES), **options)
    assert sum(t.name == "local-whitebox" for t in threading.enumerate()) == loops, "a refused factory runs"
    with make_factory(tmp_path) as factory:
        with pytest.raises(KeyError, match="no task"):
            factory.create("no task says this")
        with pytest.raises(IndexError):
            factory.create(99)


def test_sessions_run_from_several_threads_at_once(factory: LocalWhiteBoxSessionFactory) -> None:
    """Each session is used from its own thread, as the trainer's rollouts are."""
    results: dict[int, float | None] = {}

    def episode(index: int) -> None:
        with factory.create(hello_row(factory)) as session:
            if index:
                session.call_tool("write_file", {"path": "/app/hello.txt", "content": "Hello, Harbor!\n"})
            results[index] = session.verify([]).env_reward

    threads = [threading.Thread(target=episode, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert results == {0: 0.0, 1: 1.0}
