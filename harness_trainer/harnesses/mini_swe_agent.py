"""mini-swe-agent (pip ``mini-swe-agent``, pinned, in its own venv, with its litellm pinned too) as a harness.

Configuration: the stock ``mini.yaml`` (its own prompts and its single ``bash`` tool) with an overlay,
``~/.harness-trainer/mini-swe-agent/overlay.yaml``, merged on top (``mini -c mini.yaml -c overlay.yaml``).
The overlay is the harness's ``agent_config`` (mini's own keys, e.g. ``agent.instance_template``: other
prompts; none by default) with the rollout's settings over it:
the model is litellm's ``openai/<served model>`` with ``api_base`` = the proxy's ``/v1`` (the session id
travels as ``OPENAI_API_KEY``); ``agent.step_limit`` is the step limit (0 = none, as in mini); the cost
limit is off (``cost_limit: 0``, cost tracking errors ignored: the served model has no price); ``mode:
yolo`` and ``confirm_exit: false`` make it headless. litellm's price map is read locally, never fetched;
mini's global config folder is a private one, so no user ``.env`` leaks in.

Run: ``mini -c mini.yaml -c overlay.yaml -y --exit-immediately -t <instruction> -o <trajectory>`` in the
task's workdir. Its console transcript goes to ``/logs/agent/mini-swe-agent.log`` (the run's ``log``);
its trajectory, ``/logs/agent/mini-swe-agent.traj.json``, gives the tool counts: each action of an
assistant message is one ``bash`` call, failed when its observation has a non-zero return code or an
exception (the stand-in observation of an action that never ran because the agent submitted is not a
failure); a reply whose tool calls mini could not parse (a ``FormatError``) counts each of those calls,
by the name the model gave, as failed. It is also the agent's own record of its model calls
(:func:`recorded_calls`), checked against the capture after the rollout
(:mod:`harness_trainer.rollouts.agreement`).
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
    run_logged,
)
from harness_trainer.harnesses.bundles import agent_path, install_agent
from harness_trainer.harnesses.tools import ToolPackage
from harness_trainer.sandboxes.base import Sandbox

# litellm pinned: mini's range (>=1.75.5) floats to each new release, and importing litellm is most of an
# agent start (mini's imports with 1.76.0: about 3.0 s of CPU here, against 4.4 s with 1.110.2, 2026-12;
# a first dev run starts the agent about 100 times).
PACKAGE = ToolPackage(
    "pip",
    "mini-swe-agent",
    "2.4.6",
    "venv/bin/mini",
    pins=(("litellm", "1.76.0"),),
    requires_python="3.10",
    probe=("--help",),  # no --version; its help names its version
)
LOG_NAME = "mini-swe-agent.log"
TRAJECTORY_NAME = "mini-swe-agent.traj.json"
CONFIG_SECTIONS = ("agent", "model", "environment")
"""The sections of a mini config that ``agent_config`` may set."""
SUBMIT_COMMAND = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
"""The command whose output's first line tells mini the task is done (mini.yaml's instructions)."""
NOT_EXECUTED = "action was not executed"  # mini's stand-in observation after a submit: not a failure
ENV = {
    "MSWEA_CONFIGURED": "true",  # skip the first-run setup wizard
    "MSWEA_SILENT_STARTUP": "1",
    "MSWEA_COST_TRACKING": "ignore_errors",
    "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "3",  # the proxy already retries the engine
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no fetch of litellm's price list at import
}


def build_overlay(
    endpoint: AgentEndpoint,
    *,
    step_limit: int,
    max_output_tokens: int | None = None,
    command_timeout_s: int | None = None,
    agent_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The config merged over mini.yaml for one rollout: ``agent_config`` with the rollout's settings
    (see the module docstring) merged over it."""
    model_kwargs: dict[str, Any] = {"api_base": endpoint.base_url, "drop_params": True}
    if max_output_tokens is not None:
        model_kwargs["max_tokens"] = max_output_tokens
    overlay: dict[str, Any] = {
        "agent": {"step_limit": max(step_limit, 0), "cost_limit": 0, "mode": "yolo", "confirm_exit": False},
        "model": {
            "model_name": f"openai/{endpoint.model}",
            "cost_tracking": "ignore_errors",
            "model_kwargs": model_kwargs,
        },
    }
    if command_timeout_s is not None:
        overlay["environment"] = {"timeout": command_timeout_s}
    return _merged(agent_config or {}, overlay)


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` merged into ``base`` key by key, nested mappings merged too (as mini merges its ``-c``s)."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


def check_agent_config(agent_config: Any) -> dict[str, Any]:
    """``agent_config`` as JSON-able mini config sections (``agent``, ``model``, ``environment``).

    Raises:
        ValueError: not a mapping of those sections to mappings, or not JSON-serialisable.
    """
    if not isinstance(agent_config, dict):
        raise ValueError(f"agent_config must be a mapping of mini config sections, got {agent_config!r}")
    unknown = sorted(set(agent_config) - set(CONFIG_SECTIONS))
    if unknown or not all(isinstance(v, dict) for v in agent_config.values()):
        raise ValueError(
            f"agent_config: sections must be mappings, from {', '.join(CONFIG_SECTIONS)}; got "
            f"{', '.join(f'{k}: {type(v).__name__}' for k, v in agent_config.items())}"
        )
    try:
        json.dumps(agent_config)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"agent_config is not JSON-serialisable: {exc}") from None
    return agent_config


def build_command(binary: str, instruction: str, overlay_path: str, trajectory_path: str) -> list[str]:
    return [
        binary,
        *("-c", "mini.yaml", "-c", overlay_path),
        *("-y", "--exit-immediately"),
        *("-t", instruction, "-o", trajectory_path),
    ]


def parse_trajectory(text: str) -> ToolCounts:
    """Tool calls from a mini-swe-agent trajectory (JSON); an unreadable one counts nothing."""
    counts = ToolCounts()
    try:
        data = json.loads(text)
    except ValueError:
        return counts
    messages = data.get("messages") if isinstance(data, dict) else None
    for message in messages if isinstance(messages, list) else []:
        if not isinstance(message, dict):
            continue
        extra = message.get("extra") or {}
        role = message.get("role")
        if role == "assistant":
            for _action in extra.get("actions") or []:
                counts.add("bash")
        elif role == "tool" and extra.get("exception_info") != NOT_EXECUTED:
            returncode = extra.get("returncode")
            counts.failures += int(returncode not in (0, None) or bool(extra.get("exception_info")))
        elif extra.get("interrupt_type") == "FormatError":
            for name in _raw_tool_names(extra.get("response")):
                counts.add(name, failed=True)
    return counts


def recorded_calls(text: str) -> list[list[dict[str, Any]]] | None:
    """The messages mini sent in each model call, from its trajectory (None: unreadable or absent).

    Every call's raw response is kept on the message it produced (``extra.response``): the assistant's
    reply, or, when mini could not parse the reply's tool calls, the format error it answers with (the
    reply itself is then left out of the history). A call sent the messages before that one, without
    their ``extra`` (what mini strips before sending).
    """
    try:
        data = json.loads(text)
    except ValueError:
        return None
    messages = data.get("messages") if isinstance(data, dict) else None
    if not isinstance(messages, list):
        return None
    calls = []
    for index, message in enumerate(messages):
        if isinstance(message, dict) and (message.get("extra") or {}).get("response") is not None:
            sent = messages[:index]
            calls.append([{k: v for k, v in m.items() if k != "extra"} for m in sent if isinstance(m, dict)])
    return calls


def _raw_tool_names(response: Any) -> list[str]:
    """The tool names in a raw chat completion the agent could not use."""
    try:
        calls = response["choices"][0]["message"].get("tool_calls") or []
        return [str((call.get("function") or {}).get("name") or "unknown") for call in calls]
    except (KeyError, IndexError, TypeError, AttributeError):
        return []


class MiniSweAgentHarness:
    """mini-swe-agent headless against the capture proxy; see the module docstring for the setup."""

    name = "mini-swe-agent"
    package = PACKAGE
    dialect = Dialect(submit_command=SUBMIT_COMMAND)

    def __init__(
        self,
        *,
        max_output_tokens: int | None = None,
        command_timeout_s: int | None = None,
        agent_config: dict[str, Any] | None = None,
    ) -> None:
        """``max_output_tokens``: ``max_tokens`` per call (None: the engine's default);
        ``command_timeout_s``: the limit of one bash action (None: mini's own, 30 s); ``agent_config``:
        mini config merged over mini.yaml (its sections ``agent``, ``model``, ``environment``; e.g. other
        prompt templates), under the rollout's own settings.

        Raises:
            ValueError: ``agent_config`` is not such a mapping (:func:`check_agent_config`).
        """
        self.max_output_tokens = max_output_tokens
        self.command_timeout_s = command_timeout_s
        self.agent_config = None if agent_config is None else check_agent_config(agent_config)

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
        private = f"{sandbox.home.rstrip('/')}/.harness-trainer/mini-swe-agent"
        overlay_path = f"{private}/overlay.yaml"
        overlay = build_overlay(
            endpoint,
            step_limit=step_limit,
            max_output_tokens=self.max_output_tokens,
            command_timeout_s=self.command_timeout_s,
            agent_config=self.agent_config,
        )
        await sandbox.write_file(overlay_path, json.dumps(overlay, indent=2))  # JSON is YAML
        trajectory_path = f"{AGENT_LOG_DIR}/{TRAJECTORY_NAME}"
        await sandbox.write_file(trajectory_path, b"")  # no stale trajectory survives
        env = {**ENV, "OPENAI_API_KEY": endpoint.session_id, "MSWEA_GLOBAL_CONFIG_DIR": private}
        command = build_command(agent_path(sandbox, PACKAGE), instruction, overlay_path, trajectory_path)
        result, log = await run_logged(
            sandbox, command, env=env, log_path=f"{AGENT_LOG_DIR}/{LOG_NAME}", timeout_s=timeout_s
        )
        try:
            trajectory = (await sandbox.read_file(trajectory_path)).decode("utf-8", errors="replace")
        except FileNotFoundError:
            trajectory = ""
        return AgentRun(
            result=result, log=log, tools=parse_trajectory(trajectory), record=recorded_calls(trajectory)
        )
