"""The agent's own record of its model calls against the capture (:mod:`harness_trainer.rollouts.agreement`),
and mini-swe-agent's trajectory read as that record (``recorded_calls``). Real runs are checked where
real agents run (tests/rollouts/test_harbor_shaped.py, tests/devloop/test_dev_harness_mix.py)."""

from __future__ import annotations

import json
from typing import Any

from harness_trainer.harnesses.mini_swe_agent import recorded_calls
from harness_trainer.rollouts.agreement import agreement

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
TASK = {"role": "user", "content": "Create /app/a.txt."}


def reply(command: str, call_id: str, spaced: bool = False) -> dict[str, Any]:
    arguments = json.dumps({"command": command}, indent=1 if spaced else None)
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "bash", "arguments": arguments}}
        ],
    }


def result(call_id: str, output: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def trajectory() -> str:
    """mini-swe-agent 2.x's trajectory of three calls: a command, a reply it could not parse (its format
    error keeps the raw response; the reply is not in the history), and the submission."""
    messages = [
        {**SYSTEM, "extra": {}},
        {**TASK, "extra": {}},
        {**reply("touch /app/a.txt", "c1"), "function_call": None, "extra": {"response": {"id": "r1"}}},
        {**result("c1", "<returncode>0</returncode>"), "extra": {"returncode": 0}},
        {
            "role": "user",
            "content": "No tool calls found.",
            "extra": {"interrupt_type": "FormatError", "response": {"id": "r2"}},
        },
        {**reply("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT", "c3"), "extra": {"response": {"id": "r3"}}},
        {"role": "exit", "content": "Submitted", "extra": {"exit_status": "Submitted"}},
    ]
    return json.dumps({"trajectory_format": "mini-swe-agent-1.1", "messages": messages})


def captured() -> list[dict[str, Any]]:
    """What the capture proxy recorded of the same three calls (litellm drops ``None`` fields, a JSON
    argument may be spelled with other spaces, text may come as content parts)."""
    first = [SYSTEM, {"role": "user", "content": [{"type": "text", "text": "Create /app/a.txt."}]}]
    second = [
        *first,
        {k: v for k, v in reply("touch /app/a.txt", "c1", spaced=True).items() if v is not None},
        result("c1", "<returncode>0</returncode>"),
    ]
    third = [*second, {"role": "user", "content": "No tool calls found."}]
    return [{"messages": first}, {"messages": second}, {"messages": third}]


def test_mini_swe_agents_trajectory_gives_each_calls_messages_format_errors_included() -> None:
    calls = recorded_calls(trajectory())
    assert calls is not None and [len(call) for call in calls] == [2, 4, 5]
    assert all("extra" not in message for call in calls for message in call)
    assert calls[2][-1] == {"role": "user", "content": "No tool calls found."}
    assert recorded_calls("") is None and recorded_calls('{"messages": 3}') is None


def test_the_same_calls_match_whatever_the_client_library_changed_in_spelling() -> None:
    verdict = agreement(recorded_calls(trajectory()), captured())
    assert (verdict.status, verdict.agent_calls, verdict.captured_calls) == ("match", 3, 3)
    assert verdict.first_difference is None


def test_a_difference_is_named_by_call_message_and_field() -> None:
    tampered = captured()
    tampered[1]["messages"][3] = result("c1", "<returncode>1</returncode>")
    verdict = agreement(recorded_calls(trajectory()), tampered)
    assert verdict.status == "mismatch"
    assert verdict.first_difference is not None
    assert verdict.first_difference.startswith(
        "call 2: message 3 (tool) differs in its content: the agent sent"
    )
    assert "<returncode>1</returncode>" in verdict.first_difference

    other_call = captured()
    other_call[2]["messages"][2] = reply("rm -rf /app", "c1")
    assert "message 2 (assistant) differs in its tool calls" in str(
        agreement(recorded_calls(trajectory()), other_call).first_difference
    )


def test_missing_calls_and_messages_are_mismatches_and_no_record_is_not_available() -> None:
    calls = recorded_calls(trajectory())
    fewer = agreement(calls, captured()[:2])
    assert fewer.status == "mismatch"
    assert fewer.first_difference == "the agent recorded 3 model calls, the capture 2"
    shorter = captured()
    shorter[1]["messages"] = shorter[1]["messages"][:3]
    assert agreement(calls, shorter).first_difference == "call 2: the agent sent 4 messages, the proxy saw 3"
    none = agreement(None, captured())
    assert (none.status, none.agent_calls, none.captured_calls) == ("not_available", None, 3)


def test_pis_run_log_gives_each_calls_messages_without_a_system_prompt_compared_without_one() -> None:
    from harness_trainer.harnesses.pi_agent import recorded_calls as pi_calls

    task = {"role": "user", "content": [{"type": "text", "text": "Create /app/a.txt."}]}
    tool_call = {"type": "toolCall", "id": "c1", "name": "bash", "arguments": {"command": "touch /app/a.txt"}}
    messages = [
        task,
        {"role": "assistant", "content": [tool_call], "stopReason": "toolUse"},
        {
            "role": "toolResult",
            "toolCallId": "c1",
            "toolName": "bash",
            "isError": False,
            "content": [{"type": "text", "text": "(no output)"}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "Done."}], "stopReason": "stop"},
    ]
    log = "\n".join(
        json.dumps(e) for e in ({"type": "agent_start"}, {"type": "agent_end", "messages": messages})
    )
    calls = pi_calls(log)
    assert calls is not None and [len(call) for call in calls] == [1, 3]
    sent_call = {"name": "bash", "arguments": '{"command":"touch /app/a.txt"}'}
    first = [SYSTEM, {"role": "user", "content": "Create /app/a.txt."}]
    reply = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": sent_call}]}
    second = [*first, reply, {"role": "tool", "tool_call_id": "c1", "content": "(no output)"}]
    seen = [{"messages": first}, {"messages": second}]
    assert agreement(calls, seen).status == "match"  # the record has no system prompt: none compared
    seen[1]["messages"][3]["content"] = "other"
    assert "message 2 (tool) differs in its content" in str(agreement(calls, seen).first_difference)
    assert pi_calls('{"type": "agent_start"}') is None  # a run that did not end


