"""gemini-cli's chat recording and Qwen Code's request logs read as the agent's own record of its model
calls (each harness's ``recorded_calls``), against the capture (:mod:`harness_trainer.rollouts.agreement`).

The fixtures come from one real run of each agent here (tests/harnesses/test_real_agents.py's cases):
``gemini-cli.chat.jsonl`` is the recording as gemini-cli wrote it and ``gemini-cli.requests.json`` the
requests the proxy forwarded in that run (their system messages left out: the recording holds none, so
the comparison leaves them out); ``qwen-code.openai-logs.json`` is Qwen Code's four request logs, oldest
first, each without its ``tools`` (which the reader does not use). Real runs are compared with their
capture in tests/harnesses/test_real_agents.py.
"""

from __future__ import annotations

import json
from typing import Any

from harness_trainer.harnesses import gemini_cli, qwen_code
from harness_trainer.harnesses.base import AgentEndpoint
from harness_trainer.rollouts.agreement import agreement
from harness_trainer.sandboxes.base import ExecResult
from tests.harnesses.conftest import FIXTURES, FakeSandbox

GEMINI_SESSION = "a487021c-15b4-4024-844d-6db9135a6d5a"
QWEN_SESSION = "41ae1420-1e75-480d-b0f8-b50ddde26fe6"
ENDPOINT = AgentEndpoint("http://127.0.0.1:8300", "sess-abc", "tiny")


def gemini_recording() -> str:
    return (FIXTURES / "gemini-cli.chat.jsonl").read_text()


def gemini_requests() -> list[dict[str, Any]]:
    return json.loads((FIXTURES / "gemini-cli.requests.json").read_text())


def qwen_logs() -> str:
    return (FIXTURES / "qwen-code.openai-logs.json").read_text()


def lines(*records: dict[str, Any]) -> str:
    return "\n".join(json.dumps(r) for r in records) + "\n"


# gemini-cli


def test_gemini_clis_recording_gives_each_call_as_the_proxy_read_it_in_that_run() -> None:
    calls = gemini_cli.recorded_calls(gemini_recording())
    assert calls is not None and [len(call) for call in calls] == [1, 3, 5, 7]
    first = calls[0][0]  # its startup context and the instruction, two turns sent as one
    assert first["role"] == "user" and first["content"].startswith("<session_context>")
    assert "</session_context>\n\n`/app/numbers.txt` holds one integer per line." in first["content"]
    assert first["content"].endswith("to `/app/sum.txt`.\n")
    call_id = calls[1][1]["tool_calls"][0]["id"]
    assert call_id.startswith("chatcmpl-tool-") and calls[1][2]["tool_call_id"] == call_id  # no read_file__
    assert calls[1][2]["content"] == '{"error": "File not found: /app/sum.txt"}'
    verdict = agreement(calls, gemini_requests())
    assert (verdict.status, verdict.agent_calls, verdict.captured_calls) == ("match", 4, 4)


def test_a_tool_result_the_proxy_saw_otherwise_is_named_by_call_and_message() -> None:
    seen = gemini_requests()
    seen[2]["messages"][4]["content"] = '{"output": "146"}'
    verdict = agreement(gemini_cli.recorded_calls(gemini_recording()), seen)
    assert verdict.status == "mismatch"
    assert str(verdict.first_difference).startswith("call 3: message 4 (tool) differs in its content")


def test_gemini_clis_recording_is_replayed_as_gemini_cli_loads_it() -> None:
    header = {"sessionId": GEMINI_SESSION, "projectHash": "h", "kind": "main"}
    context = {"id": "u0", "type": "user", "content": [{"text": "context"}]}
    task = {"id": "u1", "type": "user", "content": [{"text": "task"}]}
    reply = {"id": "g1", "type": "gemini", "content": "Looking.", "thoughts": []}
    calls = [
        {"id": "read_file__c1", "name": "read_file", "args": {"file_path": "/a"}},
        {"name": "read_file", "args": {"file_path": "/b"}},  # sent without an id
    ]
    answers = [
        {"functionResponse": {"id": "read_file__c1", "name": "read_file", "response": {"output": "A"}}},
        {"functionResponse": {"id": "x", "name": "read_file", "response": {"output": "B"}}},
    ]
    dropped = {"id": "g9", "type": "gemini", "content": "rewound"}
    recording = lines(
        header,
        {"$set": {"messages": [{"id": "old", "type": "user", "content": "gone"}]}},
        {"$set": {"messages": [context]}},  # the history as a whole replaces what was there
        task,
        reply,
        {"id": "i1", "type": "info", "content": "not sent"},
        {**reply, "toolCalls": calls},  # the same message again, now with its calls: updated in place
        {"id": "u2", "type": "user", "content": answers},
        dropped,
        {"$rewindTo": "g9"},
        {"id": "g2", "type": "gemini", "content": "Done."},
    )
    sent = gemini_cli.recorded_calls(recording)
    assert sent is not None and [len(call) for call in sent] == [1, 4]
    assert sent[0] == [{"role": "user", "content": "context\n\ntask"}]
    assistant = sent[1][1]
    assert assistant["content"] == "Looking."
    assert [c["id"] for c in assistant["tool_calls"]] == ["c1", "call_1_1"]
    arguments = [json.loads(c["function"]["arguments"]) for c in assistant["tool_calls"]]
    assert arguments == [{"file_path": "/a"}, {"file_path": "/b"}]
    assert sent[1][2:] == [
        {"role": "tool", "tool_call_id": "c1", "content": '{"output": "A"}'},
        {"role": "tool", "tool_call_id": "call_1_1", "content": '{"output": "B"}'},  # matched by name
    ]


