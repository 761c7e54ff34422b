"""opencode (npm ``opencode-ai``, pinned) as a harness.

Configuration (written to ``~/.harness-trainer/opencode/opencode.json`` in the sandbox and named by
``OPENCODE_CONFIG``): one provider, ``harness``, built on ``@ai-sdk/openai-compatible`` (a provider named
``openai`` would switch opencode to the Responses API) whose ``baseURL`` is the proxy's ``/v1`` and whose
``apiKey`` is the capture session id; the served model is the only model, for the main and the small
model alike; ``limit.output`` caps what it asks per call (opencode asks for 32000 tokens otherwise, more
than small contexts hold). The tools that spawn nested sessions (``task``) or reach the web
(``webfetch``, ``websearch``, ``codesearch``) are removed and denied; autoupdate and sharing are off;
``agent.build.steps`` is the step limit (opencode then forces a text-only last answer).

Run: ``opencode run --auto --format json --title <fixed> -- <instruction>`` in the task's workdir (the
fixed title means no title-generation call; ``--auto`` approves what the config does not deny: the
sandbox is the boundary). Its JSON event log goes to ``/logs/agent/opencode.jsonl``; each ``tool_use``
event is one tool call, failed when its ``state.status`` is ``error``.

Its own record of its model calls (:func:`recorded_calls`): opencode keeps a run's messages and their parts
in its SQLite database (``~/.local/share/opencode/opencode.db``); after the run ``opencode export
<sessionID>`` (the id is on every JSON event) prints them as JSON, ``{"info": …, "messages": [{"info":
{"role", "error", …}, "parts": [...]}]}``. Each model call is one step of an assistant message (its parts
from a ``step-start`` to the ``step-finish``: text, ``tool`` parts with ``callID``, ``tool``,
``state.input`` and ``state.output`` or ``state.error``); the call sent the user's text and every earlier
step's reply and tool results. The record holds no system prompt. Nor does it hold the assistant
message opencode appends to the call it makes at its step limit (its fixed "maximum steps reached"
instruction, with tools off): that call reads as a mismatch of one message.

Before the first start, opencode installs ``@opencode-ai/plugin`` from npm into its config folder (64 MB,
in the background, at every start with a fresh ``HOME``). The run writes that folder's
``package.json``, ``package-lock.json`` and an empty ``node_modules`` first, which opencode takes as
"already installed": no rollout touches npm.
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
from harness_trainer.harnesses.tools import NativeBinary, ToolPackage
from harness_trainer.sandboxes.base import Sandbox

PACKAGE = ToolPackage(
    "npm", "opencode-ai", "1.18.33", "node_modules/.bin/opencode",
    native=NativeBinary("opencode-linux-x64", "1.18.33", "bin/opencode"),
)  # fmt: skip
PROVIDER_ID = "harness"
TITLE = "harness-trainer rollout"
NO_TRAINING_TOOLS = ("task", "webfetch", "websearch", "codesearch")
LOG_NAME = "opencode.jsonl"
EXPORT_TIMEOUT_S = 60.0
INTERRUPTED = "[Tool execution was interrupted]"  # what opencode sends for a tool that never finished
CLEARED = "[Old tool result content cleared]"  # what it sends for an output it compacted away
ENV = {
    "OPENCODE_DISABLE_AUTOUPDATE": "1",
    "OPENCODE_DISABLE_SHARE": "1",
    "OPENCODE_DISABLE_MODELS_FETCH": "1",  # the bundled model catalogue; no fetch from models.dev
    "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
    "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
    "OPENCODE_DISABLE_CLAUDE_CODE": "1",  # do not read ~/.claude instructions
}


def build_config(
    endpoint: AgentEndpoint, *, step_limit: int, max_output_tokens: int, context_tokens: int = 0
) -> dict[str, Any]:
    """opencode.json for one rollout (see the module docstring); ``step_limit`` 0 means none."""
    config: dict[str, Any] = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            PROVIDER_ID: {
                "npm": "@ai-sdk/openai-compatible",
                "name": "harness-trainer capture proxy",
                "options": {"baseURL": endpoint.base_url, "apiKey": endpoint.session_id},
                "models": {
                    endpoint.model: {
                        "name": endpoint.model,
                        "tool_call": True,
                        "limit": {"context": context_tokens, "output": max_output_tokens},
                    }
                },
            }
        },
        "model": f"{PROVIDER_ID}/{endpoint.model}",
        "small_model": f"{PROVIDER_ID}/{endpoint.model}",
        "enabled_providers": [PROVIDER_ID],
        "autoupdate": False,
        "share": "disabled",
        "tools": dict.fromkeys(NO_TRAINING_TOOLS, False),
        "permission": dict.fromkeys(NO_TRAINING_TOOLS, "deny"),
    }
    if step_limit > 0:
        config["agent"] = {"build": {"steps": step_limit}}
    return config


def build_command(binary: str, instruction: str) -> list[str]:
    return [binary, "run", "--auto", "--format", "json", "--title", TITLE, "--", instruction]


def plugin_stub_files() -> dict[str, str]:
    """Files that make opencode's config folder look as if its plugin package were installed."""
    dependency = {"@opencode-ai/plugin": PACKAGE.version}
    lock = {"lockfileVersion": 3, "packages": {"": {"dependencies": dependency}}}
    return {"package.json": json.dumps({"dependencies": dependency}), "package-lock.json": json.dumps(lock)}


