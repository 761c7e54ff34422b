"""Hermes/Qwen tool-call parsing, message normalisation, scripted replies and their ids, token bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from harness_trainer.dev_engine.chat import RenderError, normalize_messages, parse_tool_calls
from harness_trainer.dev_engine.responses import token_bytes
from harness_trainer.dev_engine.script import ScriptedReplies, ScriptError, completion_ids

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]


def block(name: str, arguments: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def names_and_arguments(calls: list[dict]) -> list[tuple[str, object]]:
    return [(call["function"]["name"], json.loads(call["function"]["arguments"])) for call in calls]


# parse_tool_calls


def test_plain_text_is_all_content_and_no_calls() -> None:
    parsed = parse_tool_calls("The folder holds hello.txt.")
    assert parsed.content == "The folder holds hello.txt."
    assert parsed.tool_calls == []


def test_one_tool_call_is_parsed_with_no_content() -> None:
    parsed = parse_tool_calls(block("bash", {"command": "ls"}))
    assert parsed.content is None
    assert names_and_arguments(parsed.tool_calls) == [("bash", {"command": "ls"})]
    assert parsed.tool_calls[0]["type"] == "function"


def test_two_tool_calls_are_parsed_in_order() -> None:
    text = block("bash", {"command": "ls"}) + "\n" + block("read_file", {"path": "a.py"})
    parsed = parse_tool_calls(text)
    assert parsed.content is None
    assert names_and_arguments(parsed.tool_calls) == [
        ("bash", {"command": "ls"}),
        ("read_file", {"path": "a.py"}),
    ]


def test_text_before_the_first_call_is_the_content() -> None:
    parsed = parse_tool_calls("Let me look around.\n\n" + block("bash", {"command": "ls"}))
    assert parsed.content == "Let me look around."
    assert names_and_arguments(parsed.tool_calls) == [("bash", {"command": "ls"})]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"\n</tool_call>',
        block("bash", {"command": "ls"}) + "\n<tool_call>\nnot json at all\n</tool_call>",
        '<tool_call>\n["bash", "ls"]\n</tool_call>',
        '<tool_call>\n{"arguments": {"command": "ls"}}\n</tool_call>',
    ],
    ids=["broken-json", "second-call-broken", "not-an-object", "no-name"],
)
def test_an_unparseable_call_leaves_the_whole_reply_as_content(text: str) -> None:
    parsed = parse_tool_calls("Trying.\n" + text)
    assert parsed.content == "Trying.\n" + text
    assert parsed.tool_calls == []


def test_object_arguments_become_a_json_string() -> None:
    arguments = {"command": "echo 'héllo'", "timeout": 5, "flags": ["-n"]}
    (call,) = parse_tool_calls(block("bash", arguments)).tool_calls
    assert isinstance(call["function"]["arguments"], str)
    assert json.loads(call["function"]["arguments"]) == arguments
    assert "héllo" in call["function"]["arguments"]


def test_string_arguments_are_passed_through() -> None:
    (call,) = parse_tool_calls(block("bash", '{"command": "ls"}')).tool_calls
    assert call["function"]["arguments"] == '{"command": "ls"}'


def test_call_ids_are_unique_and_prefixed() -> None:
    text = "\n".join(block("bash", {"command": str(i)}) for i in range(5))
    ids = [call["id"] for call in parse_tool_calls(text).tool_calls]
    ids += [call["id"] for call in parse_tool_calls(text).tool_calls]
    assert len(set(ids)) == 10
    assert all(call_id.startswith("chatcmpl-tool-") for call_id in ids)


# normalize_messages


def test_normalize_joins_text_parts() -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "cd"}]}]
    assert normalize_messages(messages)[0]["content"] == "abcd"


def test_normalize_parses_string_arguments_without_touching_the_input() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
    messages = [{"role": "assistant", "content": None, "tool_calls": [call]}]
    (out,) = normalize_messages(messages)
    assert out["tool_calls"][0]["function"]["arguments"] == {"command": "ls"}
    assert out["content"] == ""
    assert call["function"]["arguments"] == '{"command": "ls"}'


def test_normalize_rejects_image_parts() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "see"}, image]}]
    with pytest.raises(RenderError, match=r"messages\[0\]"):
        normalize_messages(messages)


# ScriptedReplies

REPLIES = [
    {
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "bash", "arguments": {"command": "ls"}}}],
    },
    {"content": "Done."},
]


def test_script_loads_from_a_json_list(tmp_path: Path) -> None:
    path = tmp_path / "script.json"
    path.write_text(json.dumps(REPLIES, indent=2))
    script = ScriptedReplies.from_file(path)
    assert script.replies == [{**reply, "role": "assistant"} for reply in REPLIES]


def test_script_loads_from_json_lines(tmp_path: Path) -> None:
    path = tmp_path / "script.jsonl"
    path.write_text("\n".join(json.dumps(reply) for reply in REPLIES) + "\n\n")
    script = ScriptedReplies.from_file(path)
    assert script.replies == [{**reply, "role": "assistant"} for reply in REPLIES]


@pytest.mark.parametrize(
    "text",
    ["", "  \n\n", "[]", "not json\n", '{"content": "a"}\n{"content": \n', '[{"content": "a"},'],
    ids=["empty", "blank", "empty-list", "garbage", "broken-line", "broken-list"],
)
def test_script_rejects_empty_or_malformed_files(tmp_path: Path, text: str) -> None:
    path = tmp_path / "script.jsonl"
    path.write_text(text)
    with pytest.raises(ScriptError, match="script"):
        ScriptedReplies.from_file(path)


@pytest.mark.parametrize(
    "entry", [{"content": ""}, {"role": "assistant"}, {"tool_calls": []}, "just a string", None]
)
def test_script_rejects_entries_without_content_or_tool_calls(tmp_path: Path, entry: object) -> None:
    path = tmp_path / "script.json"
    path.write_text(json.dumps([{"content": "fine"}, entry]))
    with pytest.raises(ScriptError, match="reply 1"):
        ScriptedReplies.from_file(path)


def test_script_rejects_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ScriptError, match="cannot read"):
        ScriptedReplies.from_file(tmp_path / "absent.jsonl")


def test_take_serves_replies_in_order_then_says_exhausted() -> None:
    script = ScriptedReplies([{"content": "one"}, {"content": "two"}])
    assert [script.take()["content"], script.take()["content"]] == ["one", "two"]
    assert script.served == 2
    with pytest.raises(ScriptError, match="exhausted"):
        script.take()


# completion_ids and token_bytes


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.mark.parametrize(
    "arguments", [{"command": "ls -la"}, '{"command": "ls -la"}'], ids=["object", "string"]
)
def test_completion_ids_of_a_tool_call_reply_are_the_qwen_tool_call_text(
    tokenizer, arguments: object
) -> None:
    messages = [{"role": "user", "content": "What is in this folder?"}]
    reply = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "bash", "arguments": arguments}}],
    }
    ids = completion_ids(tokenizer, messages, TOOLS, reply)
    assert tokenizer.decode(ids) == (
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call><|im_end|>'
    )
    assert ids[-1] == tokenizer.eos_token_id
    assert ids.count(tokenizer.eos_token_id) == 1


def test_completion_ids_of_a_text_reply_end_at_the_end_of_turn(tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    ids = completion_ids(tokenizer, messages, None, {"role": "assistant", "content": "Hello there."})
    assert tokenizer.decode(ids) == "Hello there.<|im_end|>"
    assert ids[-1] == tokenizer.eos_token_id


@pytest.mark.parametrize("text", ["héllo 🙂", "漢字 and tabs\t\n", "<tool_call>\n{}\n</tool_call><|im_end|>"])
def test_token_bytes_add_up_to_the_utf8_text(tokenizer, text: str) -> None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    raw = b"".join(bytes(token_bytes(tokenizer, token_id)) for token_id in ids)
    assert raw == text.encode("utf-8")
