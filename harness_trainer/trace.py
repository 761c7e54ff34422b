"""TrainingTrace: the validated token capture a session hands to the trainer.

Wire-compatible with OpenEnv's ``openenv.core.harness.TrainingTrace``: JSON dumped by either loads in the
other. ``{"schema_version": 1, "turns": [TrainingTurn, ...]}``, where a turn is one engine call: the
engine's own prompt ids, the sampled ids, their behaviour logprobs, a loss mask over prompt plus
completion, and free-form ``request`` / ``response`` / ``metadata`` dicts. The reward never travels here.

Rules, checked on construction; each breaks as a pydantic error whose ``type`` is the rule code:

    invalid_token_id    prompt and completion ids are non-negative ints (a bool is not an id)
    invalid_logprob     every logprob is a finite number (a bool is not a number here)
    positive_logprob    every logprob is <= 0
    logprob_misalign    exactly one logprob per completion id
    no_prompt_ids       the prompt is not empty
    length_mismatch     len(loss_mask) == len(prompt_token_ids) + len(completion_token_ids)
    invalid_loss_mask   mask values are the ints 0 or 1
    trainable_prompt    every prompt position of the mask is 0
    duplicate_node_id   node ids are unique across the trace

plus pydantic's own codes: ``extra_forbidden`` (unknown field), ``literal_error`` (wrong
``schema_version``), ``string_too_short`` (empty node id), ``missing``, ``list_type``, ``float_type``...
Legal, as in OpenEnv: partial and all-zero completion masks (a zero-masked turn stays for context and
usage accounting), a prompt-only turn (empty completion, no logprobs), integer logprobs (kept as floats).

A broken rule is a capture bug, not a bad rollout: ``load_trace`` raises ``CaptureContractError``,
and that stops training.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import ErrorDetails, PydanticCustomError

if TYPE_CHECKING:
    import openenv.core.harness

_MAX_LISTED = 10  # problems spelled out in a CaptureContractError message; the rest are counted


def _token_id(value: object) -> object:
    if type(value) is not int or value < 0:
        raise PydanticCustomError("invalid_token_id", "token ids must be non-negative ints")
    return value


def _logprob(value: object) -> object:
    finite = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
    if isinstance(value, bool) or not finite:
        raise PydanticCustomError("invalid_logprob", "logprobs must be finite numbers")
    if value > 0:
        raise PydanticCustomError("positive_logprob", "logprobs must be <= 0")
    return value


def _mask_bit(value: object) -> object:
    if type(value) is not int or value not in (0, 1):
        raise PydanticCustomError("invalid_loss_mask", "loss_mask values must be the ints 0 or 1")
    return value


TokenId = Annotated[int, BeforeValidator(_token_id)]
Logprob = Annotated[float, BeforeValidator(_logprob)]
MaskBit = Annotated[int, BeforeValidator(_mask_bit)]


class TrainingTurn(BaseModel):
    """One engine call; ``loss_mask`` covers prompt plus completion (rules in the module docstring)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    node_id: str = Field(min_length=1)
    prompt_token_ids: list[TokenId]
    completion_token_ids: list[TokenId]
    per_token_logps: list[Logprob]
    loss_mask: list[MaskBit]
    request: dict[str, Any] = Field(default_factory=dict)
    response: dict[str, Any] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)

    # Cross-field checks read earlier fields from info.data; a field that failed its own
    # validation is absent there, and its error is already reported.
    @field_validator("prompt_token_ids")
    @classmethod
    def _prompt_is_not_empty(cls, ids: list[int]) -> list[int]:
        if not ids:
            raise PydanticCustomError("no_prompt_ids", "no prompt ids: the engine did not return them")
        return ids

    @field_validator("per_token_logps")
    @classmethod
    def _one_logprob_per_completion_id(cls, logps: list[float], info: ValidationInfo) -> list[float]:
        completion = info.data.get("completion_token_ids")
        if completion is not None and len(logps) != len(completion):
            raise PydanticCustomError(
                "logprob_misalign",
                "{logps} logprobs for {ids} completion ids",
                {"logps": len(logps), "ids": len(completion)},
            )
        return logps

    @field_validator("loss_mask")
    @classmethod
    def _mask_covers_prompt_and_completion(cls, mask: list[int], info: ValidationInfo) -> list[int]:
        prompt, completion = info.data.get("prompt_token_ids"), info.data.get("completion_token_ids")
        if prompt is None or completion is None:
            return mask
        if len(mask) != len(prompt) + len(completion):
            raise PydanticCustomError(
                "length_mismatch",
                "loss_mask has {mask} positions for {prompt} prompt + {completion} completion ids",
                {"mask": len(mask), "prompt": len(prompt), "completion": len(completion)},
            )
        if any(mask[: len(prompt)]):
            raise PydanticCustomError("trainable_prompt", "prompt positions of loss_mask must be 0")
        return mask


