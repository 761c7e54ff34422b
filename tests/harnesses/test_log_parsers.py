"""Tool counts from each agent's own log: recorded logs of real runs (``fixtures/``: each agent solved the
``hello-file`` toy task in a local sandbox, with one deliberately failing call), and hand-made edge cases."""

from __future__ import annotations

import json

from harness_trainer.harnesses import claude_code, codex, mini_swe_agent, opencode
from tests.harnesses.conftest import FIXTURES


def test_opencode_counts_tool_use_events_by_tool_and_errors_as_failures() -> None:
    counts = opencode.parse_tool_counts((FIXTURES / "opencode.jsonl").read_text())
    assert counts.calls_by_name == {"bash": 1, "read": 1, "write": 1}
    assert counts.failures == 1  # reading a file that does not exist


def test_claude_code_counts_tool_use_blocks_and_error_results() -> None:
    counts = claude_code.parse_tool_counts((FIXTURES / "claude-code.jsonl").read_text())
    assert counts.calls_by_name == {"Bash": 1, "Read": 1, "Write": 1}
    assert counts.failures == 1


def test_codex_counts_completed_tool_items_and_failed_commands() -> None:
    counts = codex.parse_tool_counts((FIXTURES / "codex.jsonl").read_text())
    assert counts.calls_by_name == {"exec_command": 3}
    assert counts.failures == 1  # `cat` of a missing file exits 1


def test_mini_counts_actions_and_does_not_fail_the_submit_that_never_ran() -> None:
    counts = mini_swe_agent.parse_trajectory((FIXTURES / "mini-swe-agent.traj.json").read_text())
    assert counts.calls_by_name == {"bash": 4}  # the last one is the submit command
    assert counts.failures == 1


def test_every_parser_ignores_garbage_and_counts_nothing_in_an_empty_log() -> None:
    for parse in (opencode.parse_tool_counts, claude_code.parse_tool_counts, codex.parse_tool_counts):
        assert parse("").total == 0
        assert parse("Warning: not json\n[1, 2]\n{broken\n").total == 0
    assert mini_swe_agent.parse_trajectory("").total == 0
    assert mini_swe_agent.parse_trajectory('{"messages": "nope"}').total == 0


def test_opencode_counts_a_repeated_event_for_the_same_call_once() -> None:
    event = {"type": "tool_use", "part": {"tool": "edit", "callID": "c9", "state": {"status": "error"}}}
    log = "\n".join([json.dumps(event)] * 2)
    counts = opencode.parse_tool_counts(log)
    assert counts.calls_by_name == {"edit": 1} and counts.failures == 1


def test_claude_code_counts_a_tool_use_repeated_across_stream_events_once() -> None:
    use = {"type": "assistant", "message": {"content": [{"type": "tool_use", "id": "t1", "name": "Edit"}]}}
    result = {
        "type": "user",
        "message": {"content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True}]},
    }
    counts = claude_code.parse_tool_counts("\n".join(json.dumps(e) for e in (use, use, result, result)))
    assert counts.calls_by_name == {"Edit": 1} and counts.failures == 1


def test_codex_names_file_changes_and_mcp_calls_and_skips_messages() -> None:
    items = [
        {"id": "1", "type": "file_change", "status": "completed"},
        {"id": "2", "type": "mcp_tool_call", "server": "docs", "tool": "search", "status": "failed"},
        {"id": "3", "type": "agent_message", "text": "done"},
        {"id": "4", "type": "reasoning", "text": "hmm"},
    ]
    log = "\n".join(json.dumps({"type": "item.completed", "item": item}) for item in items)
    counts = codex.parse_tool_counts(log)
    assert counts.calls_by_name == {"apply_patch": 1, "docs.search": 1} and counts.failures == 1


def test_mini_counts_the_tool_calls_of_a_reply_it_could_not_parse_as_failed() -> None:
    raw = {"choices": [{"message": {"tool_calls": [{"function": {"name": "python", "arguments": "{}"}}]}}]}
    trajectory = {
        "messages": [
            {
                "role": "user",
                "content": "Tool call error",
                "extra": {"interrupt_type": "FormatError", "response": raw},
            },
            {"role": "assistant", "extra": {"actions": [{"command": "ls"}]}},
            {"role": "tool", "extra": {"returncode": 2, "exception_info": ""}},
        ]
    }
    counts = mini_swe_agent.parse_trajectory(json.dumps(trajectory))
    assert counts.calls_by_name == {"python": 1, "bash": 1} and counts.failures == 2
