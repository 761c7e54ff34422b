"""The agent's own record against the capture, on real runs: Claude Code's session transcript and Codex's
rollout file (read by :mod:`harness_trainer.harnesses.records_anthropic` and ``.records_responses``) say,
call by call, what the proxy saw, and writing them changes no request. The runs are test_real_agents.py's
cases for these agents (its scripted replies, task and options), in a local sandbox against a real capture
proxy in front of the scripted dev engine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness_trainer.harnesses import make_harness
from harness_trainer.harnesses.base import AgentEndpoint
from harness_trainer.harnesses.tools import ToolPackage
from harness_trainer.rollouts.agreement import agreement
from harness_trainer.trace import load_trace
from tests.harnesses.conftest import CaptureStack
from tests.harnesses.test_real_agents import CASES, _run_in_local_sandbox

pytestmark = pytest.mark.slow
RECORDING = [case for case in CASES if case.harness in ("claude-code", "codex")]


@pytest.mark.parametrize("case", RECORDING, ids=[case.harness for case in RECORDING])
async def test_the_agents_own_record_matches_the_capture_call_by_call(
    case: Any,
    capture_stack: Callable[[list[dict[str, Any]]], CaptureStack],
    install_agent: Callable[[ToolPackage], Path],
) -> None:
    harness = make_harness(case.harness, **case.options)
    install_agent(harness.package)  # type: ignore[attr-defined]
    stack = capture_stack(case.replies)
    session_id = stack.new_session()
    run, reward = await _run_in_local_sandbox(
        harness, case.task, AgentEndpoint(stack.url, session_id, "tiny")
    )
    assert run.result.exit_code == 0 and not run.result.timed_out, run.result.stderr[-3000:] + run.log[-3000:]
    assert reward == 1.0

    calls = stack.get(f"/sessions/{session_id}/calls")["calls"]
    assert [call["kind"] for call in calls] == ["model"] * len(case.replies)  # the record adds no call
    trace = load_trace(stack.get(f"/sessions/{session_id}/trace"), session_id=session_id)
    verdict = agreement(run.record, [turn.request for turn in trace.turns])
    assert (verdict.status, verdict.agent_calls) == ("match", len(case.replies)), verdict
