"""Claude Code (npm ``@anthropic-ai/claude-code``, pinned) as a harness.

Configuration, all by environment: ``ANTHROPIC_BASE_URL`` = the proxy's root (the SDK appends
``/v1/messages``), ``ANTHROPIC_API_KEY`` = the capture session id, and every model alias
(``ANTHROPIC_MODEL``, ``ANTHROPIC_SMALL_FAST_MODEL``, ``ANTHROPIC_DEFAULT_{OPUS,SONNET,HAIKU,FABLE}_MODEL``,
``CLAUDE_CODE_SUBAGENT_MODEL``) = the served model; nonessential traffic, telemetry, error reporting and
autoupdate off; ``IS_SANDBOX=1`` lets it skip permissions as root. The served model is unknown to Claude
Code, which then assumes the newest API features; ``CLAUDE_CODE_MODEL_CAPABILITIES`` turns off the ones a
Chat Completions engine cannot honour (system messages in mid-conversation, mid-conversation tool
changes, server-side context management, adaptive thinking, effort), thinking is off
(``MAX_THINKING_TOKENS=0``), ``CLAUDE_CODE_MAX_OUTPUT_TOKENS`` caps ``max_tokens`` (32000 otherwise)
and, when given, ``CLAUDE_CODE_MAX_CONTEXT_TOKENS`` is the context it plans for.

Run: ``claude -p --output-format stream-json --verbose --dangerously-skip-permissions --tools
Bash,Read,Edit,Write [--max-turns N] -- <instruction>`` in the task's workdir. Only the file and shell
tools are offered: the defaults add tools that spawn nested agents, schedule work or reach the web, and
with them the prompt outgrows small contexts. The stream goes to ``/logs/agent/claude-code.jsonl``; each
``tool_use`` block of an assistant message is one call, failed when its ``tool_result`` says
``is_error``.

Its own record of its model calls: the session transcript, which logs every request as sent
(:mod:`.records_anthropic`; the stream holds neither the reminders Claude Code adds to the first user
message nor a request's boundaries). It is written to the sandbox's own ``~/.claude/projects/``, where
Claude Code keeps its config anyway; a ``CLAUDE_CONFIG_DIR`` elsewhere would change the prompt (the
system prompt names the memory folder under it). After the run the transcript of the stream's session
id is read back.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Any

from harness_trainer.harnesses.base import (
    AGENT_LOG_DIR,
    AgentEndpoint,
    AgentRun,
    Dialect,
    ToolCounts,
    json_lines,
    run_logged,
)
from harness_trainer.harnesses.bundles import agent_path, install_agent
from harness_trainer.harnesses.records_anthropic import recorded_calls
from harness_trainer.harnesses.tools import NativeBinary, ToolPackage
from harness_trainer.sandboxes.base import Sandbox

PACKAGE = ToolPackage(
    "npm", "@anthropic-ai/claude-code", "2.1.332", "node_modules/.bin/claude",
    native=NativeBinary("@anthropic-ai/claude-code-linux-x64", "2.1.332", "claude"),
)  # fmt: skip
DEFAULT_TOOLS = ("Bash", "Read", "Edit", "Write")
LOG_NAME = "claude-code.jsonl"
TRANSCRIPT_TIMEOUT_S = 30.0
MODEL_VARIABLES = (
    "ANTHROPIC_MODEL",
    "ANTHROPIC_SMALL_FAST_MODEL",
    "ANTHROPIC_DEFAULT_OPUS_MODEL",
    "ANTHROPIC_DEFAULT_SONNET_MODEL",
    "ANTHROPIC_DEFAULT_HAIKU_MODEL",
    "ANTHROPIC_DEFAULT_FABLE_MODEL",
    "CLAUDE_CODE_SUBAGENT_MODEL",
)
CAPABILITIES_OFF = ("mid_conv_system", "mid_conv_tool_change", "context_management", "adaptive_thinking")
CAPABILITIES_OFF += ("effort",)
ENV = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "IS_SANDBOX": "1",
    "MAX_THINKING_TOKENS": "0",
    "CLAUDE_CODE_MAX_RETRIES": "2",  # the proxy already retries the engine
    "CLAUDE_CODE_MODEL_CAPABILITIES": ",".join(f"-{name}" for name in CAPABILITIES_OFF),
}


def build_env(
    endpoint: AgentEndpoint, *, max_output_tokens: int, context_tokens: int | None = None
) -> dict[str, str]:
    """The environment that points Claude Code at the proxy (see the module docstring)."""
    env = {
        **ENV,
        "ANTHROPIC_BASE_URL": endpoint.root_url.rstrip("/"),
        "ANTHROPIC_API_KEY": endpoint.session_id,
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_output_tokens),
        **dict.fromkeys(MODEL_VARIABLES, endpoint.model),
    }
    if context_tokens is not None:
        env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] = str(context_tokens)
    return env


def build_command(binary: str, instruction: str, *, step_limit: int, tools: Sequence[str]) -> list[str]:
    argv = [binary, "-p", "--output-format", "stream-json", "--verbose"]
    argv += ["--dangerously-skip-permissions", "--tools", ",".join(tools)]
    if step_limit > 0:
        argv += ["--max-turns", str(step_limit)]
    return [*argv, "--", instruction]


def parse_tool_counts(log: str) -> ToolCounts:
    """Tool calls by name from ``--output-format stream-json``; non-JSON lines are skipped."""
    counts = ToolCounts()
    called: set[str] = set()
    failed: set[str] = set()
    for event in json_lines(log):
        if event.get("type") not in ("assistant", "user"):
            continue
        for block in _content_blocks(event):
            if block.get("type") == "tool_use" and str(block.get("id")) not in called:
                called.add(str(block.get("id")))
                counts.add(str(block.get("name") or "unknown"))
            elif block.get("type") == "tool_result" and block.get("is_error") is True:
                failed.add(str(block.get("tool_use_id")))
    counts.failures = len(failed)
    return counts


def _content_blocks(event: dict[str, Any]) -> list[dict[str, Any]]:
    content = (event.get("message") or {}).get("content")
    return [block for block in content if isinstance(block, dict)] if isinstance(content, list) else []


class ClaudeCodeHarness:
    """Claude Code headless against the capture proxy; see the module docstring for the setup."""

    name = "claude-code"
    package = PACKAGE
    dialect = Dialect(shell_tool="Bash", bash_arguments=(("description", "Solve the task"),))

    def __init__(
        self,
        *,
        max_output_tokens: int = 4096,
        context_tokens: int | None = None,
        tools: Sequence[str] = DEFAULT_TOOLS,
    ) -> None:
        """``max_output_tokens``: ``max_tokens`` per call; ``context_tokens``: the context window Claude
        Code should assume (None: its default for an unknown model, 1M, so it never compacts);
        ``tools``: the built-in tools offered."""
        self.max_output_tokens = max_output_tokens
        self.context_tokens = context_tokens
        self.tools = tuple(tools)

    async def install(self, sandbox: Sandbox) -> None:
        await install_agent(sandbox, PACKAGE)

    async def run(
        self,
        sandbox: Sandbox,
        instruction: str,
        endpoint: AgentEndpoint,
        *,
        step_limit: int,
        timeout_s: float,
    ) -> AgentRun:
        command = build_command(
            agent_path(sandbox, PACKAGE), instruction, step_limit=step_limit, tools=self.tools
        )
        result, log = await run_logged(
            sandbox,
            command,
            env=build_env(
                endpoint, max_output_tokens=self.max_output_tokens, context_tokens=self.context_tokens
            ),
            log_path=f"{AGENT_LOG_DIR}/{LOG_NAME}",
            timeout_s=timeout_s,
        )
        record = recorded_calls(await _session_transcript(sandbox, log))
        return AgentRun(result=result, log=log, tools=parse_tool_counts(log), record=record)


def session_id(log: str) -> str | None:
    """The Claude Code session of a run, from its stream's ``system``/``init`` event."""
    return next((str(e["session_id"]) for e in json_lines(log) if e.get("session_id")), None)


async def _session_transcript(sandbox: Sandbox, log: str) -> str | None:
    """The run's session transcript (module docstring), or None where it cannot be had."""
    session = session_id(log)
    if session is None:
        return None
    projects = shlex.quote(f"{sandbox.home.rstrip('/')}/.claude/projects")
    try:
        found = await sandbox.exec(
            f"ls -1 {projects}/*/{shlex.quote(session + '.jsonl')}", timeout_s=TRANSCRIPT_TIMEOUT_S
        )
        paths = found.stdout.splitlines()
        return (await sandbox.read_file(paths[0])).decode("utf-8", errors="replace") if paths else None
    except Exception:  # no record is a verdict of its own, never a failed rollout
        return None
