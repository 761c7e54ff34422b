"""Anthropic Messages (``POST /v1/messages``), as claude-code speaks it.

Contract (request → one upstream Chat Completions body):

- ``system`` (string or text blocks) becomes one leading system message; ``messages`` alternate user and
  assistant turns whose content is a string or blocks.
- Text blocks of one turn (and of one ``tool_result``) are joined with :data:`TEXT_JOIN` (a blank line).
- A user turn's ``tool_result`` blocks become one ``role: "tool"`` message each, in block order; its text
  blocks follow them as one user message (Chat Completions wants tool results right after the call).
- ``tool_result.is_error`` is not written into the prompt: claude-code already puts the error text
  (``<tool_use_error>…``) in the content, and a prefix would change what the model sees twice.
- ``thinking`` blocks of an assistant turn go upstream as the message's ``reasoning`` (vLLM's field for
  interleaved thinking; the chat template decides whether to show it), so a thinking model's template
  re-renders the turn as it was sampled and the next prompt still extends it. ``redacted_thinking`` is
  encrypted and means nothing to the engine: dropped.
- ``tool_use.input`` becomes ``arguments = json.dumps(input, ensure_ascii=False)``, the spelling vLLM's
  tool parsers produce, so a call the engine made round-trips to the same text. An input of exactly
  ``{"_raw": "<text>"}`` (what :meth:`render_reply` sends for arguments that are not a JSON object) maps
  back to ``<text>``.
- Tools keep ``name``, ``description`` and ``input_schema``; ``strict`` is not forwarded (it asks for
  constrained decoding of the input; the model is sampled freely instead).
- Refused with 400 before anything is forwarded: images and documents, server tools, constrained
  decoding (``tool_choice`` ``any``/``tool``, ``output_config.format``, the beta ``output_format``), a
  trailing assistant turn (prefill cannot be continued through Chat Completions), a missing ``model`` or
  ``max_tokens``, malformed fields.
- The fields in :data:`AGENT_PARAM_FIELDS` (sampling, output cap, ``thinking``, ``metadata``, …) are
  copied to ``agent_params`` as sent; ``body`` only carries ``max_tokens``, ``stop`` and the tools.

Replies render as a ``message`` object (blocks in order: thinking, text, tool_use) or as the Messages SSE
sequence ``message_start``, per block ``content_block_start`` / ``content_block_delta``… /
``content_block_stop``, ``message_delta``, ``message_stop``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import orjson

from capture_proxy.dialects.base import (
    SSE_KEEPALIVE,
    ChatCall,
    DialectError,
    Reply,
    optional_list,
    required_string,
)

TEXT_JOIN = "\n\n"
RAW_ARGUMENTS_KEY = "_raw"
DELTA_CHARS = 64  # characters per streamed delta; any split is valid, this keeps frames small and few

AGENT_PARAM_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "stop_sequences",
    "thinking",
    "metadata",
    "tool_choice",
    "output_config",
)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}
UNSUPPORTED_MEDIA = ("image", "document")


class AnthropicDialect:
    """The Messages API; see the module docstring for the translation contract."""

    name = "anthropic"
    keepalive = SSE_KEEPALIVE

    def parse_request(self, body: dict[str, Any]) -> ChatCall:
        """Translate a Messages request; raise :class:`DialectError` (400) for what cannot be forwarded."""
        if not isinstance(body, dict):
            raise DialectError("request body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise DialectError("model: required, a non-empty string", param="model")
        max_tokens = body.get("max_tokens")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise DialectError("max_tokens: required, a positive integer", param="max_tokens")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise DialectError("stream: must be a boolean", param="stream")
        _refuse_structured_output(body)

        messages = _system_messages(body.get("system")) + _messages(body.get("messages"))
        upstream: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens}
        tools = _tools(body.get("tools"))
        if tools:
            upstream["tools"] = tools
            choice = _tool_choice(body.get("tool_choice"))
            if choice is not None:
                upstream["tool_choice"] = choice
        else:
            _tool_choice(body.get("tool_choice"))  # still refuse a forced choice
        stop = _stop(body.get("stop_sequences"))
        if stop:
            upstream["stop"] = stop
        agent_params = {key: body[key] for key in AGENT_PARAM_FIELDS if key in body}
        return ChatCall(self.name, upstream, stream, model, agent_params)

    def render_reply(self, reply: Reply, call: ChatCall) -> dict[str, Any]:
        """The ``message`` object for a non-streaming response."""
        stop_reason = _stop_reason(reply)
        return {
            "id": _message_id(reply.id),
            "type": "message",
            "role": "assistant",
            "model": call.model,
            "content": _reply_blocks(reply),
            "stop_reason": stop_reason,
            "stop_sequence": reply.stop_sequence if stop_reason == "stop_sequence" else None,
            "usage": _usage(reply.prompt_tokens, reply.completion_tokens),
        }

    def render_stream(self, reply: Reply, call: ChatCall) -> Iterator[bytes]:
        """The Messages SSE sequence replaying ``reply``, ending with ``message_stop``."""
        message = self.render_reply(reply, call)
        start = {
            **message,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            # The real API reports one output token at the start; the final count comes in message_delta.
            "usage": _usage(reply.prompt_tokens, min(1, reply.completion_tokens)),
        }
        yield _frame("message_start", {"type": "message_start", "message": start})
        for index, block in enumerate(message["content"]):
            yield from _block_frames(index, block)
        delta = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
        usage = {"input_tokens": reply.prompt_tokens, "output_tokens": reply.completion_tokens}
        yield _frame("message_delta", {"type": "message_delta", "delta": delta, "usage": usage})
        yield _frame("message_stop", {"type": "message_stop"})

    def render_error(self, status: int, message: str) -> dict[str, Any]:
        """``{"type": "error", "error": {"type", "message"}}`` with the API's error type for ``status``."""
        return {"type": "error", "error": {"type": _error_type(status), "message": message}}

    def render_stream_error(self, status: int, message: str) -> bytes:
        """An ``event: error`` frame carrying :meth:`render_error`'s body."""
        return _frame("error", self.render_error(status, message))


