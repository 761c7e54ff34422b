"""gemini-cli (npm ``@google/gemini-cli``, pinned) as a harness.

It has no native build: its bundle is the package beside Node (the ``node`` recipe of :mod:`.bundles`).

Configuration, by environment: ``GOOGLE_GEMINI_BASE_URL`` = the proxy's root (its SDK posts to
``<root>/v1beta/models/<model>:streamGenerateContent?alt=sse``), ``GEMINI_API_KEY`` = the capture session
id (sent as ``x-goog-api-key``), ``GEMINI_CLI_HOME`` = a private home, ``~/.harness-trainer/gemini-cli``,
whose ``.gemini/settings.json`` is written for the rollout (no user's settings, memory, extensions or
trusted folders are read; ``GEMINI_CLI_SYSTEM_SETTINGS_PATH`` and ``GEMINI_CLI_SYSTEM_DEFAULTS_PATH`` name
files there that do not exist, so no machine-wide ones either); ``GEMINI_CLI_NO_RELAUNCH`` (no second Node
process), ``GEMINI_TELEMETRY_ENABLED=false``. The settings:

- ``security.auth.selectedType`` ``gemini-api-key`` (no auth dialog; the base URL applies to it);
  folder trust off and ``GEMINI_CLI_TRUST_WORKSPACE=true`` (in an untrusted folder gemini-cli forces the
  approval mode back to ``default``, which asks before each tool);
- ``tools.core``: only the shell, file and search tools (:data:`DEFAULT_TOOLS`): no web tools
  (``google_web_search``, ``web_fetch``), memory, todos, skills or subagents are declared; todos, skills,
  subagents, plan mode, topic narration, hooks, checkpointing, the pty shell and the IDE integration off;
- usage statistics and telemetry off, auto-update and its notification off;
- the side calls that need constrained decoding, which the proxy refuses: the next-speaker check
  (``model.skipNextSpeakerCheck``, gemini-cli's default too), loop detection
  (``model.disableLoopDetection``: its LLM check asks for a JSON schema) and the edit tool's LLM
  correction (``tools.disableLLMCorrection``, also its default);
- ``modelConfigs.overrides`` adds ``maxOutputTokens`` to every call for the served model (gemini-cli
  sends none otherwise); ``general.maxAttempts`` 2 (the proxy already retries the engine);
- ``model.maxSessionTurns`` is the step limit: each turn of its headless loop is one model call, and
  past the limit it stops (exit 53).

Run: ``gemini --model <served> --approval-mode yolo --output-format stream-json --extensions none
--allowed-mcp-server-names <none> --prompt=<instruction>`` in the task's workdir (``yolo``: every tool runs
without asking, the sandbox is the boundary; no extension and no MCP server, not even one a project's
``.gemini/settings.json`` declares; the instruction as one argument, so it never reads as an option).
gemini-cli still reads a ``GEMINI.md`` of the workdir (up to its git root) and inlines files that an
``@path`` of the instruction names, as it does for anyone. Its event stream goes to
``/logs/agent/gemini-cli.jsonl``; each ``tool_use`` event is one call (``tool_name``, ``tool_id``), failed
when its ``tool_result`` has ``status`` ``error``.
"""

from __future__ import annotations

import json
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
from harness_trainer.harnesses.tools import ToolPackage
from harness_trainer.sandboxes.base import Sandbox

PACKAGE = ToolPackage("npm", "@google/gemini-cli", "0.61.0", "node_modules/.bin/gemini")
DEFAULT_TOOLS = (
    "run_shell_command",
    "read_file",
    "write_file",
    "replace",
    "list_directory",
    "glob",
    "grep_search",
)
NO_MCP_SERVER = "harness-trainer-none"  # the only MCP server allowed: none has this name
LOG_NAME = "gemini-cli.jsonl"
CONFIG_DIR = ".harness-trainer/gemini-cli"  # under the sandbox's home: GEMINI_CLI_HOME
ENV = {
    "GEMINI_CLI_NO_RELAUNCH": "true",
    "GEMINI_CLI_TRUST_WORKSPACE": "true",
    "GEMINI_TELEMETRY_ENABLED": "false",
    "NO_BROWSER": "true",
    "NO_COLOR": "1",
}