def test_no_gemini_recording_is_no_record() -> None:
    assert gemini_cli.recorded_calls(None) is None and gemini_cli.recorded_calls("") is None
    assert gemini_cli.recorded_calls(lines({"id": "u1", "type": "user", "content": "no header"})) is None


async def test_gemini_cli_run_reads_back_the_recording_of_its_session() -> None:
    home = "/home/user/.harness-trainer/gemini-cli"
    path = f"{home}/.gemini/tmp/app/chats/session-2026-12-06T19-00-{GEMINI_SESSION[:8]}.jsonl"

    def agent(sandbox: FakeSandbox, command: str) -> ExecResult:
        if command.startswith("ls "):
            found = f"{home}/.gemini/tmp/*/chats/session-*-{GEMINI_SESSION[:8]}.jsonl" in command
            return ExecResult(0 if found else 2, path + "\n" if found else "", "")
        init = {"type": "init", "session_id": GEMINI_SESSION, "model": "tiny"}
        sandbox.files["/logs/agent/gemini-cli.jsonl"] = (json.dumps(init) + "\n").encode()
        sandbox.files[path] = gemini_recording().encode()
        return ExecResult(0, "", "")

    run = await gemini_cli.GeminiCliHarness().run(
        FakeSandbox(agent), "x", ENDPOINT, step_limit=4, timeout_s=5
    )
    assert run.record == gemini_cli.recorded_calls(gemini_recording()) and run.record is not None


# Qwen Code


def test_qwen_codes_request_logs_are_its_calls_as_it_sent_them() -> None:
    calls = qwen_code.recorded_calls(qwen_logs(), QWEN_SESSION)
    assert calls is not None and [len(call) for call in calls] == [2, 4, 6, 8]
    assert calls[0][0]["role"] == "system" and calls[3][:6] == calls[2]
    user = calls[0][1]["content"]  # Qwen Code's reminders before the instruction: the chat recording has none
    assert [p["text"].startswith("<system-reminder>") for p in user] == [True, True, True, False]
    # the proxy's spelling of the same requests: text parts as a string, no None fields
    seen = [{"messages": [_plain(m) for m in call]} for call in calls]
    assert agreement(calls, seen).status == "match"
    seen[1]["messages"][3]["content"] = "Output: 13"
    assert "call 2: message 3 (tool) differs in its content" in str(agreement(calls, seen).first_difference)


def test_qwen_code_leaves_out_other_sessions_and_requests_that_failed() -> None:
    entry = json.loads(qwen_logs()[: qwen_logs().index("\n}\n") + 2])
    other = {**entry, "context": {"sessionId": "other"}}
    failed = {**entry, "response": None, "error": {"message": "400"}}
    logs = "\n".join(json.dumps(e, indent=2) for e in (other, entry, failed, entry))
    calls = qwen_code.recorded_calls(logs, QWEN_SESSION)
    assert calls is not None and len(calls) == 2
    assert (
        qwen_code.recorded_calls(None, QWEN_SESSION) is None
        and qwen_code.recorded_calls("", QWEN_SESSION) is None
    )
    assert qwen_code.recorded_calls(qwen_logs()[:-200], QWEN_SESSION) is None  # a log cut short


async def test_qwen_code_run_logs_its_requests_in_its_home_and_reads_them_back() -> None:
    entry = qwen_logs()[: qwen_logs().index("\n}\n") + 2]  # its first request

    def agent(sandbox: FakeSandbox, command: str) -> ExecResult:
        if command.startswith("ls "):
            return ExecResult(0, "openai-2-b.json\nopenai-1-a.json\n.cleanup\n", "")
        init = {"type": "system", "subtype": "init", "session_id": QWEN_SESSION}
        sandbox.files["/logs/agent/qwen-code.jsonl"] = (json.dumps(init) + "\n").encode()
        log_dir = json.loads(sandbox.files[f"{qwen_home}/settings.json"])["model"]["openAILoggingDir"]
        sandbox.files[f"{log_dir}/openai-1-a.json"] = entry.encode()
        sandbox.files[f"{log_dir}/openai-2-b.json"] = entry.encode()
        return ExecResult(0, "", "")

    qwen_home = f"/home/user/{qwen_code.CONFIG_DIR}"
    sandbox = FakeSandbox(agent)
    run = await qwen_code.QwenCodeHarness().run(sandbox, "x", ENDPOINT, step_limit=4, timeout_s=5)
    settings = json.loads(sandbox.files[f"{qwen_home}/settings.json"])
    assert settings["model"]["enableOpenAILogging"] is True
    assert settings["model"]["openAILoggingDir"] == f"{qwen_home}/openai-logs"
    assert run.record is not None and len(run.record) == 2
    assert sandbox.execs[-1]["command"] == f"ls -1 {qwen_home}/openai-logs"


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content)
    return {k: v for k, v in {**message, "content": content}.items() if v is not None}
