"""What a ``rollout_reward_fn`` sees of a finished rollout, and the checked call to it. Pure, no torch.

:class:`HarnessRolloutOutcome` has TRL's fields, names and order
(``trl.experimental.async_grpo.openenv_harness.HarnessRolloutOutcome``), so a reward function written for
TRL's harness worker runs here unchanged. :func:`build_outcome` fills it the way TRL's loop-owning path
does, except that tool counts reported by our own sessions (taken from the agent's own log, in
``verify.metrics``) win over TRL's estimate from the captured requests.

:func:`apply_reward_fn` turns whatever the function does into a reward or a :class:`RewardFunctionError`:
None means "do not score" (left out of the group baseline, never a zero); a bool, a non-number, NaN or
infinity, or an exception raised inside the function is an error naming the function. The trainer counts
such a rollout unscorable.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from harness_trainer.trace import TrainingTrace

_FAILURE_WORDS = ("error", "failed", "traceback", "exception")
_DEDUP_CHARS = 200  # a tool result repeated in later requests is one failure, as in TRL


@dataclass
class HarnessRolloutOutcome:
    """A finished rollout as ``rollout_reward_fn`` sees it; fields exactly as TRL's, in TRL's order."""

    env_reward: float | None
    """The task verifier's reward; None = ungraded."""
    completion: list[dict[str, Any]]
    """The final transcript: the last captured request's messages, then the last reply."""
    trace: list[dict[str, Any]]
    """The agent turns, as ``TrainingTrace.to_trace_entries()`` gives them."""
    tool_call_count: int
    tool_failure_count: int
    tool_calls_by_name: dict[str, int]
    """E.g. ``{"bash": 3, "edit": 2}``."""
    timed_out: bool


class RewardFunctionError(RuntimeError):
    """``rollout_reward_fn`` raised, or returned something that is not a finite number or None."""

    def __init__(self, message: str, *, function_name: str) -> None:
        super().__init__(message)
        self.function_name = function_name


def build_outcome(trace: TrainingTrace, verify: Any, *, timed_out: bool) -> HarnessRolloutOutcome:
    """The outcome of a rollout from its trace and its verify result.

    ``verify`` is any object with ``env_reward`` (float | None) and optionally ``metrics`` (a dict), like
    :class:`~harness_trainer.rollouts.client.session.VerifyResult` or OpenEnv's.
    ``metrics["tool_calls_by_name"]`` and ``metrics["tool_failure_count"]`` are used when present, else
    derived from the trace entries; ``timed_out`` is the argument or ``metrics["timed_out"]``.
    """
    metrics: dict[str, Any] = getattr(verify, "metrics", None) or {}
    entries = trace.to_trace_entries()
    if "tool_calls_by_name" in metrics:
        calls_by_name = {str(name): int(count) for name, count in metrics["tool_calls_by_name"].items()}
    else:
        calls_by_name = _tool_calls_by_name(entries)
    if "tool_failure_count" in metrics:
        failure_count = int(metrics["tool_failure_count"])
    else:
        failure_count = _tool_failure_count(entries)
    env_reward = verify.env_reward
    return HarnessRolloutOutcome(
        env_reward=float(env_reward) if env_reward is not None else None,
        completion=completion_messages(entries),
        trace=entries,
        tool_call_count=sum(calls_by_name.values()),
        tool_failure_count=failure_count,
        tool_calls_by_name=calls_by_name,
        timed_out=bool(timed_out or metrics.get("timed_out")),
    )


def apply_reward_fn(
    outcome: HarnessRolloutOutcome, fn: Callable[[HarnessRolloutOutcome], float | None] | None
) -> float | None:
    """The rollout's reward: ``fn(outcome)``, or ``outcome.env_reward`` without a function.

    Raises:
        RewardFunctionError: ``fn`` raised (chained), or returned a bool, a non-number, NaN or infinity.
    """
    if fn is None:
        return outcome.env_reward
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        value = fn(outcome)
    # User code: whatever it raises is that rollout's failure, reported once with its cause, never a crash.
    except Exception as exc:
        raise RewardFunctionError(
            f"rollout_reward_fn {name} raised {type(exc).__name__}: {exc}", function_name=name
        ) from exc
    if value is None:
        return None
    # A bool is a Real to Python, but True as a reward is almost always a forgotten float(); say so.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RewardFunctionError(
            f"rollout_reward_fn {name} returned {value!r} ({type(value).__name__}); "
            "it must return a float, or None to leave the rollout unscored",
            function_name=name,
        )
    reward = float(value)
    if not math.isfinite(reward):
        raise RewardFunctionError(
            f"rollout_reward_fn {name} returned {value!r}, which is not finite", function_name=name
        )
    return reward


def _reply_message(entry: dict[str, Any]) -> dict[str, Any]:
    choices = (entry.get("response") or {}).get("choices") or []
    return (choices[0].get("message") or {}) if choices else {}


def _tool_calls_by_name(entries: list[dict[str, Any]]) -> dict[str, int]:
    """Tool calls the captured replies asked for, by function name."""
    counts: dict[str, int] = {}
    for entry in entries:
        for call in _reply_message(entry).get("tool_calls") or []:
            name = (call.get("function") or call).get("name")
            if name:
                counts[name] = counts.get(name, 0) + 1
    return counts


def _tool_failure_count(entries: list[dict[str, Any]]) -> int:
    """TRL's estimate: tool results in the last request whose text reads like a failure, each counted once."""
    messages = ((entries[-1].get("request") or {}).get("messages") or []) if entries else []
    # A tool result names its call id; the assistant message that made the call has the tool's name.
    names = {
        call.get("id"): (call.get("function") or call).get("name")
        for message in messages
        for call in message.get("tool_calls") or []
    }
    seen: set[tuple[Any, str]] = set()
    failures = 0
    for message in messages:
        if message.get("role") != "tool":
            continue
        text = _text(message.get("content"))
        key = (message.get("name") or names.get(message.get("tool_call_id")), text[:_DEDUP_CHARS])
        if key in seen:
            continue
        seen.add(key)
        lowered = text.lower()
        if any(word in lowered for word in _FAILURE_WORDS):
            failures += 1
    return failures


def _text(content: Any) -> str:
    """A message's text: the string itself, or the text parts of a content-part list joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) if isinstance(part, dict) else str(part) for part in content)
    return "" if content is None else str(content)


def completion_messages(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The last request's messages followed by its reply, as TRL's ``_messages_from_trace``."""
    if not entries:
        return []
    last = entries[-1]
    content = _reply_message(last).get("content") or ""
    return [*((last.get("request") or {}).get("messages") or []), {"role": "assistant", "content": content}]
