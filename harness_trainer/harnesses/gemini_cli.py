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

Its own record of its model calls (:func:`recorded_calls`): gemini-cli always records the conversation, as
``<GEMINI_CLI_HOME>/.gemini/tmp/<project>/chats/session-<time>-<id8>.jsonl`` (``id8``: the first 8
characters of the session id its ``init`` event names). It is a conversation, not a list of calls: a
header, then message records (``user`` with the parts it sent, function responses included; ``gemini``
with the reply's text and, added under the same id once they ran, its ``toolCalls``: ``id``, ``name``,
``args``), ``{"$set": {"messages": [...]}}`` (the history as a whole, e.g. its startup context) and
``{"$rewindTo": id}``. Each ``gemini`` message is one call's reply; the calls are rebuilt from the
messages before it as gemini-cli builds a request: consecutive turns of one role joined, the ``<tool>__``
prefix it adds to call ids taken off again; then read as the proxy's Gemini dialect reads ``contents``
(:mod:`capture_proxy.dialects.gemini`). The record holds no system prompt, and the reply's text only as
gemini-cli keeps it for display (trimmed, HTML comments removed).
"""

from __future__ import annotations

import json
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
CHATS_GLOB = ".gemini/tmp/*/chats/session-*-{short_id}.jsonl"  # under GEMINI_CLI_HOME
TEXT_JOIN = "\n\n"  # how the proxy's Gemini dialect joins a turn's text parts
CALL_ID = "call_{turn}_{index}"  # the proxy's id for a call sent without one
RAW_ARGUMENTS_KEY = "_raw"  # the proxy's wrapper for arguments that are not a JSON object
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
        record = recorded_calls(await _chat_recording(sandbox, config_home, log))
        return AgentRun(result=result, log=log, tools=parse_tool_counts(log), record=record)


async def _chat_recording(sandbox: Sandbox, config_home: str, log: str) -> str | None:
    """The text of the run's chat recording (module docstring), or None where there is none to read."""
    session = next((str(e.get("session_id")) for e in json_lines(log) if e.get("type") == "init"), "")
    short_id = session[:8]
    if len(short_id) < 8 or not short_id.isalnum():  # a UUID's first 8: no character the shell would read
        return None
    pattern = f"{shlex.quote(config_home)}/{CHATS_GLOB.format(short_id=short_id)}"
    try:
        found = await sandbox.exec(f"ls -1 {pattern}", timeout_s=30, cwd=sandbox.workdir)
        paths = found.stdout.split() if found.exit_code == 0 else []
        return (await sandbox.read_file(paths[-1])).decode("utf-8", errors="replace") if paths else None
    except Exception:  # no record is a verdict of its own, never a failed rollout
        return None


def recorded_calls(text: str | None) -> list[list[dict[str, Any]]] | None:
    """The messages gemini-cli sent in each model call, rebuilt from its chat recording (module docstring)
    in Chat Completions' shape; None without a readable recording. Each ``gemini`` message is one call,
    which sent every ``user`` and ``gemini`` message before it."""
    messages = _conversation(text or "")
    if messages is None:
        return None
    contents = [_content(m) for m in messages if m.get("type") in ("user", "gemini")]
    return [_chat(contents[:i]) for i, content in enumerate(contents) if content["role"] == "model"]


def _conversation(text: str) -> list[dict[str, Any]] | None:
    """The recording's messages as gemini-cli loads them: a record with a known id replaces that message
    in place, ``$set.messages`` replaces them all, ``$rewindTo`` drops that message and the ones after it.
    None without a header (not a recording)."""
    messages: dict[str, dict[str, Any]] = {}
    header = False
    for record in json_lines(text):
        if isinstance(record.get("$rewindTo"), str):
            ids = list(messages)
            cut = ids.index(record["$rewindTo"]) if record["$rewindTo"] in ids else 0
            messages = {key: messages[key] for key in ids[:cut]}
        elif isinstance(record.get("id"), str):
            messages[record["id"]] = record
        elif isinstance(record.get("$set"), dict) and isinstance(record["$set"].get("messages"), list):
            listed = [
                m for m in record["$set"]["messages"] if isinstance(m, dict) and isinstance(m.get("id"), str)
            ]
            messages = {m["id"]: m for m in listed}
        elif isinstance(record.get("sessionId"), str):
            header = True
    return list(messages.values()) if header else None


