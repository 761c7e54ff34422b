"""Harness adapters: how one agent program is installed, pointed at the capture proxy, run and read.

A harness never re-implements its agent: it writes the agent's own config so that its model provider is
the capture proxy (the session id as API key, the engine's served model name), runs the real program
headless on the task instruction with a step limit and a timeout, and counts tool calls from the agent's
own log. A new harness is one module plus one entry in ``HARNESSES``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from harness_trainer.sandboxes.base import ExecResult, Sandbox


class HarnessError(Exception):
    """The agent could not be installed or configured (the rollout is unscorable)."""


@dataclass
class AgentEndpoint:
    """Where the agent finds its model, as seen from inside the sandbox."""

    root_url: str  # the proxy, e.g. http://127.0.0.1:8300 (Anthropic SDKs append /v1/messages)
    session_id: str  # the capture session id: the agent's API key
    model: str  # the engine's served model name

    @property
    def base_url(self) -> str:
        """The OpenAI-style base URL (``…/v1``)."""
        return self.root_url.rstrip("/") + "/v1"


@dataclass
class ToolCounts:
    calls_by_name: dict[str, int] = field(default_factory=dict)
    failures: int = 0

    @property
    def total(self) -> int:
        return sum(self.calls_by_name.values())


@dataclass
class AgentRun:
    """One run of the agent: its exit, whether it was killed on timeout, its log, its tool counts."""

    result: ExecResult
    log: str
    tools: ToolCounts


class Harness(Protocol):
    name: str

    async def install(self, sandbox: Sandbox) -> None:
        """Make the agent runnable in ``sandbox`` (pinned version); raise :class:`HarnessError`."""
        ...

    async def run(
        self,
        sandbox: Sandbox,
        instruction: str,
        endpoint: AgentEndpoint,
        *,
        step_limit: int,
        timeout_s: float,
    ) -> AgentRun:
        """Configure and run the agent headless on ``instruction``; never raises for its own failure."""
        ...
