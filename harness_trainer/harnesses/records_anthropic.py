"""Claude Code's session transcript read as its own record of its model calls (:func:`recorded_calls`).

Claude Code writes every session to ``~/.claude/projects/<project>/<session id>.jsonl`` (the session id is
on the stream's ``system``/``init`` event). Beside the conversation entries (``user`` and ``assistant``,
one per message or, for an assistant message of several blocks, one per block with the same
``message.id``) it logs each Messages request it sends, compactly:

- ``api-request``: one per request, in order: ``base`` (the ``id`` of an earlier request; absent on the
  first), ``keep`` (how many of that request's messages this one starts with) and ``tail`` (the content
  hashes of the messages that follow them);
- ``api-request-blob``: ``{hash, message}``, a message as sent that the conversation entries cannot give
  (the first user message, merged with the reminders Claude Code puts before the task);
- ``api-request-shape``: the system prompt and tools, by hash.

A message's hash is the SHA-256 of ``{"content":[<blocks>],"role":<role>}`` with each block as compact
JSON, keys sorted, non-ASCII as is, ``cache_control`` left out. A hash that is not a blob's names a run of
conversation entries (consecutive entries of one role; for the assistant, of one message id) or the first
blocks of one. So the record rebuilds each request's messages exactly as sent; a hash it cannot resolve
leaves the record unreadable (None), never a guess.

The record holds no system prompt: the shape's system blocks lack the block Claude Code puts first when
it sends them (``x-anthropic-billing-header: cc_version=…; cc_entrypoint=…``), which the proxy forwards
as the start of the system message. The calls are therefore compared without the captured system messages
(:mod:`harness_trainer.rollouts.agreement`), and a system message inside ``messages`` is left out too.

Messages are put in Chat Completions' shape as the proxy's Anthropic dialect does
(``capture_proxy/dialects/anthropic.py``, written again here so that the comparison checks it): a user
turn's ``tool_result`` blocks become one ``tool`` message each, its text blocks one user message after
them (joined with a blank line); an assistant turn's text blocks are joined the same way and each
``tool_use`` is a tool call whose arguments are its input as JSON (``{"_raw": text}`` is ``text``).
Thinking is not part of what the comparison reads and is left out.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from harness_trainer.harnesses.base import json_lines

TEXT_JOIN = "\n\n"
RAW_ARGUMENTS_KEY = "_raw"


def recorded_calls(text: str | None) -> list[list[dict[str, Any]]] | None:
    """The messages Claude Code sent in each model call, from its session transcript (module docstring),
    in Chat Completions' shape; None without a readable transcript or one that logs no request."""
    known: dict[str, dict[str, Any]] = {}
    sent: dict[str, list[dict[str, Any]]] = {}
    calls: list[list[dict[str, Any]]] = []
    run: dict[str, Any] | None = None
    for entry in json_lines(text or ""):
        kind = entry.get("type")
        if kind == "api-request-blob" and isinstance(entry.get("message"), dict):
            known[str(entry.get("hash"))] = entry["message"]
        elif kind in ("user", "assistant"):
            run = _extend_run(run, entry.get("message"))
            if run is not None:
                message = {"role": run["role"], "content": list(run["blocks"])}
                known[message_hash(message)] = message
        elif kind == "api-request":
            messages = _request_messages(entry, sent, known)
            if messages is None:
                return None
            sent[str(entry.get("id"))] = messages
            calls.append(chat_messages(messages))
    return calls or None


def message_hash(message: dict[str, Any]) -> str:
    """The content hash Claude Code logs for a Messages message (module docstring)."""
    blocks = [
        json.dumps(
            {k: v for k, v in block.items() if k != "cache_control"},
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=False,
        )
        for block in _blocks(message.get("content"))
    ]
    canonical = '{"content":[' + ",".join(blocks) + '],"role":' + json.dumps(message.get("role")) + "}"
    return hashlib.sha256(canonical.encode("utf-8", errors="surrogatepass")).hexdigest()


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages API messages as the Chat Completions messages the proxy forwards (module docstring)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        blocks = _blocks(message.get("content"))
        if message.get("role") == "user":
            out.extend(_user_turn(blocks))
        elif message.get("role") == "assistant":
            out.append(_assistant_turn(blocks))
    return out


def _extend_run(run: dict[str, Any] | None, message: Any) -> dict[str, Any] | None:
    """The run of conversation entries ``message`` belongs to: the current one when it has the same role
    (and, for the assistant, the same message id), else a new one; None after an entry with no message."""
    if not isinstance(message, dict) or message.get("content") is None:
        return None
    role, message_id = message.get("role"), message.get("id")
    blocks = _blocks(message["content"])
    same_message = role == "user" or (message_id is not None and run is not None and run["id"] == message_id)
    if run is not None and run["role"] == role and same_message:
        return {**run, "blocks": [*run["blocks"], *blocks]}
    return {"role": role, "id": message_id, "blocks": blocks}


def _request_messages(
    entry: dict[str, Any], sent: dict[str, list[dict[str, Any]]], known: dict[str, dict[str, Any]]
) -> list[dict[str, Any]] | None:
    base_id, keep, tail = entry.get("base"), entry.get("keep", 0), entry.get("tail")
    base = sent.get(str(base_id)) if base_id is not None else []
    if base is None or not isinstance(keep, int) or not 0 <= keep <= len(base) or not isinstance(tail, list):
        return None
    added = [known.get(str(h)) for h in tail]
    if any(message is None for message in added):
        return None
    return [*base[:keep], *(m for m in added if m is not None)]


def _blocks(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    items = content if isinstance(content, list) else [content]
    return [block for block in items if isinstance(block, dict)]


def _user_turn(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    results = [
        {"role": "tool", "tool_call_id": b.get("tool_use_id"), "content": _text(b.get("content"))}
        for b in blocks
        if b.get("type") == "tool_result"
    ]
    texts = [str(b.get("text", "")) for b in blocks if b.get("type") == "text"]
    if texts or not results:
        results.append({"role": "user", "content": TEXT_JOIN.join(texts)})
    return results


def _assistant_turn(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    texts = [str(b.get("text", "")) for b in blocks if b.get("type") == "text"]
    calls = [
        {"id": b.get("id"), "type": "function",
         "function": {"name": b.get("name"), "arguments": _arguments(b.get("input"))}}
        for b in blocks
        if b.get("type") == "tool_use"
    ]  # fmt: skip
    message: dict[str, Any] = {"role": "assistant", "content": TEXT_JOIN.join(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    return message


def _text(content: Any) -> str:
    """A ``tool_result``'s content: a string, or its text blocks joined."""
    if content is None:
        return ""
    return TEXT_JOIN.join(str(b.get("text", "")) for b in _blocks(content) if b.get("type") == "text")


def _arguments(tool_input: Any) -> str:
    raw = tool_input.get(RAW_ARGUMENTS_KEY) if isinstance(tool_input, dict) else None
    if isinstance(raw, str) and len(tool_input) == 1:
        return raw
    return json.dumps(tool_input if tool_input is not None else {}, ensure_ascii=False)
