"""The real agents, end to end on CPU: the pinned binary in a local sandbox, pointed at a real capture proxy
in front of the dev engine in scripted mode, solves a toy task from ``harness_trainer/examples/tasks``.

Each script is what that agent's model would write, in the agent's own tool names and argument shapes,
then a last answer. Asserted: the task's verifier gives 1.0; the agent's log counts the calls it made;
the session's TrainingTrace validates; it has one supervised turn per scripted reply, and each turn's
trained ids are exactly the ids the chat template gives that reply after that turn's prompt (rendered
again here with the tiny tokenizer, independently of the engine). Afterwards no sandbox, agent process
or capture session is left.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from harness_trainer.dev_engine.script import completion_ids
from harness_trainer.devloop.prompts import MINI_SWE_AGENT_COMPACT
from harness_trainer.harnesses import make_harness
from harness_trainer.harnesses.base import AgentEndpoint, AgentRun
from harness_trainer.harnesses.bundles import host_bundles_dir
from harness_trainer.harnesses.tools import ToolPackage, host_tools_dir
from harness_trainer.rollouts.agreement import agreement
from harness_trainer.rollouts.server.verifier import run_verifier
from harness_trainer.sandboxes.local import LocalSandboxBackend
from harness_trainer.tasks import load_task
from harness_trainer.trace import load_trace
from tests.hardening.faults import alive, descendants, describe
from tests.harnesses.conftest import EXAMPLES, CaptureStack

pytestmark = pytest.mark.slow
TIMEOUT_S = 150.0
RECORDING = ("opencode", "claude-code", "codex", "gemini-cli", "qwen-code")
"""The agents whose own record (opencode's export, Claude Code's session transcript, Codex's rollout file,
gemini-cli's chat recording, Qwen Code's request logs) is checked against the capture here; mini-swe-agent's
and pi's are checked on Docker and in the fake E2B cloud (tests/rollouts/test_harbor_shaped.py)."""


def call(name: str, **arguments: Any) -> dict[str, Any]:
    """A scripted assistant reply that calls one tool."""
    return {
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}],
    }


@dataclass
class Case:
    harness: str
    task: str
    replies: list[dict[str, Any]]
    tools: dict[str, int]
    failures: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    prompt: tuple[str, ...] = ()
    """What the agent's first prompt must say (its options' prompts reached the agent)."""
    not_prompt: tuple[str, ...] = ()
    """What it must not say."""
    id: str = ""


