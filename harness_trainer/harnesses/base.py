"""Harness adapters: how one agent program is installed, pointed at the capture proxy, run and read.

A harness never re-implements its agent: it writes the agent's own config so that its model provider is
the capture proxy (the session id as API key, the engine's served model name), runs the real program
headless on the task instruction with a step limit and a timeout, and counts tool calls from the agent's
own log. A new harness is one module plus one entry in ``HARNESSES``; what others need to know of it (the
package it installs, how a scripted model drives it) are attributes of its class (:class:`Harness`), so no
module outside this package compares a harness's name to a string.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from harness_trainer.sandboxes.base import ExecResult, Sandbox

if TYPE_CHECKING:
    from harness_trainer.harnesses.tools import ToolPackage

AGENT_LOG_DIR = "/logs/agent"  # Harbor's place for an agent's own logs


def json_lines(log: str) -> Iterator[dict[str, Any]]:
    """The JSON objects among ``log``'s lines (agents' event logs); other lines are skipped."""
    for line in log.splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            yield value


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
    """Tool calls the agent made, by the agent's own tool name, and how many of them failed."""

    calls_by_name: dict[str, int] = field(default_factory=dict)
    failures: int = 0

    @property
    def total(self) -> int:
        return sum(self.calls_by_name.values())

    def add(self, name: str, *, failed: bool = False) -> None:
        self.calls_by_name[name] = self.calls_by_name.get(name, 0) + 1
        self.failures += int(failed)


@dataclass
class AgentRun:
    """One run of the agent: its exit, whether it was killed on timeout, its log, its tool counts, and its
    own record of its model calls (the messages each sent), for an agent that writes one."""

    result: ExecResult
    log: str
    tools: ToolCounts
    record: list[list[dict[str, Any]]] | None = None


@dataclass(frozen=True)
class Dialect:
    """How a scripted model's replies drive a harness's agent (the dev loop's solver transcripts, its
    warm-up, the agents benchmark): the agent's shell tool (``shell_tool``, the command under
    ``command_key``) and the arguments it requires beside the command (``bash_arguments``: ``(name,
    value)``, with a value that will do), and how a reply ends the run: the shell command the agent takes as
    its submission (``submit_command``), or, without one, a reply with no tool call. An agent without tool
    calls (``shell_fence``) takes a text reply with the command in a fenced block of that info string, and
    answers that one reply, then exits (no finishing reply)."""

    bash_arguments: tuple[tuple[str, str], ...] = ()
    submit_command: str | None = None
    shell_tool: str = "bash"
    command_key: str = "command"
    shell_fence: str | None = None


class Harness(Protocol):
    name: str
    package: ToolPackage | None
    """The pinned agent package it installs (:mod:`.tools`); None when there is none to install."""
    dialect: Dialect | None
    """How a scripted model drives its agent; None when no scripted transcript is written for it."""

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


async def run_logged(
    sandbox: Sandbox,
    argv: Sequence[str],
    *,
    env: dict[str, str],
    log_path: str,
    timeout_s: float,
    cwd: str | None = None,
) -> tuple[ExecResult, str]:
    """Run ``argv`` in ``sandbox`` (stdin empty, stdout into ``log_path``); returns its result and the log.

    The log is read back from the file, so a run killed on timeout still yields what it wrote.
    """
    await sandbox.write_file(log_path, b"")  # creates the folder, and no stale log survives
    command = f"{shlex.join(argv)} < /dev/null > {shlex.quote(log_path)}"
    result = await sandbox.exec(command, timeout_s=timeout_s, env=env, cwd=cwd or sandbox.workdir)
    try:
        log = (await sandbox.read_file(log_path)).decode("utf-8", errors="replace")
    except FileNotFoundError:  # the agent removed its own log: its stdout is gone with it
        log = ""
    return result, log
