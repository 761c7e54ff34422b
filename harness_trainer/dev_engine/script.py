"""Scripted mode: replies come from a file of assistant messages instead of from sampling.

The file is JSON Lines (one assistant message per line) or a JSON list of messages, each
``{"content": "...", "tool_calls": [{"function": {"name": ..., "arguments": {...} | "<json>"}}]}``.
Replies are served in order, one per chat request. Each is rendered by the model's own chat template,
exactly as the model would have written it (everything the template adds after the generation prompt, up
to and including the end-of-turn token), tokenized with the model's tokenizer, and scored by the model on
exactly those ids, so a real agent can solve a real task deterministically while the engine still returns
real ids and real processed logprobs.

A ``/v1/completions`` request (a white-box model step's: a token-id prompt, no messages) takes the next
reply too (:func:`reply_ids`): rendered after a one-message stand-in conversation, since an assistant turn's
ids do not depend on the turns before it in the chat templates the dev engine serves (the test checks it
for the tiny model against the real conversation's).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from harness_trainer.dev_engine.chat import render_prompt_text


class ScriptError(ValueError):
    """A script file that cannot be used, or a script that has run out of replies."""


class ScriptedReplies:
    """The replies of a script file, handed out in order (thread-safe)."""

    def __init__(self, replies: list[dict[str, Any]], source: str = "<script>") -> None:
        for index, reply in enumerate(replies):
            if not isinstance(reply, dict) or not (reply.get("content") or reply.get("tool_calls")):
                raise ScriptError(f"{source}: reply {index} needs 'content' or 'tool_calls'")
        self.replies = [{**reply, "role": "assistant"} for reply in replies]
        self.source = source
        self._next = 0
        self._lock = threading.Lock()

    @classmethod
    def from_file(cls, path: str | Path) -> ScriptedReplies:
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise ScriptError(f"cannot read script {path}: {exc}") from exc
        try:
            if text.lstrip().startswith("["):
                replies = json.loads(text)
            else:
                replies = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise ScriptError(f"script {path} is not JSON or JSON Lines: {exc}") from exc
        if not replies:
            raise ScriptError(f"script {path} holds no replies")
        return cls(replies, source=str(path))

    @property
    def served(self) -> int:
        return self._next

    def take(self) -> dict[str, Any]:
        """The next reply; raises ScriptError once every reply has been served."""
        with self._lock:
            if self._next >= len(self.replies):
                raise ScriptError(
                    f"script exhausted: all {len(self.replies)} replies of {self.source} were served"
                )
            reply = self.replies[self._next]
            self._next += 1
            return reply


def completion_ids(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, reply: dict[str, Any]
) -> list[int]:
    """Token ids the model would sample to write ``reply`` after ``messages``, end-of-turn included."""
    prompt = render_prompt_text(tokenizer, messages, tools, add_generation_prompt=True)
    full = render_prompt_text(tokenizer, [*messages, reply], tools, add_generation_prompt=False)
    if not full.startswith(prompt):
        raise ScriptError("the chat template does not render the reply as a continuation of the prompt")
    text = full[len(prompt) :]
    end = text.rfind(tokenizer.eos_token)
    if end != -1:
        text = text[: end + len(tokenizer.eos_token)]
    return tokenizer(text, add_special_tokens=False)["input_ids"]


STAND_IN = [{"role": "user", "content": "."}]
"""The conversation a completion request's scripted reply is rendered after (see the module docstring)."""


def reply_ids(tokenizer: Any, reply: dict[str, Any]) -> list[int]:
    """Token ids the model would sample to write ``reply`` as an assistant turn, end-of-turn included, for a
    request that carries no messages (``/v1/completions``)."""
    return completion_ids(tokenizer, STAND_IN, None, reply)
