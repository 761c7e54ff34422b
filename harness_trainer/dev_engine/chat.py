"""Chat rendering and tool-call parsing, the way vLLM does them for a Qwen-style model.

Rendering: OpenAI messages go through the tokenizer's chat template. As vLLM does, content given as a
list of text parts is joined, and tool-call ``arguments`` sent as JSON strings (the OpenAI convention)
are parsed to objects first, because Qwen templates render them with ``tojson``.

Parsing: the Hermes/Qwen convention, ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.
Text before the first tool call is the message content; a block that is not valid JSON leaves the whole
reply as plain content, as vLLM's hermes parser does.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class RenderError(ValueError):
    """Messages the chat template cannot render (a 400 for the client)."""


@dataclass
class ParsedReply:
    """An assistant reply split into content and OpenAI-shaped tool calls."""

    content: str | None
    tool_calls: list[dict[str, Any]]


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copy messages into the shape chat templates expect (text content, object arguments)."""
    out = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise RenderError(f"messages[{index}] must be an object with a 'role'")
        message = dict(message)
        message["content"] = _text_content(message.get("content"), index)
        if message.get("tool_calls"):
            message["tool_calls"] = [_normalize_call(call) for call in message["tool_calls"]]
        out.append(message)
    return out


def _text_content(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text"):
                raise RenderError(f"messages[{index}]: only text content parts are supported")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise RenderError(f"messages[{index}].content must be a string or a list of text parts")


def _normalize_call(call: dict[str, Any]) -> dict[str, Any]:
    call = dict(call)
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass  # keep the string: the template renders what the agent sent
    call["function"] = function
    return call


def render_prompt_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of ``messages`` (and ``tools``) rendered by the chat template."""
    return tokenizer(
        render_prompt_text(tokenizer, messages, tools, add_generation_prompt), add_special_tokens=False
    )["input_ids"]


def render_prompt_text(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool = True,
) -> str:
    try:
        return tokenizer.apply_chat_template(
            normalize_messages(messages),
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
    except RenderError:
        raise
    except Exception as exc:  # jinja errors of every kind mean the messages do not fit the template
        raise RenderError(f"the chat template could not render these messages: {exc}") from exc


def parse_tool_calls(text: str) -> ParsedReply:
    """Split ``text`` into content and tool calls (Hermes/Qwen ``<tool_call>`` blocks)."""
    start = text.find(TOOL_CALL_OPEN)
    if start == -1:
        return ParsedReply(content=text, tool_calls=[])
    calls = []
    for body in _TOOL_CALL_RE.findall(text[start:]):
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            return ParsedReply(content=text, tool_calls=[])
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return ParsedReply(content=text, tool_calls=[])
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append(
            {
                "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
                "type": "function",
                "function": {
                    "name": call["name"],
                    "arguments": arguments
                    if isinstance(arguments, str)
                    else json.dumps(arguments, ensure_ascii=False),
                },
            }
        )
    content = text[:start].rstrip()
    return ParsedReply(content=content or None, tool_calls=calls)
