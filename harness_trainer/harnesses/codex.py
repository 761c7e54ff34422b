"""Codex CLI (npm ``@openai/codex``, pinned) as a harness.

Configuration: ``$CODEX_HOME/config.toml`` in a private ``CODEX_HOME`` (``~/.codex`` of the sandbox's
own ``HOME``): the model provider ``harness`` with ``base_url`` = the proxy's ``/v1``, ``wire_api =
"responses"`` and ``env_key = "HARNESS_TRAINER_API_KEY"``, a variable holding the capture session id;
the served model; approvals never and Codex's own sandbox off (``danger-full-access``: the task sandbox
is the boundary). Off, for training and to fit small contexts: web search, subagents (``[agents]
enabled = false``), goals, apps, plugins, hooks, memories, image tools, skill search and the bundled
skills' instructions, update checks and analytics. ``context_tokens``, when given, is written as
``model_context_window`` (the served model has no metadata in Codex otherwise).

Run: ``codex exec --json --skip-git-repo-check --strict-config --color never -C <workdir> --
<instruction>``. Codex has no step limit of its own: the rollout's model-call budget (the capture
session's ``max_model_calls``) is what bounds it. The JSONL events go to ``/logs/agent/codex.jsonl``;
every completed tool item is one call, named as the model calls it (``command_execution`` →
``exec_command``, ``file_change`` → ``apply_patch``, an MCP call → ``server.tool``), failed when its
status is ``failed`` or a command exits non-zero.

Its own record of its model calls: the session's rollout file under ``$CODEX_HOME/sessions/``
(:mod:`.records_responses`), which is why the run is not ``--ephemeral`` (the requests are the same
either way); after the run the rollout of the ``thread.started`` event's thread id is read back.
"""

from __future__ import annotations

import json
import shlex
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
from harness_trainer.harnesses.records_responses import recorded_calls
from harness_trainer.harnesses.tools import NativeBinary, ToolPackage
from harness_trainer.sandboxes.base import Sandbox

PACKAGE = ToolPackage(
    "npm", "@openai/codex", "0.171.0", "node_modules/.bin/codex",
    native=NativeBinary("@openai/codex", "0.171.0-linux-x64", "vendor/x86_64-unknown-linux-musl/bin/codex"),
)  # fmt: skip
PROVIDER_ID = "harness"
API_KEY_VARIABLE = "HARNESS_TRAINER_API_KEY"
LOG_NAME = "codex.jsonl"
ROLLOUT_TIMEOUT_S = 30.0
FEATURES_OFF = ("goals", "apps", "plugins", "hooks", "memories", "view_image", "image_generation")
FEATURES_OFF += ("skill_search", "tool_suggest", "sleep_tool")
TOOL_ITEMS = {"command_execution": "exec_command", "file_change": "apply_patch", "web_search": "web_search"}
NOT_TOOL_ITEMS = ("agent_message", "reasoning", "error", "todo_list", "user_message")


def build_config(endpoint: AgentEndpoint, *, context_tokens: int | None = None) -> str:
    """config.toml for one rollout (see the module docstring)."""
    lines = [
        f"model = {_toml(endpoint.model)}",
        f"model_provider = {_toml(PROVIDER_ID)}",
        'approval_policy = "never"',
        'sandbox_mode = "danger-full-access"',
        'web_search = "disabled"',
        "check_for_update_on_startup = false",
    ]
    if context_tokens is not None:
        lines.append(f"model_context_window = {int(context_tokens)}")
    lines += ["", "[features]", *(f"{name} = false" for name in FEATURES_OFF)]
    lines += ["", "[agents]", "enabled = false", "", "[analytics]", "enabled = false"]
    lines += ["", "[skills]", "include_instructions = false", "", "[skills.bundled]", "enabled = false"]
    lines += [
        "",
        f"[model_providers.{PROVIDER_ID}]",
        'name = "harness-trainer capture proxy"',
        f"base_url = {_toml(endpoint.base_url)}",
        'wire_api = "responses"',
        f"env_key = {_toml(API_KEY_VARIABLE)}",
    ]
    return "\n".join(lines) + "\n"


