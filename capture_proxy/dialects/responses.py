"""OpenAI Responses (``POST /v1/responses``), as codex speaks it.

Contract (request → one upstream Chat Completions body):

- ``instructions`` becomes a leading system message; ``input`` is a string (one user message) or a list
  of items, translated in order:
  ``message`` (also an item with a ``role`` and no ``type``; ``developer`` and ``system`` → system,
  content a string or ``input_text``/``output_text`` blocks joined with :data:`TEXT_JOIN`),
  ``function_call`` (→ ``tool_calls`` of the assistant message right before it, or of a new assistant
  message with ``content: null``), ``function_call_output`` (→ a ``role: "tool"`` message).
- A ``reasoning`` item's text (its ``reasoning_text`` content, else its summary) goes upstream as the
  ``reasoning`` of the assistant message that follows it (vLLM's field for interleaved thinking; the chat
  template decides whether to show it), so a thinking model's next prompt still extends what it sampled.
  Encrypted reasoning means nothing to the engine and is dropped.
- Function tools become Chat Completions function tools; ``strict`` is not forwarded (it asks for
  constrained decoding of the arguments; the model is sampled freely instead).
- Refused with 400 before anything is forwarded: non-function tools and other item types (naming the
  type), images/files/audio, forced ``tool_choice`` (``required`` or a named tool), structured output
  (``text.format`` ``json_schema``/``json_object``), ``previous_response_id`` (the proxy is stateless:
  send the full input), a missing ``model`` or ``input``, malformed fields.
- ``max_output_tokens`` → ``max_tokens``; sampling and the other request options listed in
  :data:`AGENT_PARAM_FIELDS` are copied to ``agent_params`` as sent.

Replies render as a ``response`` object (output items in order: reasoning, message, function calls;
``status: "incomplete"`` when the output cap was hit) or as the Responses SSE sequence
``response.created``, ``response.in_progress``, per item ``response.output_item.added`` … ``.done``,
then ``response.completed`` / ``response.incomplete``, numbered by ``sequence_number`` from 0.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
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
DELTA_CHARS = 64  # characters per streamed delta; any split is valid, this keeps frames small and few
AGENT_PARAM_FIELDS = (
    "temperature",
    "top_p",
    "max_output_tokens",
    "reasoning",
    "text",
    "store",
    "parallel_tool_calls",
    "previous_response_id",
    "tool_choice",
)
TEXT_BLOCKS = ("input_text", "output_text")
UNSUPPORTED_MEDIA = ("input_image", "input_file", "input_audio")
SYSTEM_ROLES = ("system", "developer")
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}
ERROR_CODES = {429: "rate_limit_exceeded"}  # codex reads this code to back off

Frame = Callable[..., bytes]


class ResponsesDialect:
    """The Responses API; see the module docstring for the translation contract."""

    name = "responses"
    keepalive = SSE_KEEPALIVE

    def parse_request(self, body: dict[str, Any]) -> ChatCall:
        """Translate a Responses request; raise :class:`DialectError` (400) for what cannot be forwarded."""
        if not isinstance(body, dict):
            raise DialectError("request body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise DialectError("model: required, a non-empty string", param="model")
        if body.get("previous_response_id") is not None:
            raise DialectError(
                "previous_response_id: not supported; this proxy is stateless, send the full input",
                param="previous_response_id",
            )
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise DialectError("stream: must be a boolean", param="stream")
        _check_text_format(body.get("text"))

        upstream: dict[str, Any] = {"messages": _instructions(body.get("instructions")) + _input(body)}
        tools = _tools(body.get("tools"))
        choice = _tool_choice(body.get("tool_choice"))
        if tools:
            upstream["tools"] = tools
            if choice is not None:
                upstream["tool_choice"] = choice
        cap = body.get("max_output_tokens")
        if cap is not None:
            if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
                raise DialectError("max_output_tokens: must be a positive integer", param="max_output_tokens")
            upstream["max_tokens"] = cap
        agent_params = {key: body[key] for key in AGENT_PARAM_FIELDS if key in body}
        return ChatCall(self.name, upstream, stream, model, agent_params)

    def render_reply(self, reply: Reply, call: ChatCall) -> dict[str, Any]:
        """The ``response`` object for a non-streaming response."""
        incomplete = reply.finish_reason == "length"
        return {
            "id": "resp_" + _suffix(reply.id),
            "object": "response",
            "created_at": reply.created,
            "status": "incomplete" if incomplete else "completed",
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": None,
            "metadata": {},
            "model": call.model,
            "output": _output(reply, "incomplete" if incomplete else "completed"),
            "parallel_tool_calls": call.agent_params.get("parallel_tool_calls") is not False,
            "previous_response_id": None,
            "max_output_tokens": call.body.get("max_tokens"),
            "tool_choice": call.body.get("tool_choice", "auto"),
            "tools": [],
            "text": {"format": {"type": "text"}},
            "usage": {
                "input_tokens": reply.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": reply.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": reply.prompt_tokens + reply.completion_tokens,
            },
        }

    def render_stream(self, reply: Reply, call: ChatCall) -> Iterator[bytes]:
        """The SSE sequence replaying ``reply``, ending with ``response.completed``/``.incomplete``."""
        final = self.render_reply(reply, call)
        numbers = itertools.count()

        def frame(kind: str, **fields: Any) -> bytes:
            return _frame(kind, {"type": kind, "sequence_number": next(numbers), **fields})

        pending = {**final, "status": "in_progress", "incomplete_details": None, "output": [], "usage": None}
        yield frame("response.created", response=pending)
        yield frame("response.in_progress", response=pending)
        for index, item in enumerate(final["output"]):
            yield from _item_frames(frame, index, item)
        yield frame(f"response.{final['status']}", response=final)

    def render_error(self, status: int, message: str) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}`` in OpenAI's shape."""
        error = {
            "message": message,
            "type": _error_type(status),
            "param": None,
            "code": ERROR_CODES.get(status),
        }
        return {"error": error}

    def render_stream_error(self, status: int, message: str) -> bytes:
        """An ``event: error`` frame (the SDK's ``ResponseErrorEvent``).

        Its ``sequence_number`` is 0: the interface does not tell this method how many frames went out.
        """
        code = ERROR_CODES.get(status, _error_type(status))
        data = {"type": "error", "code": code, "message": message, "param": None, "sequence_number": 0}
        return _frame("error", data)


