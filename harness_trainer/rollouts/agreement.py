"""The agent's own record of its model calls against the capture: did the proxy see what the agent sent?

An agent that writes a trajectory of its own (mini-swe-agent's ``*.traj.json``) says, for each model call,
which messages it sent. The capture proxy recorded, for each call that reached the engine, the request
it received (each trace turn's ``request``). :func:`agreement` compares the two after a rollout:

- **Calls.** The agent's calls and the captured turns are paired in order; their numbers must be equal.
- **Messages.** Each pair's messages must be equal as :func:`message_key` reads them: the role, the text
  (a string, or the ``text`` of content parts, joined), each tool call's name and arguments (as JSON
  values: the same object spelled with other spaces is the same call), and a tool result's call id.
  What a client library adds or drops on the way (``None`` fields, a provider's extra keys, cache
  hints) is not part of a message's meaning and is not compared.
- **System prompt.** An agent whose record leaves its system prompt out (pi's holds no system message)
  is compared without the captured system messages: only what the record can say is checked.
- **Verdict.** ``match``; ``mismatch`` with the first difference in words (the call, the message, what
  each side had); or ``not_available`` when the agent wrote no record (an agent that keeps none, or a
  run that died before writing it). A mismatch changes no training data: it is reported (the rollout's
  record, the step's ``agreement/…`` metrics, the viewer).

Pure: the harness reads its agent's file (:mod:`harness_trainer.harnesses`), the rollout server calls
this with the trace's requests.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel

MATCH, MISMATCH, NOT_AVAILABLE = "match", "mismatch", "not_available"
_SHOWN = 80  # characters of a differing value quoted in the verdict
_FIELDS = ("role", "content", "tool calls", "tool call id")  # message_key's parts, in words


class Agreement(BaseModel):
    """The verdict on one rollout (module docstring)."""

    status: Literal["match", "mismatch", "not_available"]
    agent_calls: int | None = None
    captured_calls: int = 0
    first_difference: str | None = None


def agreement(
    agent_calls: Sequence[Sequence[Mapping[str, Any]]] | None, captured: Sequence[Any]
) -> Agreement:
    """The agent's calls (each the messages it sent; None: it kept no record) against the captured
    requests (each a Chat Completions request body, or None where a turn has none)."""
    captured_messages = [_messages(request) for request in captured]
    if agent_calls is None:
        return Agreement(status=NOT_AVAILABLE, captured_calls=len(captured))
    verdict = Agreement(status=MATCH, agent_calls=len(agent_calls), captured_calls=len(captured))
    if not any(m.get("role") == "system" for call in agent_calls for m in call):
        captured_messages = [[m for m in seen if m.get("role") != "system"] for seen in captured_messages]
    for number, (sent, seen) in enumerate(zip(agent_calls, captured_messages, strict=False), start=1):
        difference = _first_difference(list(sent), seen)
        if difference is not None:
            return verdict.model_copy(
                update={"status": MISMATCH, "first_difference": f"call {number}: {difference}"}
            )
    if len(agent_calls) != len(captured):
        return verdict.model_copy(
            update={
                "status": MISMATCH,
                "first_difference": f"the agent recorded {len(agent_calls)} model calls, the capture "
                f"{len(captured)}",
            }
        )
    return verdict


def message_key(message: Mapping[str, Any]) -> tuple[Any, ...]:
    """What a message means, for the comparison (module docstring)."""
    calls = tuple(
        (_get(call, "function", "name"), _json_value(_get(call, "function", "arguments")))
        for call in message.get("tool_calls") or ()
    )
    return (message.get("role"), _text(message.get("content")), calls, message.get("tool_call_id"))


def _first_difference(sent: list[Mapping[str, Any]], seen: list[Mapping[str, Any]]) -> str | None:
    for index, (mine, theirs) in enumerate(zip(sent, seen, strict=False)):
        a, b = message_key(mine), message_key(theirs)
        if a != b:
            at = next(i for i in range(len(a)) if a[i] != b[i])
            return (
                f"message {index} ({mine.get('role')}) differs in its {_FIELDS[at]}: the agent sent "
                f"{_shown(a[at])}, the proxy saw {_shown(b[at])}"
            )
    if len(sent) != len(seen):
        return f"the agent sent {len(sent)} messages, the proxy saw {len(seen)}"
    return None


def _messages(request: Any) -> list[Mapping[str, Any]]:
    messages = request.get("messages") if isinstance(request, Mapping) else None
    return [m for m in messages if isinstance(m, Mapping)] if isinstance(messages, list) else []


def _text(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content or None  # an empty string and no content mean the same to a model
    if isinstance(content, list):
        parts = [
            p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type", "text") == "text"
        ]
        return "".join(parts) or None
    return str(content)


def _get(obj: Any, *path: str) -> Any:
    for key in path:
        obj = obj.get(key) if isinstance(obj, Mapping) else None
    return obj


def _json_value(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.dumps(json.loads(arguments), sort_keys=True)
        except ValueError:
            return arguments
    return json.dumps(arguments, sort_keys=True)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 1] + "…"