def parse_tool_counts(log: str) -> ToolCounts:
    """Tool calls by name from ``opencode run --format json`` output; non-JSON lines are skipped."""
    counts = ToolCounts()
    seen: set[str] = set()
    for event in json_lines(log):
        if event.get("type") != "tool_use":
            continue
        part = event.get("part") or {}
        key = str(part.get("callID") or part.get("id") or len(seen))
        if key in seen:
            continue
        seen.add(key)
        status = (part.get("state") or {}).get("status")
        counts.add(str(part.get("tool") or "unknown"), failed=status == "error")
    return counts


class OpencodeHarness:
    """opencode headless against the capture proxy; see the module docstring for the exact setup."""

    name = "opencode"
    package = PACKAGE
    dialect = Dialect(bash_arguments=(("description", "Solve the task"),))  # its bash tool requires one

    def __init__(self, *, max_output_tokens: int = 4096, context_tokens: int = 0) -> None:
        """``max_output_tokens``: opencode's per-call ``max_tokens``; ``context_tokens``: the model's
        context as opencode should believe it (0 = unknown: opencode never compacts on its own)."""
        self.max_output_tokens = max_output_tokens
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
        config = build_config(
            endpoint,
            step_limit=step_limit,
            max_output_tokens=self.max_output_tokens,
            context_tokens=self.context_tokens,
        )
        home = sandbox.home.rstrip("/")
        config_path = f"{home}/.harness-trainer/opencode/opencode.json"
        await sandbox.write_file(config_path, json.dumps(config, indent=2), mode=0o600)
        for name, text in plugin_stub_files().items():
            await sandbox.write_file(f"{home}/.config/opencode/{name}", text)
        await sandbox.write_file(f"{home}/.config/opencode/node_modules/.keep", b"")
        binary = agent_path(sandbox, PACKAGE)
        env = {**ENV, "OPENCODE_CONFIG": config_path}
        result, log = await run_logged(
            sandbox,
            build_command(binary, instruction),
            env=env,
            log_path=f"{AGENT_LOG_DIR}/{LOG_NAME}",
            timeout_s=timeout_s,
        )
        record = recorded_calls(await _export(sandbox, binary, env, log))
        return AgentRun(result=result, log=log, tools=parse_tool_counts(log), record=record)


def session_id(log: str) -> str | None:
    """The opencode session of a run, from its JSON events."""
    return next((str(e["sessionID"]) for e in json_lines(log) if e.get("sessionID")), None)


