"""Qwen Code (npm ``@qwen-code/qwen-code``, pinned) as a harness.

It has no native build: its bundle is the package beside the registry's Node (:mod:`.bundles`, the
``node`` recipe; Qwen Code needs Node >= 22).

Configuration: a private ``QWEN_HOME`` (``~/.harness-trainer/qwen-code`` of the sandbox's ``HOME``; Qwen
Code's user settings, memories, extensions and chats live there, never in the user's ``~/.qwen``) holding
``settings.json``; the model by environment: ``OPENAI_BASE_URL`` = the proxy's ``/v1``,
``OPENAI_API_KEY`` = the capture session id, ``OPENAI_MODEL`` = the served model (also ``model.name``),
with ``security.auth.selectedType = "openai"`` (Chat Completions). ``QWEN_CODE_MAX_OUTPUT_TOKENS`` caps
``max_tokens`` (32000 otherwise for a model it does not know); ``context_tokens``, when given, is
``model.generationConfig.contextWindowSize``. ``model.maxSessionTurns`` is the step limit (each model call
is a turn; Qwen Code exits 53 when it is reached; -1 = none).

Off, for training and to fit small contexts: the tools beyond the file and shell ones (``tools.core`` is
the allowlist; ``tools.disabled`` removes the ones it exempts: subagents, goals, worktrees, skills,
messaging; the web tools ``web_fetch`` and ``web_search`` are off both ways), tool search, skills at every
level, MCP servers, cron, artifacts, agent teams, automatic updates, usage statistics, telemetry, IDE
integration, chat recording and ripgrep (the package's ``rg`` is not executable as published: the built-in
grep serves). Off because each is a model call of its own: the background memory agents (extraction,
"dream", skill review: one call after every run otherwise) and the LLM-written tool-use summaries; and the
side queries that force a tool call with a JSON schema, which the proxy refuses with a 400: session titles
(``QWEN_DISABLE_AUTO_TITLE``) and the next-speaker check; memory recall has nothing to recall (no
memories in the fresh ``QWEN_HOME``, none written) and the permission classifier runs only in ``auto``
approval mode, never in yolo. Loop detection (heuristics) is off too. Left on: chat compression, a
plain-text call of the served model when the context fills up (it plans for ``context_tokens`` when
given).

Run: ``qwen --approval-mode yolo --output-format stream-json --prompt=<instruction>`` in the task's
workdir (yolo: the sandbox is the boundary). The stream goes to ``/logs/agent/qwen-code.jsonl``; each
``tool_use`` block of an assistant message is one call, failed when its ``tool_result`` says ``is_error``
(a shell command that exits non-zero is one).

Its own record of its model calls (:func:`recorded_calls`): with ``model.enableOpenAILogging`` Qwen Code
writes every Chat Completions request it sends, with the response or error it got, as one JSON file,
``<QWEN_HOME>/openai-logs/openai-<time>-<id>.json`` (``{"request", "response", "error", "context":
{"sessionId", "promptId"}, …}``); it sends the same request with the log on or off. That is the record,
call by call, system prompt included, read back after the run. Its chat recording (off) is not: it keeps
the conversation, not the calls, and leaves out the ``<system-reminder>`` parts (startup context, skills,
the date) that Qwen Code puts before the user's text in each request.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator, Sequence
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
from harness_trainer.harnesses.tools import ToolPackage
from harness_trainer.sandboxes.base import Sandbox

PACKAGE = ToolPackage("npm", "@qwen-code/qwen-code", "0.24.4", "node_modules/.bin/qwen")
DEFAULT_TOOLS = ("run_shell_command", "read_file", "write_file", "edit", "glob", "grep_search")
EXEMPT_TOOLS = ("agent", "list_agents", "send_message", "task_stop", "skill", "get_goal", "update_goal")
EXEMPT_TOOLS += ("enter_worktree", "exit_worktree", "report_findings")
"""Tools that ``tools.core`` does not remove (0.24.4): removed with ``tools.disabled``."""
WEB_TOOLS = ("web_fetch", "web_search")
MEMORY_AGENTS = ("enableManagedAutoMemory", "enableManagedAutoDream", "enableAutoSkill")
"""The background memory agents (each a model call after the run), all turned off."""
LOG_NAME = "qwen-code.jsonl"
CONFIG_DIR = ".harness-trainer/qwen-code"
"""The private ``QWEN_HOME``, relative to the sandbox's ``HOME``."""
REQUEST_LOG_DIR = "openai-logs"
"""Where Qwen Code logs each request it sends, relative to ``QWEN_HOME``."""
ENV = {
    "QWEN_DISABLE_AUTO_TITLE": "1",  # no session-title call
    "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1",
    "QWEN_TELEMETRY_ENABLED": "false",
    "QWEN_USAGE_STATISTICS_ENABLED": "false",
    "QWEN_CODE_DISABLE_CRON": "1",
    "NO_BROWSER": "1",
}