DIALECT = ResponsesDialect()


# ---------------------------------------------------------------------------------------------- requests


def _instructions(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, str):
        raise DialectError("instructions: must be a string", param="instructions")
    return [{"role": "system", "content": raw}] if raw else []


def _input(body: dict[str, Any]) -> list[dict[str, Any]]:
    raw = body.get("input")
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise DialectError("input: required, a string or a non-empty list of items", param="input")
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None
    for i, item in enumerate(raw):
        at = f"input[{i}]"
        count = len(messages)
        if not isinstance(item, dict):
            raise DialectError(f"{at}: must be an object", param=at)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            messages.append(_message_item(item, at))
        elif kind == "function_call":
            _append_call(messages, item, at)
        elif kind == "function_call_output":
            call_id = required_string(item, "call_id", at)
            content = _text(item.get("output"), f"{at}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
        elif kind == "reasoning":
            reasoning = _reasoning_text(item, at) or None
            continue
        else:
            raise DialectError(
                f"{at}.type: input item type {kind!r} is not supported by this proxy", param=at
            )
        if reasoning is not None and len(messages) > count and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning"] = reasoning
            reasoning = None
    if not messages:
        raise DialectError("input: holds no message the engine could answer", param="input")
    return messages


def _reasoning_text(item: dict[str, Any], at: str) -> str:
    """The readable text of a ``reasoning`` item: its ``reasoning_text`` content, else its summary."""
    for field in ("content", "summary"):
        parts = item.get(field)
        if not isinstance(parts, list):
            continue
        texts = [p.get("text") for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]
        if texts:
            return TEXT_JOIN.join(texts)
    return ""


def _message_item(item: dict[str, Any], at: str) -> dict[str, Any]:
    role = item.get("role")
    if role in SYSTEM_ROLES:
        role = "system"
    elif role not in ("user", "assistant"):
        raise DialectError(f"{at}.role: must be user, assistant, system or developer, got {role!r}", param=at)
    return {"role": role, "content": _text(item.get("content"), f"{at}.content")}


def _append_call(messages: list[dict[str, Any]], item: dict[str, Any], at: str) -> None:
    """Attach a ``function_call`` item to the assistant message right before it, or start one."""
    function = {
        "name": required_string(item, "name", at),
        "arguments": required_string(item, "arguments", at),
    }
    call = {"id": required_string(item, "call_id", at), "type": "function", "function": function}
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _text(content: Any, path: str) -> str:
    """The text of a string or of a list of ``input_text``/``output_text`` blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise DialectError(f"{path}: must be a string or a list of content blocks", param=path)
    texts: list[str] = []
    for j, block in enumerate(content):
        at = f"{path}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in TEXT_BLOCKS:
            texts.append(required_string(block, "text", at))
        elif kind in UNSUPPORTED_MEDIA:
            raise DialectError(f"{at}: {kind} blocks are not supported by this proxy (text only)", param=at)
        else:
            raise DialectError(f"{at}.type: content type {kind!r} is not supported by this proxy", param=at)
    return TEXT_JOIN.join(texts)


def _tools(raw: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(optional_list(raw, "tools")):
        at = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise DialectError(
                f"{at}.type: tool type {kind!r} is not supported by this proxy (function tools only)",
                param=at,
            )
        function: dict[str, Any] = {"name": required_string(tool, "name", at)}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        if tool.get("parameters") is not None:
            function["parameters"] = tool["parameters"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(raw: Any) -> str | None:
    if raw is None or raw in ("auto", "none"):
        return raw
    if raw == "required" or isinstance(raw, dict):
        raise DialectError(
            f"tool_choice: {raw!r} forces a tool call (constrained decoding), which this proxy refuses; "
            "use 'auto'",
            param="tool_choice",
        )
    raise DialectError("tool_choice: must be 'auto' or 'none'", param="tool_choice")


def _check_text_format(text: Any) -> None:
    if text is None:
        return
    if not isinstance(text, dict):
        raise DialectError("text: must be an object", param="text")
    fmt = text.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else fmt
    if kind is None or kind == "text":
        return
    raise DialectError(
        f"text.format: type {kind!r} asks for structured output (constrained decoding), which this proxy "
        "refuses; use 'text'",
        param="text.format",
    )


# ----------------------------------------------------------------------------------------------- replies


def _output(reply: Reply, status: str) -> list[dict[str, Any]]:
    base = _suffix(reply.id)
    items: list[dict[str, Any]] = []
    if reply.reasoning:
        content = [{"type": "reasoning_text", "text": reply.reasoning}]
        items.append(
            {"type": "reasoning", "id": f"rs_{base}", "summary": [], "content": content, "status": status}
        )
    if reply.content:
        text = {"type": "output_text", "text": reply.content, "annotations": []}
        items.append(
            {"type": "message", "id": f"msg_{base}", "status": status, "role": "assistant", "content": [text]}
        )
    for i, call in enumerate(reply.tool_calls):
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{base}_{i}",
                "call_id": call.id,
                "name": call.name,
                "arguments": call.arguments,
                "status": status,
            }
        )
    return items


def _item_frames(frame: Frame, index: int, item: dict[str, Any]) -> Iterator[bytes]:
    """``output_item.added``, the item's content events, ``output_item.done``."""
    where = {"item_id": item["id"], "output_index": index}
    kind = item["type"]
    if kind == "function_call":
        yield frame(
            "response.output_item.added",
            output_index=index,
            item={**item, "arguments": "", "status": "in_progress"},
        )
        for part in _chunks(item["arguments"]):
            yield frame("response.function_call_arguments.delta", **where, delta=part)
        yield frame("response.function_call_arguments.done", **where, arguments=item["arguments"])
    else:
        part = item["content"][0]
        text_events = "response.output_text" if kind == "message" else "response.reasoning_text"
        extra = {"logprobs": []} if kind == "message" else {}
        added = {**item, "content": [], "status": "in_progress"}
        yield frame("response.output_item.added", output_index=index, item=added)
        yield frame("response.content_part.added", **where, content_index=0, part={**part, "text": ""})
        for delta in _chunks(part["text"]):
            yield frame(f"{text_events}.delta", **where, content_index=0, delta=delta, **extra)
        yield frame(f"{text_events}.done", **where, content_index=0, text=part["text"], **extra)
        yield frame("response.content_part.done", **where, content_index=0, part=part)
    yield frame("response.output_item.done", output_index=index, item=item)


def _suffix(reply_id: str) -> str:
    return reply_id.removeprefix("chatcmpl-")


def _error_type(status: int) -> str:
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "server_error" if status >= 500 else "invalid_request_error"


def _chunks(text: str) -> list[str]:
    return [text[i : i + DELTA_CHARS] for i in range(0, len(text), DELTA_CHARS)]


def _frame(event: str, data: dict[str, Any]) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"
