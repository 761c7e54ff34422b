"""Rewards: parsing what a verifier wrote (every case), and run_verifier against a scripted sandbox."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness_trainer.rollouts.server.verifier import run_verifier
from harness_trainer.sandboxes.base import ExecResult, SandboxError
from harness_trainer.tasks import HarborTask, RewardResult, load_task, parse_reward

from .conftest import TaskWriter

# --- parse_reward ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [(b"1", 1.0), (b"0\n", 0.0), (b"  0.25 \n\n", 0.25), (b"-1.5", -1.5), (b"1e-3", 0.001), (b".5", 0.5)],
)
def test_reward_txt_holding_one_number_is_the_reward(text: bytes, expected: float) -> None:
    assert parse_reward(text, None) == RewardResult(expected, {"reward": expected}, "reward.txt")


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (b"", "reward.txt is empty"),
        (b" \n", "reward.txt is empty"),
        (b"pass", "does not hold one number"),
        (b"1\n0\n", "does not hold one number"),
        (b"true", "does not hold one number"),
        (b"nan", "does not hold one number"),
        (b"inf", "does not hold one number"),
        (b"1e999", "non-finite number"),
        (b"1_000", "does not hold one number"),
        (b"\xff\xfe", "not UTF-8"),
    ],
)
def test_garbage_in_reward_txt_is_ungraded_with_a_reason(text: bytes, problem: str) -> None:
    result = parse_reward(text, None)
    assert result.reward is None and result.rewards == {}
    assert problem in result.detail


@given(st.text(max_size=40))
def test_reward_txt_is_either_a_finite_number_or_ungraded_never_a_made_up_zero(text: str) -> None:
    result = parse_reward(text.encode(), None)
    if result.reward is None:
        assert result.detail and result.rewards == {}
    else:
        assert math.isfinite(result.reward) and result.reward == float(text.strip())  # str.strip: \x1f too


@given(st.binary(max_size=40))
def test_any_bytes_in_reward_json_parse_without_raising(data: bytes) -> None:
    result = parse_reward(None, data)
    assert result.reward is None or math.isfinite(result.reward)


def as_json(value: object) -> bytes:
    return json.dumps(value).encode()


def test_reward_json_with_one_score_gives_that_score() -> None:
    assert parse_reward(None, as_json({"pass_rate": 0.75})) == RewardResult(
        0.75, {"pass_rate": 0.75}, "reward.json['pass_rate']"
    )


def test_reward_json_with_several_scores_gives_the_one_named_reward() -> None:
    result = parse_reward(None, as_json({"style": 0.5, "reward": 1, "speed": 0.1}))
    assert result.reward == 1.0 and result.rewards == {"style": 0.5, "reward": 1.0, "speed": 0.1}


def test_reward_key_picks_a_score_from_reward_json() -> None:
    assert parse_reward(None, as_json({"style": 0.5, "reward": 1}), reward_key="style").reward == 0.5


def test_reward_key_prefers_reward_json_even_when_reward_txt_exists() -> None:
    assert parse_reward(b"0", as_json({"style": 0.5}), reward_key="style").reward == 0.5


def test_reward_txt_wins_over_reward_json_without_a_reward_key() -> None:
    assert parse_reward(b"1", as_json({"reward": 0.0})).reward == 1.0


def test_a_reward_key_that_reward_json_lacks_is_ungraded_and_lists_the_keys() -> None:
    result = parse_reward(None, as_json({"a": 1, "b": 0}), reward_key="c")
    assert result.reward is None and "no 'c'" in result.detail and "['a', 'b']" in result.detail
    assert result.rewards == {"a": 1.0, "b": 0.0}


def test_several_scores_and_none_named_reward_is_ungraded_and_lists_the_keys() -> None:
    result = parse_reward(None, as_json({"a": 1, "b": 0}))
    assert result.reward is None and "set reward_key" in result.detail and "['a', 'b']" in result.detail


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"{not json", "not valid JSON"),
        (b"", "not valid JSON"),
        (b"\xff", "not valid JSON"),
        (as_json([1.0]), "not an object of named numbers"),
        (as_json(1.0), "not an object of named numbers"),
        (as_json({"reward": True}), "reward.json['reward'] is not a finite number: True"),
        (as_json({"reward": "1"}), "is not a finite number: '1'"),
        (as_json({"reward": None}), "is not a finite number: None"),
        (b'{"reward": NaN}', "is not a finite number: nan"),
        (b'{"reward": Infinity}', "is not a finite number: inf"),
        (as_json({}), "0 scores and none named 'reward'"),
    ],
)
def test_garbage_in_reward_json_is_ungraded_with_a_reason(data: bytes, problem: str) -> None:
    result = parse_reward(None, data)
    assert result.reward is None and problem in result.detail


def test_garbage_beside_a_good_score_keeps_the_good_score_in_rewards() -> None:
    result = parse_reward(None, as_json({"reward": 1.0, "note": "fine"}))
    assert result.reward == 1.0 and result.rewards == {"reward": 1.0}


def test_no_reward_file_is_ungraded_not_zero() -> None:
    assert parse_reward(None, None) == RewardResult(None, {}, "the verifier wrote no reward")


# --- run_verifier -----------------------------------------------------------------------------------


@dataclass
class ScriptedSandbox:
    """A sandbox whose verifier run is scripted: ``on_test`` says what test.sh "does"."""

    id: str = "scripted"
    files: dict[str, bytes] = field(default_factory=dict)
    test_result: ExecResult = field(default_factory=lambda: ExecResult(0, "", ""))
    writes_on_test: dict[str, bytes] = field(default_factory=dict)
    setup_exit_code: int = 0
    fail_upload: bool = False
    commands: list[tuple[str, float | None, dict[str, str] | None]] = field(default_factory=list)
    uploads: list[tuple[Path, str]] = field(default_factory=list)

    async def exec(
        self,
        command: str,
        *,
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> ExecResult:
        self.commands.append((command, timeout_s, env))
        if command.startswith("bash /tests/test.sh"):
            self.files.update(self.writes_on_test)
            return self.test_result
        if "/logs/verifier" in command:  # the clean-up: stale rewards go
            self.files = {k: v for k, v in self.files.items() if not k.startswith("/logs/verifier/")}
            return ExecResult(self.setup_exit_code, "", "mkdir: read-only" if self.setup_exit_code else "")
        raise AssertionError(f"unexpected command {command!r}")

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        self.files[path] = data.encode() if isinstance(data, str) else data

    async def read_file(self, path: str) -> bytes:
        if path not in self.files:
            raise FileNotFoundError(path)
        return self.files[path]

    async def upload_dir(self, local: Path, remote: str) -> None:
        if self.fail_upload:
            raise SandboxError("upload failed: sandbox gone")
        self.uploads.append((local, remote))

    async def close(self) -> None:
        pass


@pytest.fixture
def task(task_writer: TaskWriter) -> HarborTask:
    return load_task(task_writer("t", toml='[verifier]\ntimeout_sec = 7\nenv = { MODE = "strict" }\n'))


async def test_the_verifier_runs_the_uploaded_tests_and_its_reward_is_read(task: HarborTask) -> None:
    sandbox = ScriptedSandbox(writes_on_test={"/logs/verifier/reward.txt": b"1\n"})
    outcome = await run_verifier(sandbox, task)
    assert (outcome.reward, outcome.detail, outcome.exit_code, outcome.timed_out) == (
        1.0,
        "reward.txt",
        0,
        False,
    )
    assert sandbox.uploads == [(task.tests_dir, "/tests")]
    command, timeout_s, env = sandbox.commands[-1]
    assert command == "bash /tests/test.sh" and timeout_s == 7.0 and env == {"MODE": "strict"}


async def test_a_reward_the_agent_wrote_before_the_verifier_is_not_read(task: HarborTask) -> None:
    sandbox = ScriptedSandbox(files={"/logs/verifier/reward.txt": b"1"})
    outcome = await run_verifier(sandbox, task)
    assert outcome.reward is None and outcome.detail == "the verifier wrote no reward"


async def test_a_given_timeout_overrides_the_tasks(task: HarborTask) -> None:
    sandbox = ScriptedSandbox(writes_on_test={"/logs/verifier/reward.txt": b"0"})
    outcome = await run_verifier(sandbox, task, timeout_s=2.5)
    assert outcome.reward == 0.0 and sandbox.commands[-1][1] == 2.5


async def test_a_failing_verifier_that_wrote_a_reward_still_counts(task: HarborTask) -> None:
    sandbox = ScriptedSandbox(
        test_result=ExecResult(1, "2 tests failed\n", ""), writes_on_test={"/logs/verifier/reward.txt": b"0"}
    )
    outcome = await run_verifier(sandbox, task)
    assert outcome.reward == 0.0 and outcome.exit_code == 1 and "2 tests failed" in outcome.output_tail


async def test_a_verifier_that_times_out_is_ungraded_and_marked(task: HarborTask) -> None:
    sandbox = ScriptedSandbox(
        test_result=ExecResult(None, "still going", "", timed_out=True),
        writes_on_test={"/logs/verifier/reward.txt": b"1"},
    )
    outcome = await run_verifier(sandbox, task)
    assert outcome.reward is None and outcome.timed_out and outcome.exit_code is None
    assert "timed out after 7 s" in outcome.detail


async def test_a_verifier_that_writes_garbage_is_ungraded_with_the_reason(task: HarborTask) -> None:
    sandbox = ScriptedSandbox(writes_on_test={"/logs/verifier/reward.txt": b"PASSED"})
    outcome = await run_verifier(sandbox, task)
    assert outcome.reward is None and "does not hold one number" in outcome.detail


async def test_reward_json_scores_come_back_named(task: HarborTask) -> None:
    sandbox = ScriptedSandbox(writes_on_test={"/logs/verifier/reward.json": b'{"reward": 1, "style": 0.5}'})
    outcome = await run_verifier(sandbox, task, reward_key="style")
    assert outcome.reward == 0.5 and outcome.rewards == {"reward": 1.0, "style": 0.5}


async def test_the_output_tail_keeps_the_last_four_kilobytes(task: HarborTask) -> None:
    sandbox = ScriptedSandbox(test_result=ExecResult(0, "x" * 10_000, "the end"))
    outcome = await run_verifier(sandbox, task)
    assert len(outcome.output_tail) == 4096 and outcome.output_tail.endswith("the end")


async def test_a_sandbox_that_fails_propagates_its_error(task: HarborTask) -> None:
    with pytest.raises(SandboxError, match="upload failed"):
        await run_verifier(ScriptedSandbox(fail_upload=True), task)
    with pytest.raises(SandboxError, match="could not prepare /logs/verifier"):
        await run_verifier(ScriptedSandbox(setup_exit_code=1), task)