def build_settings(
    endpoint: AgentEndpoint,
    *,
    step_limit: int,
    max_output_tokens: int,
    tools: Sequence[str] = DEFAULT_TOOLS,
) -> dict[str, Any]:
    """settings.json for one rollout (see the module docstring); ``step_limit`` 0 means none."""
    output_cap = {"generateContentConfig": {"maxOutputTokens": max_output_tokens}}
    return {
        "general": {
            "enableAutoUpdate": False,
            "enableAutoUpdateNotification": False,
            "checkpointing": {"enabled": False},
            "plan": {"enabled": False},
            "topicUpdateNarration": False,
            "sessionRetention": {"enabled": False},
            "maxAttempts": 2,  # the proxy already retries the engine
        },
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False, "logPrompts": False},
        "ide": {"enabled": False, "hasSeenNudge": True},
        "security": {
            "auth": {"selectedType": "gemini-api-key"},
            "folderTrust": {"enabled": False},
        },
        "model": {
            "maxSessionTurns": step_limit if step_limit > 0 else -1,
            "skipNextSpeakerCheck": True,
            "disableLoopDetection": True,
        },
        "modelConfigs": {"overrides": [{"match": {"model": endpoint.model}, "modelConfig": output_cap}]},
        "tools": {
            "core": list(tools),
            "shell": {"enableInteractiveShell": False},
            "disableLLMCorrection": True,  # its edit-fixing side call asks for a JSON schema
        },
        "useWriteTodos": False,
        "skills": {"enabled": False},
        "hooksConfig": {"enabled": False},
        "experimental": {"enableAgents": False, "extensionManagement": False},
        "advanced": {"autoConfigureMemory": False},
    }


def build_env(endpoint: AgentEndpoint, config_home: str) -> dict[str, str]:
    """The environment that points gemini-cli at the proxy and at its private settings."""
    return {
        **ENV,
        "GOOGLE_GEMINI_BASE_URL": endpoint.root_url.rstrip("/"),
        "GEMINI_API_KEY": endpoint.session_id,
        "GEMINI_CLI_HOME": config_home,
        # never written: no system-wide settings (/etc/gemini-cli) are read
        "GEMINI_CLI_SYSTEM_SETTINGS_PATH": f"{config_home}/no-system-settings.json",
        "GEMINI_CLI_SYSTEM_DEFAULTS_PATH": f"{config_home}/no-system-defaults.json",
        "GEMINI_CLI_TRUSTED_FOLDERS_PATH": f"{config_home}/trustedFolders.json",
    }


def build_command(binary: str, instruction: str, *, model: str) -> list[str]:
    argv = [binary, "--model", model, "--approval-mode", "yolo", "--output-format", "stream-json"]
    argv += ["--extensions", "none", "--allowed-mcp-server-names", NO_MCP_SERVER]
    return [*argv, f"--prompt={instruction}"]  # one argument: an instruction never reads as an option


def parse_tool_counts(log: str) -> ToolCounts:
    """Tool calls by name from ``--output-format stream-json``; non-JSON lines are skipped."""
    counts = ToolCounts()
    called: set[str] = set()
    failed: set[str] = set()
    for event in json_lines(log):
        kind = event.get("type")
        key = str(event.get("tool_id"))
        if kind == "tool_use" and key not in called:
            called.add(key)
            counts.add(str(event.get("tool_name") or "unknown"))
        elif kind == "tool_result" and event.get("status") == "error":
            failed.add(key)
    counts.failures = len(failed & called)
    return counts


class GeminiCliHarness:
    """gemini-cli headless against the capture proxy; see the module docstring for the setup."""

    name = "gemini-cli"
    package = PACKAGE
    dialect = Dialect(shell_tool="run_shell_command")  # `command` alone; a text-only reply ends the run

    def __init__(self, *, max_output_tokens: int = 4096, tools: Sequence[str] = DEFAULT_TOOLS) -> None:
        """``max_output_tokens``: ``maxOutputTokens`` per call (gemini-cli sends none otherwise, and the
        engine would then allow the whole context); ``tools``: the built-in tools offered (``tools.core``)."""
        self.max_output_tokens = max_output_tokens
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
        config_home = f"{sandbox.home.rstrip('/')}/{CONFIG_DIR}"
        settings = build_settings(
            endpoint, step_limit=step_limit, max_output_tokens=self.max_output_tokens, tools=self.tools
        )
        path = f"{config_home}/.gemini/settings.json"
        await sandbox.write_file(path, json.dumps(settings, indent=2), mode=0o600)
        result, log = await run_logged(
            sandbox,
            build_command(agent_path(sandbox, PACKAGE), instruction, model=endpoint.model),
            env=build_env(endpoint, config_home),
            log_path=f"{AGENT_LOG_DIR}/{LOG_NAME}",
            timeout_s=timeout_s,
        )
        return AgentRun(result=result, log=log, tools=parse_tool_counts(log))
