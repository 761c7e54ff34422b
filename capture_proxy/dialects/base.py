"""What every dialect translates to and from.

A dialect (OpenAI Chat Completions, Anthropic Messages, OpenAI Responses) turns an agent's request body
into one :class:`ChatCall`, whose ``body`` is an upstream Chat Completions request *without* sampling or
capture fields (the proxy adds those), and turns the engine's answer, normalised as a :class:`Reply`,
back into the agent's own JSON or SSE frames. Dialects are pure: no I/O, no clocks other than the
``created`` stamp carried in the reply.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

SSE_KEEPALIVE = b": keepalive\n\n"
"""An SSE comment: OpenAI's and Anthropic's clients skip it."""

# Sampling and length fields an agent may send; recorded as the agent's request, then overridden.
OUTPUT_CAP_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


class DialectError(Exception):
    """A request the proxy refuses before forwarding anything (answered as a 4xx in the agent's dialect)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


@dataclass
class ChatCall:
    """One agent request, translated.

    ``body`` is a Chat Completions request for the engine: ``messages`` (OpenAI shape, with ``tool_calls``
    on assistant messages and ``role: "tool"`` results), and where the agent gave them ``tools``,
    ``tool_choice`` (only ``"auto"``/``"none"`` reach here), ``stop`` and ``max_tokens``. It never holds
    sampling fields, ``stream``, ``model`` or capture flags. ``agent_params`` is what the agent asked for
    (temperature, top_p, output caps, …) exactly as sent, kept for the journal.
    """

    dialect: str
    body: dict[str, Any]
    stream: bool
    model: str
    agent_params: dict[str, Any] = field(default_factory=dict)

    @property
    def has_tools(self) -> bool:
        return bool(self.body.get("tools"))


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, exactly as the engine produced it


@dataclass
class Reply:
    """The engine's answer, normalised; what dialects render.

    ``finish_reason`` is Chat Completions' (``stop``, ``length``, ``tool_calls``); ``stop_sequence`` is
    the stop string the engine matched, when it reports one (vLLM's ``stop_reason``).
    """

    id: str
    created: int
    model: str
    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    reasoning: str | None = None
    stop_sequence: str | None = None


def optional_list(raw: Any, name: str) -> list[Any]:
    """A request's optional list field: [] when absent, else the list; a 400 naming it when not a list."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise DialectError(f"{name}: must be a list", param=name)
    return raw


def required_string(obj: dict[str, Any], key: str, at: str) -> str:
    """``obj[key]`` when it is a string, else a 400 naming the field by its path (``at.key``)."""
    value = obj.get(key)
    if not isinstance(value, str):
        raise DialectError(f"{at}.{key}: required, a string", param=f"{at}.{key}")
    return value


class Dialect(Protocol):
    """One agent-facing API shape. Implementations live beside this module, one file each."""

    name: str
    keepalive: bytes | None
    """What a streaming client is sent while its call is slow (the first one opens the event stream);
    None: nothing until the reply, for clients whose frame parser cannot skip an SSE comment."""

    def parse_request(self, body: dict[str, Any]) -> ChatCall:
        """Translate a request body; raise :class:`DialectError` for what cannot be forwarded."""
        ...

    def render_reply(self, reply: Reply, call: ChatCall) -> dict[str, Any]:
        """The non-streaming response body."""
        ...

    def render_stream(self, reply: Reply, call: ChatCall) -> Iterator[bytes]:
        """Every SSE frame of a streamed response, terminators included (e.g. ``data: [DONE]``)."""
        ...

    def render_error(self, status: int, message: str) -> dict[str, Any]:
        """An error body in this dialect's shape, for a response sent with ``status``."""
        ...

    def render_stream_error(self, status: int, message: str) -> bytes:
        """An error as SSE frame(s), for when the stream's headers have already gone out."""
        ...
