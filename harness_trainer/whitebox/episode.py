"""A white-box episode's turns as a TrainingTrace, with the counters the trainer logs. Pure, no I/O.

The rules, in order:

1. **One turn per engine call**, in call order; ``node_id`` is ``turn-<index>``. The prompt and completion
   ids are the ones the engine saw and sampled (never re-derived), the logprobs its processed ones, the
   loss mask 0 over the prompt and 1 over the completion.
2. **Extension.** A turn *extends* the previous turn when its prompt ids start with that turn's prompt +
   completion ids exactly. Then its ``metadata["parent"]`` is the previous node and its root is the
   previous turn's root. Otherwise the chat template re-rendered history differently from what was
   sampled (a known hazard: stripped reasoning, re-serialised tool-call arguments), so the turn starts a
   **new root** (``parent`` None, ``root`` itself, ``retemplated`` True) and ``whitebox/retemplated_turns``
   counts it. Nothing is trained on ids the engine never saw: every turn's ids are its own call's, and the
   row builder (:mod:`harness_trainer.trainer.step.rows`) finds the same forest from the ids alone.
3. **Metadata** per turn: ``seq``, ``parent``, ``root``, ``depth``, ``retemplated``, ``weight_version``,
   ``sampling`` (the trainer's temperature is checked against it), ``agent_params``, ``finish_reason``,
   ``parse_error``, ``tool_calls``, and when recorded ``model`` (the served model the call named) and
   ``started_at`` / ``finished_at`` (unix seconds of the engine call: the rollout's model time). The last
   turn of an episode that ran out of context budget carries ``context_exhausted`` True; its turns stay
   trainable.
4. The trace is validated (:func:`harness_trainer.trace.load_trace`); a broken rule raises
   ``CaptureContractError``. An episode with no turn at all (the first prompt is over budget) has no trace.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from harness_trainer.trace import TrainingTrace, load_trace

if TYPE_CHECKING:
    from harness_trainer.whitebox.model_step import TurnRecord


class EmptyEpisode(ValueError):
    """No turn was sampled (the first prompt did not fit the context budget): nothing to train on."""


@dataclass
class WhiteBoxTrace:
    """An episode's validated trace and its counters."""

    trace: TrainingTrace
    metrics: dict[str, float] = field(default_factory=dict)
    """``whitebox/turns``, ``whitebox/roots``, ``whitebox/retemplated_turns``, ``whitebox/tool_calls``,
    ``whitebox/parse_errors`` (failed tool calls) and ``whitebox/context_exhausted`` (0 or 1)."""
    context_exhausted: bool = False


def extends(
    prompt_ids: Sequence[int], previous_prompt: Sequence[int], previous_completion: Sequence[int]
) -> bool:
    """Whether ``prompt_ids`` starts with the previous turn's prompt + completion ids exactly."""
    n, m = len(previous_prompt), len(previous_completion)
    return (
        len(prompt_ids) >= n + m
        and list(prompt_ids[:n]) == list(previous_prompt)
        and list(prompt_ids[n : n + m]) == list(previous_completion)
    )


def build_trace(records: Sequence[TurnRecord], *, context_exhausted: bool = False) -> WhiteBoxTrace:
    """The episode's trace (rules in the module docstring).

    Raises:
        EmptyEpisode: no turn was sampled.
        CaptureContractError: a turn breaks a rule of the trace format.
    """
    if not records:
        raise EmptyEpisode("the episode sampled no turn: its first prompt did not fit the context budget")
    turns: list[dict[str, Any]] = []
    retemplated = roots = 0
    for index, record in enumerate(records):
        node_id = f"turn-{index}"
        previous = records[index - 1] if index else None
        linked = previous is not None and extends(
            record.prompt_ids, previous.prompt_ids, previous.completion_ids
        )
        if linked:
            parent, root, depth = (
                turns[-1]["node_id"],
                turns[-1]["metadata"]["root"],
                turns[-1]["metadata"]["depth"] + 1,
            )
        else:
            parent, root, depth = None, node_id, 0
            roots += 1
            retemplated += previous is not None
        metadata: dict[str, Any] = {
            "seq": index,
            "parent": parent,
            "root": root,
            "depth": depth,
            "retemplated": previous is not None and not linked,
            "weight_version": record.weight_version,
            "sampling": dict(record.sampling),
            "agent_params": dict(record.agent_params),
            "finish_reason": record.finish_reason,
            "parse_error": record.parse_error,
            "tool_calls": [dict(call) for call in record.tool_calls],
        }
        if record.model:
            metadata["model"] = record.model
        if record.started_at is not None and record.finished_at is not None:
            metadata.update(started_at=record.started_at, finished_at=record.finished_at)
        turns.append(
            {
                "node_id": node_id,
                "prompt_token_ids": list(record.prompt_ids),
                "completion_token_ids": list(record.completion_ids),
                "per_token_logps": list(record.logprobs),
                "loss_mask": [0] * len(record.prompt_ids) + [1] * len(record.completion_ids),
                "response": {"text": record.text, "finish_reason": record.finish_reason},
                "metadata": metadata,
            }
        )
    if context_exhausted:
        turns[-1]["metadata"]["context_exhausted"] = True
    metrics = {
        "whitebox/turns": float(len(records)),
        "whitebox/roots": float(roots),
        "whitebox/retemplated_turns": float(retemplated),
        "whitebox/tool_calls": float(sum(len(r.tool_calls) for r in records if r.parse_error is None)),
        "whitebox/parse_errors": float(sum(r.parse_error is not None for r in records)),
        "whitebox/context_exhausted": float(context_exhausted),
    }
    trace = load_trace({"schema_version": 1, "turns": turns})
    return WhiteBoxTrace(trace=trace, metrics=metrics, context_exhausted=context_exhausted)
