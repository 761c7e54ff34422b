"""``harness-trainer demo``: the dev engine on the tiny model, and a tool-using chat with it.

Starts ``harness-trainer engine`` as a real process on loopback, talks to it with the official ``openai``
client (a tool call, then the tool's result and the final answer), prints the token ids and logprobs
the engine returns, and stops the engine on every path. The tiny model's weights are random, so the
engine runs in scripted mode: the replies come from ``demo_script.jsonl``, and the token ids and
logprobs are the model's own on exactly those replies.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import resources

from harness_trainer.net import free_port, wait_until_healthy

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command and return its output.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    }
]
CAPTURE = {"logprobs": True, "top_logprobs": 0}
CAPTURE_EXTRA = {"return_token_ids": True}


def _show(title: str, completion) -> None:
    choice = completion.choices[0]
    extra = completion.model_extra or {}
    token_ids = (choice.model_extra or {}).get("token_ids") or []
    logprobs = [round(entry.logprob, 3) for entry in (choice.logprobs.content or [])]
    print(f"\n== {title}: finish_reason={choice.finish_reason}")
    if choice.message.content:
        print(f"content: {choice.message.content}")
    for call in choice.message.tool_calls or []:
        print(f"tool call: {call.function.name}({call.function.arguments})")
    print(f"prompt_token_ids: {len(extra.get('prompt_token_ids') or [])} ids")
    print(f"completion token_ids ({len(token_ids)}): {token_ids}")
    print(f"logprobs: {logprobs}")


def run_demo(port: int = 0) -> int:
    from openai import OpenAI

    from harness_trainer.models.tiny import ensure_tiny_model

    model_dir = str(ensure_tiny_model())
    print(f"tiny model: {model_dir}")
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    script = resources.files("harness_trainer").joinpath("demo_script.jsonl")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    engine = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "harness_trainer.cli",
            "engine",
            "--model",
            model_dir,
            "--port",
            str(port),
            "--served-model-name",
            "tiny",
            "--script",
            str(script),
        ],
        env=env,
    )
    try:
        wait_until_healthy(url, engine)
        client = OpenAI(base_url=f"{url}/v1", api_key="unused")
        messages = [{"role": "user", "content": "What is in this folder?"}]
        first = client.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, temperature=1.0, **CAPTURE, extra_body=CAPTURE_EXTRA
        )
        _show("turn 1 (the model calls a tool)", first)
        call = first.choices[0].message.tool_calls[0]
        messages += [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "hello.txt"},
        ]
        second = client.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, temperature=1.0, **CAPTURE, extra_body=CAPTURE_EXTRA
        )
        _show("turn 2 (the model answers)", second)
        print("\n" + json.dumps({"ok": True, "engine": url, "tool_call": call.function.name}))
        return 0
    finally:
        engine.terminate()
        try:
            engine.wait(timeout=15)
        except subprocess.TimeoutExpired:
            engine.kill()
            engine.wait()
