"""Claude Code's session transcript and Codex's rollout file read as the agents' own records of their model
calls (``recorded_calls`` in :mod:`harness_trainer.harnesses.records_anthropic` and ``.records_responses``),
against the capture (:mod:`harness_trainer.rollouts.agreement`). The fixtures are one real run of each
agent here (``tests/harnesses/test_real_agents.py``'s case): its file and the capture's requests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from capture_proxy.dialects.anthropic import DIALECT as ANTHROPIC
from capture_proxy.dialects.responses import DIALECT as RESPONSES
from harness_trainer.harnesses import claude_code, codex, records_anthropic, records_responses
from harness_trainer.harnesses.base import AgentEndpoint
from harness_trainer.rollouts.agreement import agreement
from harness_trainer.sandboxes.base import ExecResult
from tests.harnesses.conftest import FakeSandbox

FIXTURES = Path(__file__).resolve().parents[1] / "harnesses" / "fixtures"
ENDPOINT = AgentEndpoint("http://127.0.0.1:8300", "sess-abc", "tiny")


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def captured(name: str) -> list[dict[str, Any]]:
    return json.loads(fixture(name))


def lines(*entries: dict[str, Any]) -> str:
    return "\n".join(json.dumps(e) for e in entries) + "\n"


def roles(call: list[dict[str, Any]]) -> list[str]:
    return [m["role"] for m in call]


# Claude Code


def test_claude_codes_transcript_rebuilds_every_request_it_logged_and_the_capture_agrees() -> None:
    calls = records_anthropic.recorded_calls(fixture("claude-code.session.jsonl"))
    assert calls is not None and [len(call) for call in calls] == [1, 3, 5, 7]
    assert roles(calls[3]) == ["user", "assistant", "tool", "assistant", "tool", "assistant", "tool"]
    first = calls[0][0]["content"]  # the reminders Claude Code sent before the task, which the stream lacks
    assert first.startswith("<system-reminder>")
    assert first.endswith("with no\nargument it prints `Hello, world!`.\n")
    assert calls[1][2]["content"].startswith("File does not exist.")
    verdict = agreement(calls, captured("claude-code.requests.json"))
    assert (verdict.status, verdict.agent_calls, verdict.captured_calls) == ("match", 4, 4)


def test_what_the_proxy_changed_in_a_claude_code_call_is_a_mismatch() -> None:
    calls = records_anthropic.recorded_calls(fixture("claude-code.session.jsonl"))
    seen = captured("claude-code.requests.json")
    tool = next(m for m in seen[3]["messages"] if m["role"] == "tool")
    tool["content"] = "File exists."
    verdict = agreement(calls, seen)
    assert verdict.status == "mismatch"
    assert str(verdict.first_difference).startswith("call 4: message 2 (tool) differs in its content")
    seen = captured("claude-code.requests.json")
    seen[2]["messages"][0]["content"] = "another system prompt"  # the record has none: not compared
    assert agreement(calls, seen).status == "match"


def test_a_claude_code_request_with_a_message_it_cannot_resolve_is_no_record() -> None:
    text = fixture("claude-code.session.jsonl")
    without_blob = "".join(line for line in text.splitlines(True) if '"type":"api-request-blob"' not in line)
    assert records_anthropic.recorded_calls(without_blob) is None
    no_requests = "".join(line for line in text.splitlines(True) if '"type":"api-request"' not in line)
    assert records_anthropic.recorded_calls(no_requests) is None  # a version that logs none says nothing
    assert records_anthropic.recorded_calls(None) is None and records_anthropic.recorded_calls("") is None


def test_an_assistant_message_logged_one_block_per_entry_is_one_message_by_its_hash() -> None:
    task = {"role": "user", "content": [{"type": "text", "text": "Go."}]}
    said = {"id": "m1", "role": "assistant", "content": [{"type": "text", "text": "Looking."}]}
    use = {"type": "tool_use", "id": "t1", "name": "Read", "input": {"file_path": "/a"}}
    did = {**said, "content": [use]}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "A"}]}
    whole = {"role": "assistant", "content": [said["content"][0], use]}
    hashes = [records_anthropic.message_hash(m) for m in (task, whole, result)]
    transcript = [
        {"type": "api-request-blob", "hash": hashes[0], "message": task},
        {"type": "api-request", "id": "r1", "keep": 0, "tail": hashes[:1]},
        {"type": "assistant", "message": said},
        {"type": "attachment"},  # other entries do not end a message's run
        {"type": "assistant", "message": did},
        {"type": "user", "message": result},
        {"type": "api-request", "id": "r2", "base": "r1", "keep": 1, "tail": hashes[1:]},
    ]
    calls = records_anthropic.recorded_calls(lines(*transcript))
    assert calls is not None and roles(calls[1]) == ["user", "assistant", "tool"]
    assert calls[1][1]["content"] == "Looking." and len(calls[1][1]["tool_calls"]) == 1
    transcript[4] = {"type": "assistant", "message": {**did, "id": "m2"}}  # another message: not that hash
    assert records_anthropic.recorded_calls(lines(*transcript)) is None


def test_claude_code_messages_read_as_the_proxys_anthropic_dialect_forwards_them() -> None:
    messages = [
        {"role": "user", "content": "Fix it."},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Hm.", "signature": ""},
                {"type": "text", "text": "Two reads."},
                {"type": "text", "text": "Then a fix."},
                {"type": "tool_use", "id": "t1", "name": "Read", "input": {"file_path": "/ü"}},
                {"type": "tool_use", "id": "t2", "name": "Bash", "input": {"_raw": "ls -la"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "<system-reminder>x</system-reminder>"},
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "a"}] * 2},
                {"type": "tool_result", "tool_use_id": "t2", "is_error": True, "content": "<tool_use_error>"},
            ],
        },
    ]
    mine = records_anthropic.chat_messages(messages)
    assert roles(mine) == ["user", "assistant", "tool", "tool", "user"]  # results first, then the text
    assert mine[1]["content"] == "Two reads.\n\nThen a fix." and mine[2]["content"] == "a\n\na"
    assert mine[1]["tool_calls"][1]["function"]["arguments"] == "ls -la"
    forwarded = ANTHROPIC.parse_request({"model": "m", "max_tokens": 9, "messages": messages}).body
    assert agreement([mine], [forwarded]).status == "match"


async def test_claude_code_run_reads_back_the_transcript_of_its_streams_session() -> None:
    session = "76f1973a-57bb-464f-b266-a42bd2cc2e3d"  # the fixture's
    path = f"/home/user/.claude/projects/-app/{session}.jsonl"

    def agent(sandbox: FakeSandbox, command: str) -> ExecResult:
        if command.startswith("ls "):
            found = f"/home/user/.claude/projects/*/{session}.jsonl" in command
            return ExecResult(0 if found else 2, path + "\n" if found else "", "")
        init = {"type": "system", "subtype": "init", "session_id": session}
        sandbox.files["/logs/agent/claude-code.jsonl"] = lines(init).encode()
        sandbox.files[path] = fixture("claude-code.session.jsonl").encode()
        return ExecResult(0, "", "")

    harness = claude_code.ClaudeCodeHarness()
    run = await harness.run(FakeSandbox(agent), "x", ENDPOINT, step_limit=4, timeout_s=5)
    assert run.record == records_anthropic.recorded_calls(fixture("claude-code.session.jsonl"))
    assert run.record is not None


async def test_claude_code_run_without_a_transcript_has_no_record() -> None:
    def agent(sandbox: FakeSandbox, command: str) -> ExecResult:
        if command.startswith("ls "):
            return ExecResult(2, "", "ls: cannot access: No such file or directory")
        sandbox.files["/logs/agent/claude-code.jsonl"] = lines({"session_id": "s1"}).encode()
        return ExecResult(1, "", "")

    harness = claude_code.ClaudeCodeHarness()
    run = await harness.run(FakeSandbox(agent), "x", ENDPOINT, step_limit=4, timeout_s=5)
    assert run.record is None


# Codex


def test_codexs_rollout_gives_each_calls_input_and_the_capture_agrees() -> None:
    calls = records_responses.recorded_calls(fixture("codex.rollout.jsonl"))
    assert calls is not None and [len(call) for call in calls] == [2, 4, 6, 8]
    assert roles(calls[1]) == ["user", "user", "assistant", "tool"]  # developer messages left out
    assert calls[0][0]["content"].startswith("<environment_context>")
    assert calls[3][:6] == calls[2]
    verdict = agreement(calls, captured("codex.requests.json"))
    assert (verdict.status, verdict.agent_calls, verdict.captured_calls) == ("match", 4, 4)


def test_what_the_proxy_changed_in_a_codex_call_is_a_mismatch() -> None:
    calls = records_responses.recorded_calls(fixture("codex.rollout.jsonl"))
    seen = captured("codex.requests.json")
    assistant = next(m for m in seen[2]["messages"] if m["role"] == "assistant")
    assistant["tool_calls"][0]["function"]["arguments"] = json.dumps({"cmd": "rm -rf /app"})
    verdict = agreement(calls, seen)
    assert verdict.status == "mismatch"
    assert str(verdict.first_difference).startswith("call 3: message 2 (assistant) differs in its tool calls")
    assert agreement(calls[:3], captured("codex.requests.json")).first_difference == (
        "the agent recorded 3 model calls, the capture 4"
    )


def test_codex_items_read_as_the_proxys_responses_dialect_forwards_them() -> None:
    def item(**fields: Any) -> dict[str, Any]:
        return {"type": "response_item", "payload": fields}

    call = {"type": "function_call", "name": "exec_command"}
    items = [
        item(type="message", role="developer", content=[{"type": "input_text", "text": "Be careful."}]),
        item(type="message", role="user", content=[{"type": "input_text", "text": "Fix"}] * 2),
        item(type="reasoning", summary=[], content=[{"type": "reasoning_text", "text": "Hm."}]),
        item(type="message", role="assistant", content=[{"type": "output_text", "text": "Two."}]),
        item(**call, arguments='{"cmd": "ls"}', call_id="c1"),
        item(**call, arguments='{"cmd":"pwd"}', call_id="c2"),
        item(type="function_call_output", call_id="c1", output="a"),
        item(type="function_call_output", call_id="c2", output=[{"type": "input_text", "text": "/app"}]),
    ]
    usage = {"type": "token_usage_record", "payload": {"response_id": "r"}}
    meta = {"type": "session_meta", "payload": {"id": "t1"}}
    rollout = [meta, *items[:2], *items[2:6], usage, *items[6:], usage]
    calls = records_responses.recorded_calls(lines(*rollout))
    assert calls is not None and [len(c) for c in calls] == [1, 4]  # the second reply was empty: no item
    assert roles(calls[1]) == ["user", "assistant", "tool", "tool"]
    assert calls[1][1]["content"] == "Two." and len(calls[1][1]["tool_calls"]) == 2
    body = {"model": "m", "input": [i["payload"] for i in items]}
    forwarded = RESPONSES.parse_request(body).body
    assert agreement([calls[1]], [forwarded]).status == "match"


def test_no_codex_rollout_is_no_record() -> None:
    assert records_responses.recorded_calls(None) is None and records_responses.recorded_calls("") is None
    rollout = fixture("codex.rollout.jsonl").splitlines(True)
    no_meta = "".join(line for line in rollout if '"type":"session_meta"' not in line)
    assert records_responses.recorded_calls(no_meta) is None


async def test_codex_run_reads_back_the_rollout_of_its_thread() -> None:
    thread = "01a24cc1-dbb6-7871-8cd2-87646688dc88"  # the fixture's
    path = f"/home/user/.codex/sessions/2026/12/06/rollout-2026-12-06T19-08-22-{thread}.jsonl"

    def agent(sandbox: FakeSandbox, command: str) -> ExecResult:
        if command.startswith("find "):
            found = f"rollout-*-{thread}.jsonl" in command and "/home/user/.codex/sessions" in command
            return ExecResult(0, path + "\n" if found else "", "")
        started = {"type": "thread.started", "thread_id": thread}
        sandbox.files["/logs/agent/codex.jsonl"] = lines(started).encode()
        sandbox.files[path] = fixture("codex.rollout.jsonl").encode()
        return ExecResult(0, "", "")

    sandbox = FakeSandbox(agent)
    run = await codex.CodexHarness().run(sandbox, "x", ENDPOINT, step_limit=0, timeout_s=5)
    assert "--ephemeral" not in sandbox.execs[0]["command"]  # the rollout is written
    assert run.record == records_responses.recorded_calls(fixture("codex.rollout.jsonl"))
    assert run.record is not None
