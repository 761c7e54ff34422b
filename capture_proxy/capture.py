"""Take the engine's ids and logprobs out of a reply, check them, and normalise the rest.

From a vLLM Chat Completions reply: ``prompt_token_ids`` (top level), ``choices[0].token_ids`` and
``choices[0].logprobs.content[i]`` (``token = "token_id:N"``, ``logprob``). The pairing is checked: equal
lengths, each entry's token id equal to the sampled id at its position, every logprob finite and ≤ 0.
A reply that fails is still returned to the agent, but the call is context only, with a finding. A reply
without ids at all is recorded with the finding ``no_token_ids`` (the session cannot be trained on).
The checks run in C-level passes (``map``, slicing), not per-token Python loops. The prompt ids stay the
engine's JSON text here; the journal validates them as it writes only their new suffix.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson

from capture_proxy.dialects.base import Reply, ToolCall
from capture_proxy.records import Finding
from capture_proxy.reply import LogprobEntry


class MalformedReply(Exception):
    """The engine answered 200 with a body that is not a chat completion."""


@dataclass
class Capture:
    prompt_text: (
        bytes | None
    )  # the prompt ids as compact JSON text without brackets (validated on journaling)
    completion_token_ids: list[int] | None
    logprobs: list[float] | None
    weight_version: int | None
    finding: Finding | None


def capture(
    reply: dict[str, Any], prompt_text: bytes | None = None, entries: list[LogprobEntry] | None = None
) -> Capture:
    """The ids and logprobs of ``reply``, with a finding when they cannot be trusted.

    ``prompt_text`` and ``entries`` are the reply's ``prompt_token_ids`` and ``choices[0].logprobs.content``
    as :func:`capture_proxy.reply.read_reply` cut them out of the raw body; without them they are read
    from ``reply``.
    """
    choice = _first_choice(reply)
    completion_ids = choice.get("token_ids")
    version = reply.get("weight_version")
    version = version if isinstance(version, int) and not isinstance(version, bool) else None
    if prompt_text is None and isinstance(reply.get("prompt_token_ids"), list):
        prompt_text = orjson.dumps(reply["prompt_token_ids"])[1:-1]
    if prompt_text is None or not isinstance(completion_ids, list):
        detail = (
            "the engine returned no token ids (prompt_token_ids / choices[0].token_ids); serve vLLM with "
            "--return-tokens-as-token-ids and a version that supports return_token_ids"
        )
        return Capture(None, None, None, version, Finding("no_token_ids", detail))
    if _packed(completion_ids) is None:
        detail = "sampled ids must be non-negative integers"
        return Capture(None, None, None, version, Finding("bad_token_ids", detail))
    try:
        if entries is None:
            entries = _entries(choice)
        logprobs, finding = _check(completion_ids, entries)
    except (msgspec.ValidationError, ValueError) as exc:
        logprobs, finding = None, Finding("malformed_logprobs", f"logprobs could not be read: {exc}")
    if logprobs is None:
        # Context only: the completion is kept for the prompt tree, with zero logprobs it never trains on.
        logprobs = [0.0] * len(completion_ids)
    return Capture(prompt_text, completion_ids, logprobs, version, finding)


def _entries(choice: dict[str, Any]) -> list[LogprobEntry] | None:
    """``choice``'s logprob entries, from a reply parsed whole (raises ``msgspec.ValidationError``)."""
    content = (choice.get("logprobs") or {}).get("content")
    return msgspec.convert(content, list[LogprobEntry]) if isinstance(content, list) else None


def _check(
    completion_ids: list[int], entries: list[LogprobEntry] | None
) -> tuple[list[float] | None, Finding | None]:
    if entries is None:
        return None, Finding("no_logprobs", "the engine returned no logprobs.content for the sampled ids")
    if len(entries) != len(completion_ids):
        detail = f"{len(entries)} logprob entries for {len(completion_ids)} sampled ids"
        return None, Finding("logprob_count_mismatch", detail)
    # One joined comparison instead of a per-token loop; the ids' text comes from orjson in one C call.
    tokens = ",".join([entry.token for entry in entries])
    expected = "token_id:" + orjson.dumps(completion_ids)[1:-1].decode().replace(",", ",token_id:")
    if completion_ids and tokens != expected:
        detail = "logprobs.content[].token does not name the sampled ids (expected 'token_id:N' pairs)"
        return None, Finding("token_mismatch", detail)
    logprobs = [entry.logprob for entry in entries]
    # A sum is finite only if every term is (a NaN or an infinity anywhere makes it NaN or infinite).
    if not math.isfinite(sum(logprobs)) or (logprobs and max(logprobs) > 0):
        return None, Finding("bad_logprobs", "logprobs must be finite and <= 0")
    return logprobs, None


def _packed(ids: Any) -> array | None:
    """``ids`` as uint32, or None if any is not a non-negative integer (one C-level pass)."""
    try:
        return array("I", ids)
    except (TypeError, OverflowError):
        return None


def _first_choice(reply: dict[str, Any]) -> dict[str, Any]:
    choices = reply.get("choices") if isinstance(reply, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise MalformedReply("the engine's reply has no choices[0]")
    return choices[0]


def normalise(reply: dict[str, Any]) -> Reply:
    """The parts of a chat completion that dialects render."""
    choice = _first_choice(reply)
    message = choice.get("message") or {}
    calls = [
        ToolCall(
            id=str(call.get("id") or f"call_{index}"),
            name=str((call.get("function") or {}).get("name", "")),
            arguments=str((call.get("function") or {}).get("arguments") or "{}"),
        )
        for index, call in enumerate(message.get("tool_calls") or [])
    ]
    usage = reply.get("usage") or {}
    stop_reason = choice.get("stop_reason")
    return Reply(
        id=str(reply.get("id") or "chatcmpl-capture"),
        created=int(reply.get("created") or 0),
        model=str(reply.get("model") or ""),
        content=message.get("content"),
        tool_calls=calls,
        finish_reason=str(choice.get("finish_reason") or "stop"),
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        reasoning=message.get("reasoning_content") or message.get("reasoning"),
        stop_sequence=stop_reason if isinstance(stop_reason, str) else None,
    )