def _content(message: dict[str, Any]) -> dict[str, Any]:
    """One recorded message as the Gemini ``Content`` gemini-cli keeps in its history."""
    content = message.get("content")
    parts = [{"text": content}] if isinstance(content, str) else list(content or [])
    parts = [p for p in parts if isinstance(p, dict) and p.get("text") != ""]
    if message.get("type") == "user":
        return {"role": "user", "parts": parts}
    calls = [c for c in message.get("toolCalls") or [] if isinstance(c, dict)]
    parts += [
        {"functionCall": {"id": c.get("id"), "name": c.get("name"), "args": c.get("args")}} for c in calls
    ]
    return {"role": "model", "parts": parts}


def _chat(contents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Chat Completions messages of one request's ``contents``: consecutive turns of one role joined
    and call ids unprefixed, as gemini-cli sends them; then the proxy's Gemini dialect's reading."""
    joined: list[dict[str, Any]] = []
    for content in contents:
        if joined and joined[-1]["role"] == content["role"]:
            joined[-1] = {"role": content["role"], "parts": joined[-1]["parts"] + content["parts"]}
        else:
            joined.append(content)
    messages: list[dict[str, Any]] = []
    pending: list[tuple[str, str]] = []  # (id, name) of the last model turn's calls not yet answered
    for turn, content in enumerate(joined):
        parts = [_unprefixed(p) for p in content["parts"]]
        if content["role"] == "model":
            messages.append(_assistant(parts, turn))
            pending = [(c["id"], c["function"]["name"]) for c in messages[-1].get("tool_calls", [])]
        else:
            messages.extend(_user(parts, pending))
    return messages


def _unprefixed(part: dict[str, Any]) -> dict[str, Any]:
    """A part with the ``<tool name>__`` prefix gemini-cli adds to call ids taken off (it does so before
    each request)."""
    for key in ("functionCall", "functionResponse"):
        inner = part.get(key)
        if isinstance(inner, dict) and isinstance(inner.get("id"), str):
            prefix = f"{str(inner.get('name') or '').strip() or 'generic_tool'}__"
            return {**part, key: {**inner, "id": inner["id"].removeprefix(prefix)}}
    return part


def _assistant(parts: list[dict[str, Any]], turn: int) -> dict[str, Any]:
    """A model turn (``turn``: its index in the request): its text, its calls with their ids (the proxy's
    for a call sent without one)."""
    texts = [str(p["text"]) for p in parts if "text" in p and p.get("thought") is not True]
    calls = [p["functionCall"] for p in parts if isinstance(p.get("functionCall"), dict)]
    tool_calls = [
        {"id": call.get("id") or CALL_ID.format(turn=turn, index=index), "type": "function",
         "function": {"name": call.get("name"), "arguments": _arguments(call.get("args") or {})}}
        for index, call in enumerate(calls)
    ]  # fmt: skip
    message: dict[str, Any] = {"role": "assistant", "content": TEXT_JOIN.join(texts) if texts else None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    elif message["content"] is None:
        message["content"] = ""
    return message


def _user(parts: list[dict[str, Any]], pending: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """A user turn: its function responses as tool messages for the calls they answer (by id, else the
    first unanswered call of that name), then its text as one user message."""
    messages: list[dict[str, Any]] = []
    texts: list[str] = []
    for part in parts:
        response = part.get("functionResponse")
        if not isinstance(response, dict):
            texts.append(str(part.get("text", "")))
            continue
        answered = next((c for c in pending if response.get("id") and c[0] == response.get("id")), None)
        answered = answered or next((c for c in pending if c[1] == response.get("name")), None)
        if answered is not None:
            pending.remove(answered)
        call_id = answered[0] if answered else response.get("id")
        output = json.dumps(response.get("response") or {}, ensure_ascii=False)
        messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
    if texts or not messages:
        messages.append({"role": "user", "content": TEXT_JOIN.join(texts)})
    return messages


def _arguments(args: Any) -> str:
    raw = args.get(RAW_ARGUMENTS_KEY) if isinstance(args, dict) else None
    return raw if isinstance(raw, str) and len(args) == 1 else json.dumps(args, ensure_ascii=False)
