"""The record of one call, as the journal stores it and trace assembly reads it.

The on-disk format is written down in ``capture_proxy/JOURNAL.md``; this dataclass is its in-memory form,
with token ids already expanded (the journal may store a prompt as a reference to an earlier record).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Record kinds. Only "model" records carry token ids and may become training turns.
MODEL = "model"
BUDGET_EXHAUSTED = "budget_exhausted"  # terminal reply made by the proxy; never trained on
CONTEXT_EXHAUSTED = "context_exhausted"  # the engine refused the prompt's length; terminal reply
UPSTREAM_ERROR = "upstream_error"  # the engine refused or failed the call; the agent got an error


@dataclass
class Finding:
    """Something wrong with a call or session, stated for the user. ``code`` is stable, ``detail`` prose."""

    code: str
    detail: str

    def to_json(self) -> dict[str, str]:
        return {"code": self.code, "detail": self.detail}


@dataclass
class CallRecord:
    """One call of one session.

    Invariants for ``kind == "model"`` with ``trainable`` ids: ``prompt_token_ids`` non-empty,
    ``len(logprobs) == len(completion_token_ids)``, logprobs finite and ≤ 0. A call whose capture failed
    validation has a ``finding`` and is context only (its completion is never supervised). ``seq`` is the
    session-wide order in which calls were journaled, from 0; ``call_id`` is stable and unique in the session.
    """

    seq: int
    call_id: str
    kind: str
    dialect: str
    has_tools: bool
    started_at: float
    finished_at: float
    upstream_request: dict[str, Any]
    agent_params: dict[str, Any]
    sampling: dict[str, Any]
    response: dict[str, Any] | None
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    weight_version: int | None = None
    """The version that answered: the engine reply's own, else the policy version the proxy knew when the
    reply came back."""
    dispatch_version: int | None = None
    """The policy version the proxy knew when it sent the call upstream (``PUT /policy``), or None."""
    engine: str | None = None
    """The engine (its base URL, as :func:`capture_proxy.config.engine_root` spells it) that answered or
    last failed the call; with replicas, the replica that sampled it. None for calls never forwarded."""
    finding: Finding | None = None
    timings: dict[str, float] = field(default_factory=dict)
    # The prompt ids as the engine's compact JSON text without brackets (``b"1,2,3"``), set instead of
    # ``prompt_token_ids`` on the proxy's hot path; the journal validates it and reads back lists.
    prompt_text: bytes | None = field(default=None, repr=False)

    @property
    def has_ids(self) -> bool:
        has_prompt = self.prompt_token_ids is not None or self.prompt_text is not None
        return has_prompt and self.completion_token_ids is not None