CASES = [
    Case(
        "opencode",
        "train/fix-calc-bug",
        [
            call("read", filePath="/app/calc.py"),
            call(
                "edit",
                filePath="/app/calc.py",
                oldString="total(values) / (len(values) + 1)",
                newString="total(values) / len(values)",
            ),
            call(
                "bash",
                command="python3 -c 'import calc; print(calc.mean([1, 2, 3, 4]))'",
                description="Check",
            ),
            {"content": "Fixed: `mean` now divides by `len(values)`."},
        ],
        {"read": 1, "edit": 1, "bash": 1},
        options={"max_output_tokens": 1024},
    ),
    Case(
        "mini-swe-agent",
        "test/sum-numbers",
        [
            {**call("bash", command="cat /app/numbers.txt"), "content": "Let me see the numbers."},
            call("bash", command="awk '{s += $1} END {print s}' /app/numbers.txt > /app/sum.txt"),
            call("bash", command="echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"),
        ],
        {"bash": 3},
    ),
    Case(  # the dev loop's compact prompt, given as the harness's agent_config
        "mini-swe-agent",
        "train/hello-file",
        [
            call("bash", command="printf 'Hello, Harbor!\\n' > /app/hello.txt"),
            call("bash", command="echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"),
        ],
        {"bash": 2},
        options={"agent_config": MINI_SWE_AGENT_COMPACT},
        prompt=("one command per response", "Task: Create the file `/app/hello.txt`"),
        not_prompt=("Recommended Workflow",),
        id="mini-swe-agent-compact",
    ),
    Case(
        "claude-code",
        "test/greet-script",
        [
            call("Read", file_path="/app/greet.sh"),
            call("Write", file_path="/app/greet.sh", content='#!/bin/bash\necho "Hello, ${1:-world}!"\n'),
            call("Bash", command="bash /app/greet.sh Ada", description="Try the script"),
            {"content": "Wrote `/app/greet.sh`."},
        ],
        {"Read": 1, "Write": 1, "Bash": 1},
        failures=1,  # the script did not exist yet
        options={"max_output_tokens": 1024},
    ),
    Case(
        "codex",
        "train/count-lines",
        [
            call("exec_command", cmd="wc -l /app/data/words.txt"),
            call("exec_command", cmd="cat /app/data/missing.txt"),
            call("exec_command", cmd="wc -l < /app/data/words.txt | tr -d ' ' > /app/count.txt"),
            {"content": "Wrote the line count to `/app/count.txt`."},
        ],
        {"exec_command": 3},
        failures=1,
    ),
    Case(
        "gemini-cli",
        "test/sum-numbers",
        [
            call("read_file", file_path="/app/sum.txt"),
            call("run_shell_command", command="awk '{s += $1} END {print s}' /app/numbers.txt"),
            call("write_file", file_path="/app/sum.txt", content="145\n"),
            {"content": "Wrote the sum, 145, to `/app/sum.txt`."},
        ],
        {"read_file": 1, "run_shell_command": 1, "write_file": 1},
        failures=1,  # the sum file did not exist yet
        options={"max_output_tokens": 512},  # its prompt alone is 15k of the tiny model's 16k tokens
    ),
    Case(
        "pi",
        "train/fix-calc-bug",
        [
            call("read", path="/app/calc.py"),
            call("read", path="/app/test_calc.py"),
            call(
                "edit",
                path="/app/calc.py",
                edits=[
                    {"oldText": "total(values) / (len(values) + 1)", "newText": "total(values) / len(values)"}
                ],
            ),
            call("bash", command="python3 -c 'import calc; print(calc.mean([1, 2, 3, 4]))'"),
            {"content": "Fixed: `mean` now divides by `len(values)`."},
        ],
        {"read": 2, "edit": 1, "bash": 1},
        failures=1,  # there is no test_calc.py
        options={"max_output_tokens": 1024},
    ),
    Case(
        "qwen-code",
        "train/count-lines",
        [
            call("run_shell_command", command="wc -l < /app/data/words.txt", description="Count the lines"),
            call("read_file", file_path="/app/data/missing.txt"),
            call("write_file", file_path="/app/count.txt", content="12\n"),
            {"content": "Wrote the line count, 12, to `/app/count.txt`."},
        ],
        {"run_shell_command": 1, "read_file": 1, "write_file": 1},
        failures=1,  # there is no missing.txt
        # its own system prompt is 8k tokens of the tiny model's 16k: only the tools the script uses
        options={"max_output_tokens": 1024, "tools": ("run_shell_command", "read_file", "write_file")},
    ),
    Case(  # no tool calls: a SEARCH/REPLACE block that creates the file, then a fenced shell command
        "aider",
        "train/hello-file",
        [
            {
                "content": "hello.txt\n```\n<<<<<<< SEARCH\n=======\nHello, Harbor!\n>>>>>>> REPLACE\n```\n\n"
                "```bash\ncat hello.txt\n```\n"
            }
        ],
        {"edit": 1, "shell": 1},
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[case.id or case.harness for case in CASES])
async def test_real_agent_solves_a_toy_task_and_trains_on_exactly_the_scripted_ids(
    case: Case,
    capture_stack: Callable[[list[dict[str, Any]]], CaptureStack],
    install_agent: Callable[[ToolPackage], Path],
    tiny_tokenizer: Any,
) -> None:
    harness = make_harness(case.harness, **case.options)
    install_agent(harness.package)  # type: ignore[attr-defined]
    stack = capture_stack(case.replies)
    session_id = stack.new_session()
    started = time.monotonic()
    run, reward = await _run_in_local_sandbox(
        harness, case.task, AgentEndpoint(stack.url, session_id, "tiny")
    )
    assert time.monotonic() - started < TIMEOUT_S

    assert run.result.exit_code == 0 and not run.result.timed_out, run.result.stderr[-3000:] + run.log[-3000:]
    assert reward == 1.0
    assert run.tools.calls_by_name == case.tools and run.tools.failures == case.failures

    calls = stack.get(f"/sessions/{session_id}/calls")["calls"]
    first_prompt = json.dumps(calls[0]["upstream_request"]["messages"])
    assert all(json.dumps(says)[1:-1] in first_prompt for says in case.prompt), first_prompt[:2000]
    assert not any(json.dumps(lacks)[1:-1] in first_prompt for lacks in case.not_prompt)
    trace = load_trace(stack.get(f"/sessions/{session_id}/trace"), session_id=session_id)
    assert len(calls) == len(trace.turns) == len(case.replies)
    assert [call["kind"] for call in calls] == ["model"] * len(case.replies)  # keeping a record adds no call
    if case.harness in RECORDING:  # its own record says, call by call, what the proxy saw
        verdict = agreement(run.record, [turn.request for turn in trace.turns])
        assert (verdict.status, verdict.agent_calls) == ("match", len(case.replies)), verdict
    for turn, record, reply in zip(trace.turns, calls, case.replies, strict=True):
        request = record["upstream_request"]
        scripted = {"role": "assistant", **reply}
        expected = completion_ids(tiny_tokenizer, request["messages"], request.get("tools"), scripted)
        prompt_length = len(turn.prompt_token_ids)
        assert turn.completion_token_ids == expected == record["completion_token_ids"]
        assert turn.loss_mask[prompt_length:] == [1] * len(expected)
        assert turn.prompt_token_ids == record["prompt_token_ids"]
    assert _agent_processes_after_teardown() == []
    assert stack.admin.delete(f"/sessions/{session_id}").status_code in (200, 204)
    assert stack.get("/sessions")["sessions"] == []


async def _run_in_local_sandbox(
    harness: Any, task_path: str, endpoint: AgentEndpoint
) -> tuple[AgentRun, Any]:
    task = load_task(EXAMPLES / task_path)
    backend = LocalSandboxBackend()
    try:
        sandbox = await backend.start(task, lifetime_s=TIMEOUT_S)
        try:
            await harness.install(sandbox)
            run = await harness.run(sandbox, task.instruction, endpoint, step_limit=10, timeout_s=TIMEOUT_S)
            outcome = await run_verifier(sandbox, task)
        finally:
            await sandbox.close()
        assert backend.live == []
    finally:
        await backend.aclose()
    return run, outcome.reward


def _agent_processes_after_teardown(timeout_s: float = 5.0) -> list[str]:
    """Agent processes still alive once the kernel has had ``timeout_s`` to finish tearing the sandbox's
    namespace down (its members die at once; the host-side ``nsenter`` parents exit a moment later)."""
    deadline = time.monotonic() + timeout_s
    while (left := _agent_processes()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _agent_processes() -> list[str]:
    """Live processes of this test process (its descendants: other test processes may run agents too)
    running anything from the host tool cache or the agent bundles (none may outlive its sandbox)."""
    needles = (str(host_tools_dir()), str(host_bundles_dir()))
    return [line for line in describe(alive(descendants(os.getpid()))) if any(n in line for n in needles)]