def build_settings(
    endpoint: AgentEndpoint,
    *,
    step_limit: int,
    tools: Sequence[str] = DEFAULT_TOOLS,
    context_tokens: int | None = None,
    request_log_dir: str | None = None,
) -> dict[str, Any]:
    """settings.json for one rollout (see the module docstring); ``step_limit`` 0 means none;
    ``request_log_dir``: where it logs each request it sends (None: it logs none). The API key is not in
    it: it travels as ``OPENAI_API_KEY``."""
    model: dict[str, Any] = {
        "name": endpoint.model,
        "maxSessionTurns": step_limit if step_limit > 0 else -1,
        "skipNextSpeakerCheck": True,
        "skipLoopDetection": True,
    }
    if request_log_dir is not None:
        model |= {"enableOpenAILogging": True, "openAILoggingDir": request_log_dir}
    if context_tokens is not None:
        model["generationConfig"] = {"contextWindowSize": int(context_tokens)}
    offered = list(tools)
    return {
        "security": {"auth": {"selectedType": "openai"}, "folderTrust": {"enabled": False}},
        "model": model,
        "general": {"enableAutoUpdate": False, "chatRecording": False},
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
        "ide": {"enabled": False},
        "memory": dict.fromkeys(MEMORY_AGENTS, False),
        "skills": {"disabledLevels": ["project", "user", "extension", "bundled"]},
        "tools": {
            "core": offered,
            "disabled": [name for name in (*EXEMPT_TOOLS, *WEB_TOOLS) if name not in offered],
            "approvalMode": "yolo",
            "useRipgrep": False,
            "webSearch": {"enabled": False},
            "toolSearch": {"enabled": False},
        },
        "mcpServers": {},
        "mcp": {"excluded": ["*"]},
        "experimental": {"emitToolUseSummaries": False, "cron": False, "artifact": False, "agentTeam": False},
        "goals": {"modelProposed": "disabled"},
        "agents": {"crossSessionMessaging": False},
    }


def build_env(endpoint: AgentEndpoint, *, qwen_home: str, max_output_tokens: int) -> dict[str, str]:
    """The environment that points Qwen Code at the proxy and at its private settings."""
    return {
        **ENV,
        "QWEN_HOME": qwen_home,
        "OPENAI_BASE_URL": endpoint.base_url,
        "OPENAI_API_KEY": endpoint.session_id,
        "OPENAI_MODEL": endpoint.model,
        "QWEN_CODE_MAX_OUTPUT_TOKENS": str(max_output_tokens),
    }


def build_command(binary: str, instruction: str) -> list[str]:
    """The instruction is one ``--prompt=`` argument: after ``--`` Qwen Code sees no prompt, and as a word
    of its own an instruction that starts with ``-`` would read as an option."""
    return [binary, "--approval-mode", "yolo", "--output-format", "stream-json", f"--prompt={instruction}"]


def parse_tool_counts(log: str) -> ToolCounts:
    """Tool calls by name from ``--output-format stream-json``; non-JSON lines are skipped."""
    counts = ToolCounts()
    called: set[str] = set()
    failed: set[str] = set()
    for event in json_lines(log):
        if event.get("type") not in ("assistant", "user"):
            continue
        content = (event.get("message") or {}).get("content")
        for block in content if isinstance(content, list) else []:
            if not isinstance(block, dict):
                continue
            if block.get("type") == "tool_use" and str(block.get("id")) not in called:
                called.add(str(block.get("id")))
                counts.add(str(block.get("name") or "unknown"))
            elif block.get("type") == "tool_result" and block.get("is_error") is True:
                failed.add(str(block.get("tool_use_id")))
    counts.failures = len(failed & called)
    return counts


