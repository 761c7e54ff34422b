"""Codex's rollout file read as its own record of its model calls (:func:`recorded_calls`).

Codex writes each session (a thread, whose id is on the ``thread.started`` event of ``codex exec
--json``) to ``$CODEX_HOME/sessions/YYYY/MM/DD/rollout-<time>-<thread id>.jsonl``: one JSON line per
record, ``{"type", "payload"}``. Its ``response_item`` records are the conversation as Codex keeps it and
sends it as a Responses request's ``input``, in order: the messages it puts before the task (developer
instructions, the environment context), the user's task, and each response's output items (``reasoning``,
an assistant ``message``, ``function_call``) followed by the ``function_call_output`` of each call. After
each completed response Codex writes a ``token_usage_record`` (its ``response_id`` and usage). So a model
call sent every response item recorded before the first output item of its response (or, for a response
with no output item, before its ``token_usage_record``).

The record holds no system prompt: the request's ``instructions`` are not logged as sent (``session_meta``
holds ``base_instructions``, which still has the sections on the ``update_plan`` tool that the sent
instructions leave out, the tool not being offered here). The calls are therefore compared without the
captured system messages (:mod:`harness_trainer.rollouts.agreement`), and the developer messages, which
the proxy forwards as system messages, are left out too. A ``compacted`` record (Codex's own context
compaction) is not read: the calls after it would not match.

Items are put in Chat Completions' shape as the proxy's Responses dialect does
(``capture_proxy/dialects/responses.py``, written again here so that the comparison checks it): a
message's ``input_text``/``output_text`` blocks joined with a blank line; a ``function_call`` joins the
tool calls of the assistant message right before it, or starts one with no text; a
``function_call_output`` is a ``tool`` message. Reasoning is not part of what the comparison reads and is
left out.
"""

from __future__ import annotations

import copy
from typing import Any

from harness_trainer.harnesses.base import json_lines

TEXT_JOIN = "\n\n"
TEXT_BLOCKS = ("input_text", "output_text")
SYSTEM_ROLES = ("system", "developer")
OUTPUT_ITEMS = ("reasoning", "function_call")
"""Output item types besides an assistant ``message``: what a response adds to the conversation."""


def recorded_calls(text: str | None) -> list[list[dict[str, Any]]] | None:
    """The messages Codex sent in each model call, from its rollout file (module docstring), in Chat
    Completions' shape; None without a readable rollout."""
    records = [r for r in json_lines(text or "") if isinstance(r.get("payload"), dict)]
    if not any(r.get("type") == "session_meta" for r in records):
        return None
    history: list[dict[str, Any]] = []
    calls: list[list[dict[str, Any]]] = []
    answering = False  # the current response's call is recorded: its outputs are coming in
    for record in records:
        kind, payload = record.get("type"), record["payload"]
        if kind == "response_item":
            if _is_output(payload) and not answering:
                calls.append(copy.deepcopy(history))
                answering = True
            _append(history, payload)
        elif kind == "token_usage_record":
            if not answering:  # a response with no output item was still a call
                calls.append(copy.deepcopy(history))
            answering = False
    return calls


def _is_output(item: dict[str, Any]) -> bool:
    kind = item.get("type")
    return kind in OUTPUT_ITEMS or (kind == "message" and item.get("role") == "assistant")


def _append(history: list[dict[str, Any]], item: dict[str, Any]) -> None:
    """``item`` added to ``history`` as the proxy's Responses dialect reads it (module docstring)."""
    kind = item.get("type")
    if kind == "message" and item.get("role") not in SYSTEM_ROLES:
        history.append({"role": item.get("role"), "content": _text(item.get("content"))})
    elif kind == "function_call":
        function = {"name": item.get("name"), "arguments": item.get("arguments")}
        call = {"id": item.get("call_id"), "type": "function", "function": function}
        if history and history[-1]["role"] == "assistant":
            history[-1].setdefault("tool_calls", []).append(call)
        else:
            history.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = _text(item.get("output"))
        history.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})


def _text(content: Any) -> str:
    """A string, or the text of ``input_text``/``output_text`` blocks joined."""
    if isinstance(content, str):
        return content
    blocks = content if isinstance(content, list) else []
    return TEXT_JOIN.join(
        str(b.get("text", "")) for b in blocks if isinstance(b, dict) and b.get("type") in TEXT_BLOCKS
    )