async def _export(sandbox: Sandbox, binary: str, env: dict[str, str], log: str) -> str | None:
    """``opencode export`` of the run's session (its stdout), or None where it cannot be had."""
    session = session_id(log)
    if session is None:
        return None
    try:
        exported = await sandbox.exec(
            f"{shlex.join([binary, 'export', session])} < /dev/null",
            timeout_s=EXPORT_TIMEOUT_S,
            env=env,
            cwd=sandbox.workdir,
        )
    except Exception:  # no record is a verdict of its own, never a failed rollout
        return None
    return exported.stdout if exported.exit_code == 0 and not exported.timed_out else None


def recorded_calls(export: str | None) -> list[list[dict[str, Any]]] | None:
    """The messages opencode sent in each model call, from ``opencode export`` (module docstring), in
    Chat Completions' shape; None without a readable export. Each ``step-start`` begins a call, which sent
    the user's text and every earlier step's reply (text and tool calls) and tool results. An assistant
    message opencode leaves out of later calls (one that failed with nothing to show) still was a call."""
    try:
        data = json.loads(export[export.index("{") :]) if export else None
    except ValueError:
        return None
    messages = data.get("messages") if isinstance(data, dict) else None
    if not isinstance(messages, list):
        return None
    history: list[dict[str, Any]] = []
    calls: list[list[dict[str, Any]]] = []
    for message in messages:
        info, parts = _info_and_parts(message)
        if info.get("role") == "user":
            text = "".join(
                str(p.get("text") or "") for p in parts if p.get("type") == "text" and not p.get("ignored")
            )
            if text:
                history.append({"role": "user", "content": text})
            continue
        if info.get("role") != "assistant":
            continue
        kept = _kept_in_history(info, parts)
        steps: list[list[dict[str, Any]]] = []
        for part in parts:
            if part.get("type") == "step-start":
                if kept and steps:
                    history.extend(_step(steps[-1]))
                calls.append(list(history))
                steps.append([])
            elif steps:
                steps[-1].append(part)
        if kept and steps:
            history.extend(_step(steps[-1]))
    return calls


def _info_and_parts(message: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    if not isinstance(message, dict):
        return {}, []
    info = message.get("info") if isinstance(message.get("info"), dict) else {}
    parts = message.get("parts") if isinstance(message.get("parts"), list) else []
    return info, [p for p in parts if isinstance(p, dict)]


def _kept_in_history(info: dict[str, Any], parts: list[dict[str, Any]]) -> bool:
    """Whether opencode sends this assistant message again: not one that failed, unless it was aborted
    after it had said or done something."""
    error = info.get("error")
    if not error:
        return True
    aborted = isinstance(error, dict) and error.get("name") == "MessageAbortedError"
    return aborted and any(p.get("type") not in ("step-start", "reasoning") for p in parts)


def _step(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One step's reply and its tool results, as Chat Completions messages."""
    text = "".join(str(p.get("text") or "") for p in parts if p.get("type") == "text")
    tools = [p for p in parts if p.get("type") == "tool"]
    calls = [
        {"id": p.get("callID"), "type": "function",
         "function": {"name": p.get("tool"), "arguments": json.dumps(_input(p))}}
        for p in tools
    ]  # fmt: skip
    reply = {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}
    results = [{"role": "tool", "tool_call_id": p.get("callID"), "content": _tool_output(p)} for p in tools]
    return [reply, *results]


def _tool_output(part: dict[str, Any]) -> str:
    """A tool's result as opencode sends it."""
    state = part.get("state") or {}
    status = state.get("status")
    if status == "completed":
        return CLEARED if (state.get("time") or {}).get("compacted") else str(state.get("output") or "")
    if status == "error":
        metadata = state.get("metadata") or {}
        if metadata.get("interrupted") is True and isinstance(metadata.get("output"), str):
            return str(metadata["output"])
        return str(state.get("error") or "")
    return INTERRUPTED


def _input(part: dict[str, Any]) -> Any:
    input_ = (part.get("state") or {}).get("input")
    return input_ if input_ is not None else {}