def _toml(text: str) -> str:
    """A TOML basic string (JSON's escapes are TOML's; non-ASCII stays as UTF-8)."""
    return json.dumps(text, ensure_ascii=False)


def build_command(binary: str, instruction: str, workdir: str) -> list[str]:
    argv = [binary, "exec", "--json", "--skip-git-repo-check", "--strict-config"]
    return [*argv, "--color", "never", "-C", workdir, "--", instruction]


def parse_tool_counts(log: str) -> ToolCounts:
    """Tool calls by name from ``codex exec --json`` events; non-JSON lines are skipped."""
    counts = ToolCounts()
    seen: set[str] = set()
    for event in json_lines(log):
        if event.get("type") != "item.completed":
            continue
        item = event.get("item") or {}
        kind = str(item.get("type") or "")
        key = str(item.get("id") or len(seen))
        if not kind or kind in NOT_TOOL_ITEMS or key in seen:
            continue
        seen.add(key)
        counts.add(_tool_name(item), failed=_failed(item))
    return counts


def _tool_name(item: dict[str, Any]) -> str:
    kind = str(item["type"])
    if kind == "mcp_tool_call":
        return f"{item.get('server', 'mcp')}.{item.get('tool', 'unknown')}"
    return TOOL_ITEMS.get(kind, kind)


def _failed(item: dict[str, Any]) -> bool:
    if item.get("status") == "failed" or item.get("error"):
        return True
    return item.get("type") == "command_execution" and item.get("exit_code") not in (0, None)


class CodexHarness:
    """Codex headless against the capture proxy; see the module docstring for the setup."""

    name = "codex"
    package = PACKAGE
    dialect = Dialect(shell_tool="exec_command", command_key="cmd")

    def __init__(self, *, context_tokens: int | None = None) -> None:
        """``context_tokens``: the served model's context window as Codex should believe it."""
        self.context_tokens = context_tokens

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
        """``step_limit`` is not Codex's to enforce (see the module docstring)."""
        codex_home = f"{sandbox.home.rstrip('/')}/.codex"
        config = build_config(endpoint, context_tokens=self.context_tokens)
        await sandbox.write_file(f"{codex_home}/config.toml", config, mode=0o600)
        result, log = await run_logged(
            sandbox,
            build_command(agent_path(sandbox, PACKAGE), instruction, sandbox.workdir),
            env={"CODEX_HOME": codex_home, API_KEY_VARIABLE: endpoint.session_id},
            log_path=f"{AGENT_LOG_DIR}/{LOG_NAME}",
            timeout_s=timeout_s,
        )
        record = recorded_calls(await _rollout(sandbox, codex_home, log))
        return AgentRun(result=result, log=log, tools=parse_tool_counts(log), record=record)


def thread_id(log: str) -> str | None:
    """The Codex thread of a run, from its ``thread.started`` event."""
    return next((str(e["thread_id"]) for e in json_lines(log) if e.get("type") == "thread.started"), None)


async def _rollout(sandbox: Sandbox, codex_home: str, log: str) -> str | None:
    """The run's rollout file (module docstring), or None where it cannot be had."""
    thread = thread_id(log)
    if thread is None:
        return None
    find = ["find", f"{codex_home}/sessions", "-name", f"rollout-*-{thread}.jsonl"]
    try:
        found = await sandbox.exec(shlex.join(find), timeout_s=ROLLOUT_TIMEOUT_S)
        paths = found.stdout.splitlines()
        return (await sandbox.read_file(paths[0])).decode("utf-8", errors="replace") if paths else None
    except Exception:  # no record is a verdict of its own, never a failed rollout
        return None