def test_opencodes_export_gives_one_call_per_step_with_tool_errors_as_it_sent_them() -> None:
    from harness_trainer.harnesses.opencode import recorded_calls as opencode_calls

    def step(*parts: dict[str, Any], finish: str = "tool-calls") -> dict[str, Any]:
        start, end = {"type": "step-start"}, {"type": "step-finish", "reason": finish}
        return {"info": {"role": "assistant", "finish": finish}, "parts": [start, *parts, end]}

    def tool(call_id: str, name: str, arguments: dict[str, Any], **state: Any) -> dict[str, Any]:
        return {"type": "tool", "tool": name, "callID": call_id, "state": {"input": arguments, **state}}

    missing = tool(
        "c1", "read", {"filePath": "/app/a.txt"}, status="error", error="File not found: /app/a.txt"
    )
    touch = tool("c2", "bash", {"command": "touch /app/a.txt"}, status="completed", output="", metadata={})
    export = {
        "info": {"id": "ses_1", "title": "harness-trainer rollout"},
        "messages": [
            {"info": {"role": "user"}, "parts": [{"type": "text", "text": '"Create /app/a.txt."'}]},
            step(missing),
            step({"type": "text", "text": "Creating it."}, touch),
            step({"type": "text", "text": "Done."}, finish="stop"),
        ],
    }
    calls = opencode_calls("Exporting session: ses_1\n" + json.dumps(export, indent=2))
    assert calls is not None and [len(call) for call in calls] == [1, 3, 5]
    task = {"role": "user", "content": '"Create /app/a.txt."'}
    sent = {"name": "read", "arguments": '{"filePath":"/app/a.txt"}'}
    first = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": sent}]}
    second = {**reply("touch /app/a.txt", "c2"), "content": "Creating it."}
    history = [SYSTEM, task, first, result("c1", "File not found: /app/a.txt"), second, result("c2", "")]
    seen = [{"messages": history[:2]}, {"messages": history[:4]}, {"messages": history}]
    assert agreement(calls, seen).status == "match"  # no system prompt in the record: none compared
    seen[2]["messages"][3] = result("c1", "Error: File not found")
    assert "call 3: message 2 (tool) differs in its content" in str(agreement(calls, seen).first_difference)
    assert opencode_calls(None) is None and opencode_calls("Error: session not found") is None