class QwenCodeHarness:
    """Qwen Code headless against the capture proxy; see the module docstring for the setup."""

    name = "qwen-code"
    package = PACKAGE
    dialect = Dialect(shell_tool="run_shell_command")  # `command` alone; a text-only reply ends the run

    def __init__(
        self,
        *,
        max_output_tokens: int = 4096,
        context_tokens: int | None = None,
        tools: Sequence[str] = DEFAULT_TOOLS,
    ) -> None:
        """``max_output_tokens``: ``max_tokens`` per call; ``context_tokens``: the context window Qwen Code
        should assume (None: its default for an unknown model); ``tools``: the built-in tools offered."""
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
        qwen_home = f"{sandbox.home.rstrip('/')}/{CONFIG_DIR}"
        log_dir = f"{qwen_home}/{REQUEST_LOG_DIR}"
        settings = build_settings(
            endpoint,
            step_limit=step_limit,
            tools=self.tools,
            context_tokens=self.context_tokens,
            request_log_dir=log_dir,
        )
        await sandbox.write_file(f"{qwen_home}/settings.json", json.dumps(settings, indent=2), mode=0o600)
        result, log = await run_logged(
            sandbox,
            build_command(agent_path(sandbox, PACKAGE), instruction),
            env=build_env(endpoint, qwen_home=qwen_home, max_output_tokens=self.max_output_tokens),
            log_path=f"{AGENT_LOG_DIR}/{LOG_NAME}",
            timeout_s=timeout_s,
        )
        session = session_id(log)
        record = recorded_calls(await _request_logs(sandbox, log_dir), session) if session else None
        return AgentRun(result=result, log=log, tools=parse_tool_counts(log), record=record)


def session_id(log: str) -> str | None:
    """The Qwen Code session of a run, from its stream's ``init`` event."""
    inits = (e for e in json_lines(log) if e.get("subtype") == "init" and e.get("session_id"))
    return next((str(e["session_id"]) for e in inits), None)


async def _request_logs(sandbox: Sandbox, log_dir: str) -> str | None:
    """The request logs of ``log_dir``, oldest first (their names begin with the time), one after another;
    None where they cannot be read."""
    try:
        listed = await sandbox.exec(f"ls -1 {shlex.quote(log_dir)}", timeout_s=30, cwd=sandbox.workdir)
        if listed.exit_code != 0:
            return None
        names = sorted(n for n in listed.stdout.split() if n.startswith("openai-") and n.endswith(".json"))
        logs = [await sandbox.read_file(f"{log_dir}/{name}") for name in names]
    except Exception:  # no record is a verdict of its own, never a failed rollout
        return None
    return "\n".join(data.decode("utf-8", errors="replace") for data in logs)


def recorded_calls(logs: str | None, session: str) -> list[list[dict[str, Any]]] | None:
    """The messages Qwen Code sent in each model call of ``session``, as it sent them, from its request
    logs (module docstring: JSON documents one after another, oldest first); None without a readable log.
    A request that got an error instead of a response is left out: it gave the run no model turn."""
    try:
        entries = list(_documents(logs or ""))
    except ValueError:  # a log cut short: the agent was killed while writing it
        return None
    if not entries:
        return None
    calls: list[list[dict[str, Any]]] = []
    for entry in entries:
        if not isinstance(entry, dict) or (entry.get("context") or {}).get("sessionId") != session:
            continue
        messages = (entry.get("request") or {}).get("messages")
        if isinstance(messages, list) and entry.get("response") and not entry.get("error"):
            calls.append([m for m in messages if isinstance(m, dict)])
    return calls


def _documents(text: str) -> Iterator[Any]:
    """The JSON documents of ``text``, one after another; raises ValueError at one that does not parse."""
    decoder, at = json.JSONDecoder(), _after_space(text, 0)
    while at < len(text):
        document, at = decoder.raw_decode(text, at)
        yield document
        at = _after_space(text, at)


def _after_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at
