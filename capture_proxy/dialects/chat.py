"""OpenAI Chat Completions, as opencode and mini-swe-agent (litellm) speak it.

Requests pass through nearly as they are: ``messages``, ``tools``, ``tool_choice`` (``auto``/``none``),
``stop`` and the output cap (``max_tokens`` or ``max_completion_tokens``) are forwarded; every other field
(temperature, top_p, penalties, seed, logprobs, …) is kept in ``agent_params`` for the journal and replaced
by the session's sampling policy. Constrained decoding is refused by :mod:`capture_proxy.constraints`.
Replies are rebuilt from the normalised :class:`Reply`, so the engine's ids and logprobs never reach the
agent; a stream is the reply cut into ``chat.completion.chunk`` frames, tool calls as a header delta
followed by argument deltas (as vLLM streams them), then ``data: [DONE]``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson

from capture_proxy.constraints import refuse_constrained
from capture_proxy.dialects.base import SSE_KEEPALIVE, ChatCall, DialectError, Reply

# Fields that shape the upstream prompt or stopping, as opposed to sampling.
_FORWARDED = ("tools", "tool_choice", "stop")
_CONTENT_FIELDS = ("messages", "tools")
_TEXT_CHUNK = 256
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


def sse(payload: dict[str, Any], event: str | None = None) -> bytes:
    """One SSE frame; ``event`` names it where the dialect uses named events."""
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + orjson.dumps(payload) + b"\n\n"


def text_chunks(text: str, size: int = _TEXT_CHUNK) -> list[str]:
    """``text`` cut into pieces of at most ``size`` characters (none for an empty text)."""
    return [text[i : i + size] for i in range(0, len(text), size)]


def output_cap(body: dict[str, Any], *names: str) -> int | None:
    """The agent's output-token cap under any of ``names``; the smallest when several are given."""
    caps = []
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DialectError(f"'{name}' must be a positive integer, got {value!r}", param=name)
        caps.append(value)
    return min(caps) if caps else None


class ChatDialect:
    """OpenAI Chat Completions in and out."""

    name = "chat"
    keepalive = SSE_KEEPALIVE

    def parse_request(self, body: dict[str, Any]) -> ChatCall:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise DialectError("'messages' must be a non-empty list of message objects", param="messages")
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise DialectError(f"messages[{index}] must be an object with a 'role'", param="messages")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise DialectError("'tools' must be a list", param="tools")
        refuse_constrained(body)
        n = body.get("n", 1)
        if n not in (1, None):
            raise DialectError(f"n={n!r} is not supported: the proxy captures exactly one choice", param="n")
        upstream: dict[str, Any] = {"messages": messages}
        for name in _FORWARDED:
            if body.get(name) is not None:
                upstream[name] = body[name]
        cap = output_cap(body, "max_tokens", "max_completion_tokens")
        if cap is not None:
            upstream["max_tokens"] = cap
        model = body.get("model")
        return ChatCall(
            dialect=self.name,
            body=upstream,
            stream=bool(body.get("stream")),
            model=model if isinstance(model, str) else "",
            agent_params={k: v for k, v in body.items() if k not in _CONTENT_FIELDS},
        )

    def render_reply(self, reply: Reply, call: ChatCall) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if reply.reasoning is not None:
            message["reasoning_content"] = reply.reasoning
        if reply.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in reply.tool_calls
            ]
        return {
            "id": reply.id,
            "object": "chat.completion",
            "created": reply.created,
            "model": call.model or reply.model,
            "choices": [
                {"index": 0, "message": message, "logprobs": None, "finish_reason": reply.finish_reason}
            ],
            "usage": _usage(reply),
        }

    def render_stream(self, reply: Reply, call: ChatCall) -> Iterator[bytes]:
        base = {"id": reply.id, "object": "chat.completion.chunk", "created": reply.created}
        base["model"] = call.model or reply.model

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return sse({**base, "choices": [choice]})

        yield chunk({"role": "assistant", "content": ""})
        for piece in text_chunks(reply.reasoning or ""):
            yield chunk({"reasoning_content": piece})
        for piece in text_chunks(reply.content or ""):
            yield chunk({"content": piece})
        for index, call_ in enumerate(reply.tool_calls):
            head = {"index": index, "id": call_.id, "type": "function"}
            yield chunk({"tool_calls": [{**head, "function": {"name": call_.name, "arguments": ""}}]})
            for piece in text_chunks(call_.arguments):
                yield chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
        yield chunk({}, reply.finish_reason)
        options = call.agent_params.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            yield sse({**base, "choices": [], "usage": _usage(reply)})
        yield b"data: [DONE]\n\n"

    def render_error(self, status: int, message: str) -> dict[str, Any]:
        kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        return {"error": {"message": message, "type": kind, "param": None, "code": status}}

    def render_stream_error(self, status: int, message: str) -> bytes:
        return sse(self.render_error(status, message)) + b"data: [DONE]\n\n"


def _usage(reply: Reply) -> dict[str, int]:
    return {
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
    }


DIALECT = ChatDialect()