DIALECT = AnthropicDialect()


# ---------------------------------------------------------------------------------------------- requests


def _system_messages(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    text = _text(system, "system")
    return [{"role": "system", "content": text}] if text else []


def _messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise DialectError("messages: required, a non-empty list", param="messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise DialectError(f"{where}: must be an object", param=where)
        role = message.get("role")
        if role == "user":
            out.extend(_user_turn(_blocks(message.get("content"), f"{where}.content"), where))
        elif role == "assistant":
            out.append(_assistant_turn(_blocks(message.get("content"), f"{where}.content"), where))
        elif role == "system":
            # Newer claude-code sends mid-conversation system messages; the chat template renders them.
            out.append({"role": "system", "content": _text(message.get("content"), f"{where}.content")})
        else:
            message_roles = "'user', 'assistant' or 'system'"
            raise DialectError(f"{where}.role: must be {message_roles}, got {role!r}", param=where)
    if raw[-1].get("role") == "assistant":
        where = f"messages[{len(raw) - 1}]"
        raise DialectError(
            f"{where}: a trailing assistant message (prefill) is not supported by this proxy", param=where
        )
    return out


def _user_turn(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = block["type"]
        if kind == "text":
            texts.append(required_string(block, "text", at))
        elif kind == "tool_result":
            call_id = required_string(block, "tool_use_id", at)
            content = block.get("content")
            text = "" if content is None else _text(content, f"{at}.content")
            results.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            _refuse_block(kind, at, "a user message")
    if texts or not results:
        results.append({"role": "user", "content": TEXT_JOIN.join(texts)})
    return results


def _assistant_turn(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = block["type"]
        if kind == "text":
            texts.append(required_string(block, "text", at))
        elif kind == "thinking":
            thoughts.append(required_string(block, "thinking", at))
        elif kind == "tool_use":
            tool_input = block.get("input", {})
            if not isinstance(tool_input, dict):
                raise DialectError(f"{at}.input: must be an object", param=f"{at}.input")
            function = {"name": required_string(block, "name", at), "arguments": tool_arguments(tool_input)}
            calls.append({"id": required_string(block, "id", at), "type": "function", "function": function})
        elif kind == "redacted_thinking":
            continue  # encrypted: nothing the engine can render; see the module docstring
        else:
            _refuse_block(kind, at, "an assistant message")
    message: dict[str, Any] = {"role": "assistant", "content": TEXT_JOIN.join(texts) if texts else None}
    if thoughts:
        message["reasoning"] = TEXT_JOIN.join(thoughts)
    if calls:
        message["tool_calls"] = calls
    elif message["content"] is None:
        message["content"] = ""
    return message


def _blocks(content: Any, path: str) -> list[dict[str, Any]]:
    """Content (the field at ``path``) as a list of typed blocks; a plain string is one text block."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise DialectError(f"{path}: must be a string or a list of blocks", param=path)
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            at = f"{path}[{j}]"
            raise DialectError(f"{at}: must be an object with a string 'type'", param=at)
    return content


def _text(content: Any, path: str) -> str:
    """The text of a string or a list of text blocks (``system``, ``tool_result.content``)."""
    texts: list[str] = []
    for j, block in enumerate(_blocks(content, path)):
        at = f"{path}[{j}]"
        if block["type"] != "text":
            _refuse_block(block["type"], at, path)
        texts.append(required_string(block, "text", at))
    return TEXT_JOIN.join(texts)


def _refuse_block(kind: str, at: str, context: str) -> None:
    if kind in UNSUPPORTED_MEDIA:
        raise DialectError(f"{at}: {kind} blocks are not supported by this proxy (text only)", param=at)
    raise DialectError(f"{at}.type: block type {kind!r} is not supported in {context}", param=at)


def _tools(raw: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(optional_list(raw, "tools")):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise DialectError(f"{at}: must be an object", param=at)
        kind = tool.get("type", "custom")
        if kind != "custom" or not isinstance(tool.get("input_schema"), dict):
            raise DialectError(
                f"{at}: tool type {kind!r} is not supported; only client tools with an input_schema are",
                param=at,
            )
        function: dict[str, Any] = {"name": required_string(tool, "name", at)}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        function["parameters"] = tool["input_schema"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(raw: Any) -> str | None:
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind in ("any", "tool"):
        raise DialectError(
            f"tool_choice: type {kind!r} forces a tool call (constrained decoding), which this proxy "
            "refuses; use 'auto'",
            param="tool_choice",
        )
    raise DialectError("tool_choice: must be an object with type 'auto' or 'none'", param="tool_choice")


def _refuse_structured_output(body: dict[str, Any]) -> None:
    output_config = body.get("output_config")
    fields = {
        "output_config.format": output_config.get("format") if isinstance(output_config, dict) else None,
        "output_format": body.get("output_format"),  # the beta spelling
    }
    for name, value in fields.items():
        if value is not None:
            raise DialectError(
                f"{name}: structured output is constrained decoding, which this proxy refuses", param=name
            )


def _stop(raw: Any) -> list[str]:
    if raw is None:
        return []
    if not isinstance(raw, list) or not all(isinstance(s, str) for s in raw):
        raise DialectError("stop_sequences: must be a list of strings", param="stop_sequences")
    return raw


def tool_arguments(tool_input: dict[str, Any]) -> str:
    """``tool_use.input`` as Chat Completions arguments; the inverse of :func:`tool_input`."""
    raw = tool_input.get(RAW_ARGUMENTS_KEY)
    if len(tool_input) == 1 and isinstance(raw, str):
        return raw
    return json.dumps(tool_input, ensure_ascii=False)


# ----------------------------------------------------------------------------------------------- replies


def tool_input(arguments: str) -> dict[str, Any]:
    """Engine arguments as a ``tool_use.input`` object; text that is not a JSON object is kept whole
    under ``"_raw"`` so the agent sees (and sends back) exactly what the model wrote."""
    if not arguments.strip():
        return {}
    try:
        parsed = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        parsed = None
    return parsed if isinstance(parsed, dict) else {RAW_ARGUMENTS_KEY: arguments}


def _reply_blocks(reply: Reply) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if reply.reasoning:
        blocks.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
    if reply.content:
        blocks.append({"type": "text", "text": reply.content})
    for call in reply.tool_calls:
        blocks.append(
            {"type": "tool_use", "id": call.id, "name": call.name, "input": tool_input(call.arguments)}
        )
    return blocks


def _stop_reason(reply: Reply) -> str:
    if reply.finish_reason == "length":
        return "max_tokens"
    if reply.tool_calls:
        return "tool_use"
    if reply.stop_sequence is not None:
        return "stop_sequence"
    return "end_turn"


def _usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def _message_id(reply_id: str) -> str:
    return "msg_" + reply_id.removeprefix("chatcmpl-")


def _error_type(status: int) -> str:
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def _block_frames(index: int, block: dict[str, Any]) -> Iterator[bytes]:
    kind = block["type"]
    if kind == "text":
        start: dict[str, Any] = {"type": "text", "text": ""}
        deltas = [{"type": "text_delta", "text": part} for part in _chunks(block["text"])]
    elif kind == "thinking":
        start = {"type": "thinking", "thinking": "", "signature": ""}
        deltas = [{"type": "thinking_delta", "thinking": part} for part in _chunks(block["thinking"])]
        deltas.append({"type": "signature_delta", "signature": block["signature"]})
    else:
        start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
        partial = json.dumps(block["input"], ensure_ascii=False) if block["input"] else ""
        deltas = [{"type": "input_json_delta", "partial_json": part} for part in _chunks(partial)]
    yield _frame(
        "content_block_start", {"type": "content_block_start", "index": index, "content_block": start}
    )
    for delta in deltas:
        yield _frame("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
    yield _frame("content_block_stop", {"type": "content_block_stop", "index": index})


def _chunks(text: str) -> list[str]:
    return [text[i : i + DELTA_CHARS] for i in range(0, len(text), DELTA_CHARS)]


def _frame(event: str, data: dict[str, Any]) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"