class TrainingTrace(BaseModel):
    """The selected engine calls of one rollout, each with its own mask and a unique node id."""

    model_config = ConfigDict(strict=True, extra="forbid")

    schema_version: Literal[1] = 1
    turns: list[TrainingTurn]

    @field_validator("turns")
    @classmethod
    def _node_ids_are_unique(cls, turns: list[TrainingTurn]) -> list[TrainingTurn]:
        seen: set[str] = set()
        for turn in turns:
            if turn.node_id in seen:
                raise PydanticCustomError(
                    "duplicate_node_id", "node id '{node_id}' appears twice", {"node_id": turn.node_id}
                )
            seen.add(turn.node_id)
        return turns

    def to_trace_entries(self) -> list[dict[str, Any]]:
        """Per-turn records as OpenEnv's ``TrainingTrace.to_trace_entries`` gives them (TRL's rollout worker
        reads these): each turn's fields, with ``node_id`` moved into ``metadata``."""
        return [
            {**turn.model_dump(exclude={"node_id"}), "metadata": {**turn.metadata, "node_id": turn.node_id}}
            for turn in self.turns
        ]

    def to_openenv(self) -> openenv.core.harness.TrainingTrace:
        """This trace as OpenEnv's own model, passed over the JSON wire."""
        try:
            from openenv.core.harness import TrainingTrace as OpenEnvTrainingTrace
        except ImportError as exc:
            raise ImportError(
                "TrainingTrace.to_openenv() needs the `openenv` extra: pip install 'harness-trainer[openenv]'"
            ) from exc
        return OpenEnvTrainingTrace.model_validate_json(dump_trace(self))

    @classmethod
    def from_openenv(cls, trace: openenv.core.harness.TrainingTrace) -> TrainingTrace:
        """Load a trace built with OpenEnv's model. Raises CaptureContractError like ``load_trace``."""
        return load_trace(trace.model_dump_json())


class CaptureContractError(ValueError):
    """A malformed capture: a bug in the capture path, not a bad rollout. It stops training.

    ``rules`` are the rule codes broken, in order of first appearance; ``node_id`` is the first
    offending turn's node id when the input names one.
    """

    def __init__(
        self, message: str, *, rules: list[str], session_id: str | None = None, node_id: str | None = None
    ) -> None:
        super().__init__(message)
        self.rules = rules
        self.session_id = session_id
        self.node_id = node_id


def load_trace(data: dict[str, Any] | str | bytes, *, session_id: str | None = None) -> TrainingTrace:
    """Validate a trace given as a dict or as JSON text.

    Raises:
        CaptureContractError: the trace breaks a rule; text that is not JSON breaks ``invalid_json``.
    """
    try:
        if isinstance(data, str | bytes):
            return TrainingTrace.model_validate_json(data)
        return TrainingTrace.model_validate(data)
    except ValidationError as exc:
        raise _contract_error(exc, data, session_id) from exc


def dump_trace(trace: TrainingTrace) -> str:
    """The trace as JSON text; ``load_trace`` gives it back unchanged (floats exactly)."""
    return trace.model_dump_json()


def _contract_error(exc: ValidationError, data: object, session_id: str | None) -> CaptureContractError:
    node_ids = _raw_node_ids(data)
    rules: dict[str, None] = {}  # dicts as ordered sets: a bad list can break one rule per element
    problems: dict[str, None] = {}
    node_id: str | None = None
    for error in exc.errors(include_url=False):
        rule = "invalid_json" if error["type"] == "json_invalid" else error["type"]
        where, turn_node_id = _locate(error, node_ids)
        rules[rule] = None
        problems[f"{where}: {rule} ({error['msg']})"] = None
        if node_id is None:
            node_id = turn_node_id
    listed = "; ".join(list(problems)[:_MAX_LISTED])
    more = f"; and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
    session = f"session {session_id!r}" if session_id is not None else "an unnamed session"
    message = f"malformed TrainingTrace from {session}: {listed}{more}"
    return CaptureContractError(message, rules=list(rules), session_id=session_id, node_id=node_id)


def _locate(error: ErrorDetails, node_ids: list[object]) -> tuple[str, str | None]:
    """Where an error is, in words, and the node id it concerns when the input names one."""
    loc = error["loc"]
    if len(loc) < 2 or loc[0] != "turns" or not isinstance(loc[1], int):
        return ".".join(map(str, loc)) or "trace", (error.get("ctx") or {}).get("node_id")
    index, field = loc[1], ".".join(str(part) for part in loc[2:] if not isinstance(part, int))
    node_id = node_ids[index] if index < len(node_ids) and isinstance(node_ids[index], str) else None
    named = f"turn {index} (node {node_id!r})" if node_id is not None else f"turn {index}"
    return f"{named} {field}".rstrip(), node_id


def _raw_node_ids(data: object) -> list[object]:
    """Each input turn's node id as given; JSON text is parsed a second time, on this error path only."""
    try:
        raw: Any = json.loads(data) if isinstance(data, str | bytes) else data
        return [turn.get("node_id") if isinstance(turn, dict) else None for turn in raw["turns"]]
    except (ValueError, TypeError, KeyError):  # input too malformed to name a node
        return []
