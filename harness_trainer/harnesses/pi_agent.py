"""pi (npm ``@mariozechner/pi-coding-agent``, pinned) as a harness.

Configuration: a private agent folder, ``~/.harness-trainer/pi/agent`` in the sandbox's ``HOME``, named by
``PI_CODING_AGENT_DIR`` (pi's default is ``~/.pi/agent``), holding ``models.json`` and ``settings.json``.
``models.json`` declares one provider, ``harness``, with ``api: "openai-completions"`` (Chat Completions),
``baseUrl`` = the proxy's ``/v1`` and ``apiKey`` = ``HARNESS_TRAINER_API_KEY``: pi reads a key that names
an environment variable from that variable, which holds the capture session id (a literal key would be
run as a shell command if it began with ``!``). Its one model is the served model, ``reasoning: false``;
``maxTokens`` caps each call's ``max_tokens``; ``compat`` makes the request plain Chat Completions (a
``system`` message, not ``developer``; ``max_tokens``, not ``max_completion_tokens``; no ``store``,
``reasoning_effort`` or per-tool ``strict``). ``settings.json`` turns install telemetry off, and
compaction (a summarising model call of its own) off unless ``context_tokens`` says how large the context
is (then written as the model's ``contextWindow``).

Run: ``pi --offline --provider harness --model <served> --tools read,bash,edit,write --no-extensions
--no-skills --no-prompt-templates --no-themes --session-dir /logs/agent/pi-sessions --mode json -p
<instruction>`` in the task's workdir. ``--offline`` (and ``PI_OFFLINE=1``, ``PI_SKIP_VERSION_CHECK=1``,
``PI_TELEMETRY=0``) stops its startup network traffic: the version check, package update checks and the
install ping. Only the file and shell tools are offered: the others (``grep``, ``find``) download ``rg``
and ``fd`` from GitHub on first use. Extensions, skills and prompt templates are not discovered (neither
from the agent folder nor from ``~/.agents`` or the workdir's ``.pi``); ``AGENTS.md`` / ``CLAUDE.md``
context files of the task's own tree are read, as pi reads them anywhere. pi has no step limit of its own:
the rollout's model-call budget (the capture session's ``max_model_calls``) bounds it.

pi takes no ``--``: an instruction that begins with ``-`` or ``@`` (an option, a file to attach) is passed
after a newline, the only change it sees. Its JSON event stream goes to ``/logs/agent/pi.jsonl``: each
``tool_execution_start`` is one call, failed when its ``tool_execution_end`` says ``isError``. pi also
keeps its own session file, ``/logs/agent/pi-sessions/<timestamp>_<uuid>.jsonl`` (a header, then one
``message`` entry per user, assistant and tool-result message, linked by ``id``/``parentId``).
"""

from __future__ import annotations

import json
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

VERSION = "0.73.1"
PACKAGE = ToolPackage(
    "npm", "@mariozechner/pi-coding-agent", VERSION, "node_modules/.bin/pi",
    pins=tuple((f"@mariozechner/{name}", VERSION) for name in ("pi-ai", "pi-agent-core", "pi-tui")),
)  # fmt: skip
"""Its sister packages are pinned too: pi asks for ``^0.73.1`` of each, which would float."""
PROVIDER_ID = "harness"
API_KEY_VARIABLE = "HARNESS_TRAINER_API_KEY"
DEFAULT_TOOLS = ("read", "bash", "edit", "write")
LOG_NAME = "pi.jsonl"
SESSION_DIR = f"{AGENT_LOG_DIR}/pi-sessions"
ENV = {"PI_OFFLINE": "1", "PI_SKIP_VERSION_CHECK": "1", "PI_TELEMETRY": "0"}
COMPAT = {
    "supportsStore": False,
    "supportsDeveloperRole": False,
    "supportsReasoningEffort": False,
    "supportsStrictMode": False,
    "supportsUsageInStreaming": True,
    "maxTokensField": "max_tokens",
}


def build_models(
    endpoint: AgentEndpoint, *, max_output_tokens: int, context_tokens: int | None = None
) -> dict[str, Any]:
    """models.json for one rollout (see the module docstring)."""
    model: dict[str, Any] = {
        "id": endpoint.model,
        "name": endpoint.model,
        "reasoning": False,
        "input": ["text"],
        "maxTokens": max_output_tokens,
    }
    if context_tokens is not None:
        model["contextWindow"] = context_tokens
    provider = {
        "baseUrl": endpoint.base_url,
        "api": "openai-completions",
        "apiKey": API_KEY_VARIABLE,
        "compat": COMPAT,
        "models": [model],
    }
    return {"providers": {PROVIDER_ID: provider}}


def build_settings(*, context_tokens: int | None = None) -> dict[str, Any]:
    """settings.json: telemetry off; compaction only when the context's size is known."""
    return {
        "defaultProvider": PROVIDER_ID,
        "enableInstallTelemetry": False,
        "quietStartup": True,
        "compaction": {"enabled": context_tokens is not None},
    }


