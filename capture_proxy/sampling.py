"""A session's sampling policy, and the upstream request it produces.

The policy is the trainer's: temperature only (top_p 1, top_k off, no penalties), an optional seed and
an optional output-token cap. It overrides whatever the agent asked for; both are journaled per call.
Every upstream call is non-streaming, ``n = 1``, and asks the engine for its own ids and processed
logprobs (``logprobs``, ``top_logprobs: 0``, ``return_token_ids``, ``return_tokens_as_token_ids``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from capture_proxy.dialects.base import ChatCall

CAPTURE_FIELDS: dict[str, Any] = {
    "stream": False,
    "n": 1,
    "logprobs": True,
    "top_logprobs": 0,
    "return_token_ids": True,
    "return_tokens_as_token_ids": True,
}


class SamplingPolicy(BaseModel):
    """What the engine samples with for every call of a session (set when the session is minted)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    """Sampling temperature; the engine's logprobs are processed at this temperature."""
    top_p: float = 1.0
    """Must stay 1: nucleus sampling would make the behaviour logprobs describe a truncated policy."""
    top_k: int = -1
    """Must stay off (-1 or 0), for the same reason."""
    seed: int | None = None
    """Optional engine seed, for reproducible sampling."""
    max_tokens: int | None = Field(default=None, ge=1)
    """Optional cap on output tokens per call; the smaller of this and the agent's own cap applies."""

    @model_validator(mode="after")
    def _temperature_only(self) -> SamplingPolicy:
        if self.top_p != 1.0:
            raise ValueError("top_p must be 1: the sampling policy is temperature only")
        if self.top_k not in (-1, 0):
            raise ValueError("top_k must be off (-1 or 0): the sampling policy is temperature only")
        return self

    def wire_json(self) -> dict[str, float | int]:
        """This policy as the JSON a session factory sends (and :meth:`model_validate` reads back): its
        temperature, and its seed and output cap when set. top_p and top_k are left out: this type holds
        them at 1 and off."""
        return self.model_dump(exclude_none=True, exclude={"top_p", "top_k"})

    def upstream_body(self, call: ChatCall, model: str) -> dict[str, Any]:
        """The Chat Completions body sent to the engine for ``call``."""
        body = {**call.body, "model": model, "temperature": self.temperature, "top_p": 1.0, **CAPTURE_FIELDS}
        if self.seed is not None:
            body["seed"] = self.seed
        if self.max_tokens is not None:
            asked = body.get("max_tokens")
            body["max_tokens"] = self.max_tokens if asked is None else min(asked, self.max_tokens)
        return body
