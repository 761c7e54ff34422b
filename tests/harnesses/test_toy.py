"""The toy harness: its command line survives values that look like flags."""

from __future__ import annotations

import asyncio
import shlex
import subprocess
import sys

from harness_trainer.harnesses.base import AgentEndpoint
from harness_trainer.harnesses.toy import SCRIPT, ToyHarness, count_tools
from tests.harnesses.conftest import FakeSandbox


def test_a_session_id_and_an_instruction_starting_with_a_dash_are_not_read_as_flags() -> None:
    sandbox = FakeSandbox()
    harness = ToyHarness()
    asyncio.run(harness.install(sandbox))
    endpoint = AgentEndpoint("http://127.0.0.1:9", "-starts-with-a-dash", "tiny")
    asyncio.run(harness.run(sandbox, "-x: do it", endpoint, step_limit=1, timeout_s=10))
    argv = shlex.split(sandbox.execs[0]["command"])
    # Run the real script's argument parsing: it gets as far as calling the (closed) endpoint.
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *argv[2:]], capture_output=True, text=True, timeout=60
    )
    assert "error: argument" not in result.stderr
    assert result.returncode == 1 and '"error"' in result.stdout


def test_tool_calls_and_failures_are_counted_from_the_json_lines() -> None:
    log = '{"step": 0, "tool": "bash", "exit_code": 0}\nnoise\n{"step": 1, "tool": "bash", "exit_code": 2}\n'
    counts = count_tools(log)
    assert counts.calls_by_name == {"bash": 2} and counts.failures == 1
