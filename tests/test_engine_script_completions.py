"""The dev engine's scripted mode on ``/v1/completions`` (a white-box model step's endpoint): a real engine
process replays its script's replies for token-id prompts with the ids the chat would have given them."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from harness_trainer.dev_engine.chat import render_prompt_ids
from harness_trainer.dev_engine.script import completion_ids
from tests.conftest import start_engine

BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a command.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
}
CALL = {
    "content": "",
    "tool_calls": [{"type": "function", "function": {"name": "bash", "arguments": {"command": "ls /app"}}}],
}
ANSWER = {"content": "Done."}


@pytest.mark.slow
def test_a_token_id_prompt_gets_the_next_scripted_reply_as_the_chat_would_have_given_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    script = tmp_path / "replies.jsonl"
    script.write_text("\n".join(json.dumps(reply) for reply in (CALL, ANSWER)) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    conversation = [
        {"role": "system", "content": "You solve tasks with the bash tool."},
        {"role": "user", "content": "List /app."},
    ]
    prompt = render_prompt_ids(tokenizer, conversation, [BASH])
    engine = start_engine(tiny_model_dir, "--script", str(script))
    try:
        with httpx.Client(base_url=engine.url, timeout=60) as client:
            body = {"model": engine.model, "prompt": prompt, "max_tokens": 256, "logprobs": 0}
            body["return_token_ids"] = True
            replies = [client.post("/v1/completions", json=body) for _ in range(3)]
    finally:
        engine.stop()
    first, second, exhausted = replies
    assert first.status_code == second.status_code == 200
    # The same ids as the reply after the real conversation (and its tools) renders to: context-free.
    for reply, scripted in ((first, CALL), (second, ANSWER)):
        choice = reply.json()["choices"][0]
        expected = completion_ids(tokenizer, conversation, [BASH], {"role": "assistant", **scripted})
        assert choice["token_ids"] == expected
        assert choice["finish_reason"] == "stop" and len(choice["logprobs"]["token_logprobs"]) == len(
            choice["token_ids"]
        )
    assert exhausted.status_code == 400 and "script exhausted" in exhausted.text
