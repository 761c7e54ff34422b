"""Anthropic ``POST /v1/messages/count_tokens`` (and Gemini's ``:countTokens``, through
:func:`estimate_tokens`), answered locally and never forwarded.

The answer is an **estimate**, not the engine tokenizer's count: the UTF-8 size of the request's
``system``, ``messages`` and ``tools`` serialized as compact JSON, divided by four (rounded up, at least
1). Agents use it to decide when to compact a conversation, for which a rough, cheap and deterministic
figure is enough; spending an engine call (and a journal record) on it would not be.
"""

from __future__ import annotations

from typing import Any

import orjson

from capture_proxy.dialects.base import DialectError

BYTES_PER_TOKEN = 4
COUNTED_FIELDS = ("system", "messages", "tools")


def count_tokens(body: dict[str, Any]) -> dict[str, int]:
    """``{"input_tokens": n}``, an estimate of the prompt size of a Messages request body.

    ``n = ceil(len(orjson.dumps([system, messages, tools])) / 4)`` over the fields present, at least 1.

    Raises:
        DialectError: (400) the body is not an object or has no ``messages`` list.
    """
    if not isinstance(body, dict):
        raise DialectError("request body must be a JSON object")
    if not isinstance(body.get("messages"), list):
        raise DialectError("messages: required, a list", param="messages")
    counted = [body[key] for key in COUNTED_FIELDS if body.get(key) is not None]
    return {"input_tokens": estimate_tokens(counted)}


def estimate_tokens(counted: list[Any]) -> int:
    """``ceil(len(orjson.dumps(counted)) / 4)``, at least 1: the estimate, over the request fields a
    dialect counts."""
    size = len(orjson.dumps(counted))
    return max(1, -(-size // BYTES_PER_TOKEN))