def build_command(binary: str, instruction: str, model: str, *, tools: tuple[str, ...]) -> list[str]:
    argv = [binary, "--offline", "--provider", PROVIDER_ID, "--model", model, "--tools", ",".join(tools)]
    argv += ["--no-extensions", "--no-skills", "--no-prompt-templates", "--no-themes"]
    argv += ["--session-dir", SESSION_DIR, "--mode", "json", "-p"]
    return [*argv, _as_message(instruction)]


def _as_message(instruction: str) -> str:
    """``instruction`` as pi reads a message argument (it would take ``-x`` for an option, ``@x`` for a
    file to attach; ``---`` it already reads as text)."""
    if instruction.startswith("@") or (instruction.startswith("-") and not instruction.startswith("---")):
        return "\n" + instruction
    return instruction


def parse_tool_counts(log: str) -> ToolCounts:
    """Tool calls by name from ``pi --mode json`` events; non-JSON lines are skipped."""
    counts = ToolCounts()
    started: set[str] = set()
    failed: set[str] = set()
    for event in json_lines(log):
        kind = event.get("type")
        key = str(event.get("toolCallId") or "")
        if kind == "tool_execution_start" and key not in started:
            started.add(key)
            counts.add(str(event.get("toolName") or "unknown"))
        elif kind == "tool_execution_end" and event.get("isError") is True:
            failed.add(key)
    counts.failures = len(failed & started)
    return counts


class PiHarness:
    """pi headless against the capture proxy; see the module docstring for the setup."""

    name = "pi"
    package = PACKAGE
    dialect = Dialect()  # its bash tool takes `command` alone; a reply without a tool call ends the run

    def __init__(
        self,
        *,
        max_output_tokens: int = 4096,
        context_tokens: int | None = None,
        tools: tuple[str, ...] | list[str] = DEFAULT_TOOLS,
    ) -> None:
        """``max_output_tokens``: ``max_tokens`` per call; ``context_tokens``: the model's context as pi
        should believe it (None: unknown, pi's default of 128000 and no compaction); ``tools``: the
        built-in tools offered."""
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
        """``step_limit`` is not pi's to enforce (see the module docstring)."""
        agent_dir = f"{sandbox.home.rstrip('/')}/.harness-trainer/pi/agent"
        models = build_models(
            endpoint, max_output_tokens=self.max_output_tokens, context_tokens=self.context_tokens
        )
        settings = build_settings(context_tokens=self.context_tokens)
        await sandbox.write_file(f"{agent_dir}/models.json", json.dumps(models, indent=2), mode=0o600)
        await sandbox.write_file(f"{agent_dir}/settings.json", json.dumps(settings, indent=2), mode=0o600)
        result, log = await run_logged(
            sandbox,
            build_command(agent_path(sandbox, PACKAGE), instruction, endpoint.model, tools=self.tools),
            env={**ENV, "PI_CODING_AGENT_DIR": agent_dir, API_KEY_VARIABLE: endpoint.session_id},
            log_path=f"{AGENT_LOG_DIR}/{LOG_NAME}",
            timeout_s=timeout_s,
        )
        return AgentRun(result=result, log=log, tools=parse_tool_counts(log), record=recorded_calls(log))


def recorded_calls(log: str) -> list[list[dict[str, Any]]] | None:
    """The messages pi sent in each model call, from its ``agent_end`` event (every message of the run),
    in Chat Completions' shape; None without one (a run that did not end). pi keeps no system prompt
    there, so the calls hold none (:mod:`harness_trainer.rollouts.agreement` then compares without it).
    Each assistant message is one call's reply; the call sent the messages before it."""
    ended = [event for event in json_lines(log) if event.get("type") == "agent_end"]
    messages = ended[-1].get("messages") if ended else None
    if not isinstance(messages, list):
        return None
    chat = [_chat_message(m) for m in messages if isinstance(m, dict)]
    return [chat[:index] for index, message in enumerate(chat) if message["role"] == "assistant"]


def _chat_message(message: dict[str, Any]) -> dict[str, Any]:
    """One of pi's messages (user, assistant, toolResult) as Chat Completions writes it."""
    blocks = message.get("content")
    blocks = [{"type": "text", "text": blocks}] if isinstance(blocks, str) else blocks or []
    text = "".join(b.get("text", "") for b in blocks if isinstance(b, dict) and b.get("type") == "text")
    role = message.get("role")
    if role == "toolResult":
        return {"role": "tool", "tool_call_id": message.get("toolCallId"), "content": text}
    if role != "assistant":
        return {"role": str(role), "content": text}
    calls = [
        {"id": b.get("id"), "type": "function",
         "function": {"name": b.get("name"), "arguments": json.dumps(b.get("arguments", {}))}}
        for b in blocks if isinstance(b, dict) and b.get("type") == "toolCall"
    ]  # fmt: skip
    return {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}
