"""The proxy benchmark's agents: 20-turn conversations with an 8,000-character system prompt, two tool
schemas and a task, each turn appending the reply's tool call and a tool result; closed loop or paced (see
:mod:`benchmarks.proxy`). Shared with :mod:`benchmarks.replicas`.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from benchmarks.common import Server

CAPTURE = {"logprobs": True, "top_logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True}
SAMPLING = {"temperature": 1.0}
MODEL = "fake-vllm"
PAUSE_S = (0.25, 0.75)
STAGGER_S = 0.5

_RULES = (
    "Read the relevant files before you change them, and keep every change as small as the task allows. ",
    "Run the project's tests after each change; a change that breaks a test is not finished. ",
    "Prefer the standard library and the project's existing helpers to new dependencies. ",
    "When a command fails, read its whole output before trying something else. ",
    "Never delete files you did not create, and never rewrite the history of the repository. ",
    "Explain what you did in one short paragraph when the task is complete. ",
)
SYSTEM_PROMPT = "".join(f"Rule {i + 1}. {_RULES[i % len(_RULES)]}" for i in range(200))[:8000]


def tool(name: str, description: str, **parameters: str) -> dict[str, Any]:
    """An OpenAI function tool whose parameters are all required strings (``name=description``)."""
    properties = {key: {"type": "string", "description": text} for key, text in parameters.items()}
    schema = {"type": "object", "properties": properties, "required": list(parameters)}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


TOOLS = [
    tool(
        "bash",
        "Run a bash command in the repository and return its output (stdout and stderr, truncated to 10,000 "
        "characters) and its exit code. Commands time out after 120 seconds.",
        command="The command line to run.",
    ),
    tool(
        "edit_file",
        "Replace one exact occurrence of old_text with new_text in a file; fails when old_text occurs zero "
        "times or more than once. Creates the file when old_text is empty.",
        path="Path relative to the repository root.",
        old_text="The text to replace, exactly.",
        new_text="The replacement.",
    ),
]


@dataclass(frozen=True)
class Point:
    """A concurrency point: agents at once, conversations in all, SSE or JSON replies, paced or not."""

    name: str
    agents: int
    conversations: int
    stream: bool
    paced: bool = False


@dataclass
class Target:
    """What the agents call: the engine directly, the pass-through or the proxy."""

    name: str
    url: str  # the chat completions endpoint
    server: Server | None  # the process whose CPU and memory are measured (none for direct)
    admin: tuple[str, str] | None = None  # proxy: (base URL, admin key)


def opening(conversation: int) -> list[dict[str, Any]]:
    """Conversation ``conversation``'s first messages: the system prompt and its task."""
    task = f"Task {conversation}: the test suite of project-{conversation} fails in tests/test_parser.py "
    task += "with a KeyError on nested sections. Find the cause, fix it, and show that the tests pass."
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task}]


def tool_result(conversation: int, turn: int) -> str:
    """The ~400-character tool output an agent appends after each turn (grep-like lines)."""
    lines = [
        f"src/pkg_{conversation}/module_{turn}_{i}.py:{17 * i + turn}:    return parse_section("
        for i in range(9)
    ]
    return "\n".join(lines)[:400]


def parse_reply(body: bytes, stream: bool) -> dict[str, Any]:
    """The assistant message an agent keeps: from a chat completion, or accumulated from SSE deltas."""
    if not stream:
        message = orjson.loads(body)["choices"][0]["message"]
        return {"role": "assistant", "content": message.get("content"), "tool_calls": message["tool_calls"]}
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for line in body.split(b"\n"):
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        for choice in orjson.loads(line[6:]).get("choices") or []:
            delta = choice.get("delta") or {}
            content.append(delta.get("content") or "")
            for part in delta.get("tool_calls") or []:
                call = calls.setdefault(part["index"], {"type": "function", "function": {"arguments": ""}})
                call["id"] = part.get("id") or call.get("id")
                function = part.get("function") or {}
                call["function"]["name"] = function.get("name") or call["function"].get("name")
                call["function"]["arguments"] += function.get("arguments") or ""
    tool_calls = [calls[index] for index in sorted(calls)]
    return {"role": "assistant", "content": "".join(content) or None, "tool_calls": tool_calls}


async def converse(
    client: aiohttp.ClientSession,
    target: Target,
    conversation: int,
    point: Point,
    turns: int,
    key: str | None,
) -> list[float]:
    """Hold one conversation; return each call's latency in seconds (pauses, when paced, not included)."""
    messages = opening(conversation)
    headers = {"Content-Type": "application/json"}
    extra: dict[str, Any] = {**CAPTURE, **SAMPLING}
    if target.admin is not None:
        headers["Authorization"] = f"Bearer {key}"
        extra = {"stream": True, "stream_options": {"include_usage": True}} if point.stream else {}
    stream = point.stream and target.admin is not None
    delays = pacing(conversation, turns) if point.paced else [0.0] * turns
    latencies = []
    for turn in range(turns):
        if delays[turn]:
            await asyncio.sleep(delays[turn])
        data = orjson.dumps({"model": MODEL, "messages": messages, "tools": TOOLS, **extra})
        start = time.perf_counter()
        async with client.post(target.url, data=data, headers=headers) as reply:
            body = await reply.read()
        latencies.append(time.perf_counter() - start)
        if reply.status != 200:
            raise RuntimeError(f"{target.name}: HTTP {reply.status} on turn {turn}: {body[:500]!r}")
        message = parse_reply(body, stream)
        result = {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"]}
        messages += [message, result | {"content": tool_result(conversation, turn)}]
    return latencies


def pacing(conversation: int, turns: int) -> list[float]:
    """Seconds to wait before each turn: a start offset, then a think pause; the same for every target."""
    rng = random.Random(f"paced:{conversation}")
    return [rng.uniform(0, STAGGER_S)] + [rng.uniform(*PAUSE_S) for _ in range(turns - 1)]
