"""aider (pip ``aider-chat``, pinned, in its own venv) as a harness.

aider has no tool calls: its model edits files through a text edit format and proposes shell commands as
fenced ``bash`` blocks. The harness uses the ``diff`` format (SEARCH/REPLACE blocks; the only one whose
parser also takes shell blocks): a reply names a file on a line of its own, then a fenced block of
``<<<<<<< SEARCH`` / ``=======`` / ``>>>>>>> REPLACE`` (an empty SEARCH part creates the file), and a
```` ```bash ```` block is a shell command aider runs in the workdir.

Configuration: a private folder, ``~/.harness-trainer/aider`` of the sandbox's ``HOME``, holding an empty
config file (``--config``) and an empty ``--env-file``, and the model's metadata (``--model-metadata-file``:
its context and output sizes, no price), so that aider never fetches litellm's price list (its metadata is
local, and ``LITELLM_LOCAL_MODEL_COST_MAP`` keeps litellm's own at home). The model is litellm's
``openai/<served model>`` with ``OPENAI_API_BASE`` = the proxy's ``/v1`` and ``OPENAI_API_KEY`` = the
capture session id; the weak and editor models are the same one.

Off: git (``--no-git``, so no commits and no commit-message calls), the repo map (``--map-tokens 0``, a
side call's worth of context for a scripted model), streaming and pretty output, analytics, update checks,
release notes, model warnings, URL detection (no web fetch), the browser GUI, notifications, file watching,
linting and tests after edits, chat-history restore.

Confirmations: ``--yes-always`` answers yes to everything but running a proposed shell command, which aider
asks for explicitly; so no ``--yes-always``: the agent's stdin is ``yes``'s endless ``y`` (the sandbox is
the boundary), which accepts creating and editing files, running the command and adding its output to
the chat. With ``--message`` aider answers that one message and exits; a reply whose edits do not apply
is reflected back to the model (a further call, up to aider's own limit of 3), so no step limit of its own.

Run: ``aider --message <instruction> …`` in the task's workdir; its console goes to
``/logs/agent/aider.log`` (the run's ``log``), its chat and input histories beside it. The tool counts
come from the console: each ``Applied edit to <file>`` is one ``edit``, each ``Running <command>`` one
``shell``; a reply aider could not apply (``did not conform to the edit format``) is one failed ``edit``
(each at a line's start or after the confirmation prompt it answers: stdin's answers are not echoed).
"""

from __future__ import annotations

import json
import re
import shlex
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

PACKAGE = ToolPackage("pip", "aider-chat", "0.86.2", "venv/bin/aider", requires_python=">=3.10,<3.13")
"""The release's own ``Requires-Python``: an image whose ``python3`` is 3.13 or later cannot run it, which
its bundle's setup says by name (:mod:`.bundle_installer`) rather than as pip's "no matching distribution"."""
LOG_NAME = "aider.log"
CHAT_HISTORY_NAME = "aider.chat.history.md"
INPUT_HISTORY_NAME = "aider.input.history"
CONFIG_DIR = ".harness-trainer/aider"
"""The private folder, relative to the sandbox's ``HOME``."""
EDIT_FORMAT = "diff"
SHELL_FENCE = "bash"
"""The info string of the fenced block aider takes as a shell command."""
_ANSWERED = r"^(?:.*\]: )?"  # a console line, after the confirmation it follows when there is one
EDITED = re.compile(_ANSWERED + r"Applied edit to \S")
RAN = re.compile(_ANSWERED + r"Running \S")
UNAPPLIED = re.compile(_ANSWERED + r"The LLM did not conform to the edit format")
ENV = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no fetch of litellm's price list
    "AIDER_CHECK_UPDATE": "false",
    "AIDER_ANALYTICS": "false",
    "NO_COLOR": "1",
    "TERM": "dumb",  # no prompt toolkit: confirmations read stdin line by line
}
OFF_FLAGS = (
    "--no-git",
    "--no-auto-commits",
    "--no-dirty-commits",
    "--no-gitignore",
    "--no-check-update",
    "--no-show-release-notes",
    "--no-analytics",
    "--no-pretty",
    "--no-stream",
    "--no-fancy-input",
    "--no-show-model-warnings",
    "--no-check-model-accepts-settings",
    "--no-detect-urls",
    "--no-notifications",
    "--no-auto-lint",
    "--no-auto-test",
    "--no-restore-chat-history",
    "--disable-playwright",
)


def build_metadata(endpoint: AgentEndpoint, *, context_tokens: int, max_output_tokens: int) -> dict[str, Any]:
    """The model-metadata file: the served model's sizes (litellm's keys), no price."""
    return {
        f"openai/{endpoint.model}": {
            "max_input_tokens": context_tokens,
            "max_output_tokens": max_output_tokens,
            "max_tokens": max_output_tokens,
            "input_cost_per_token": 0.0,
            "output_cost_per_token": 0.0,
            "litellm_provider": "openai",
            "mode": "chat",
        }
    }


def build_env(endpoint: AgentEndpoint) -> dict[str, str]:
    """The environment that points aider's litellm at the proxy (the key is the capture session id)."""
    return {**ENV, "OPENAI_API_BASE": endpoint.base_url, "OPENAI_API_KEY": endpoint.session_id}


def build_command(binary: str, instruction: str, endpoint: AgentEndpoint, *, private: str) -> list[str]:
    """The aider command line, run under ``yes`` (see the module docstring); the instruction is one
    ``--message=`` argument, so one that starts with ``-`` is never read as an option."""
    model = f"openai/{endpoint.model}"
    argv = [
        binary,
        *("--config", f"{private}/aider.conf.yml", "--env-file", f"{private}/aider.env"),
        *("--model", model, "--weak-model", model, "--editor-model", model),
        *("--model-metadata-file", f"{private}/model-metadata.json"),
        *("--edit-format", EDIT_FORMAT, "--map-tokens", "0", "--suggest-shell-commands"),
        *OFF_FLAGS,
        *("--chat-history-file", f"{AGENT_LOG_DIR}/{CHAT_HISTORY_NAME}"),
        *("--input-history-file", f"{AGENT_LOG_DIR}/{INPUT_HISTORY_NAME}"),
        f"--message={instruction}",
    ]
    return ["bash", "-c", f"yes | exec {shlex.join(argv)}"]


def parse_tool_counts(log: str) -> ToolCounts:
    """Edits and shell commands from aider's console (see the module docstring)."""
    counts = ToolCounts()
    for line in log.splitlines():
        if EDITED.match(line):
            counts.add("edit")
        elif RAN.match(line):
            counts.add("shell")
        elif UNAPPLIED.match(line):
            counts.add("edit", failed=True)
    return counts


class AiderHarness:
    """aider headless against the capture proxy; see the module docstring for the setup."""

    name = "aider"
    package = PACKAGE
    dialect = Dialect(shell_fence=SHELL_FENCE)  # a text reply; aider answers one message, then exits

    def __init__(self, *, max_output_tokens: int = 4096, context_tokens: int = 32768) -> None:
        """``max_output_tokens``: the output size aider assumes for the served model; ``context_tokens``:
        the context window it assumes."""
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
        private = f"{sandbox.home.rstrip('/')}/{CONFIG_DIR}"
        metadata = build_metadata(
            endpoint, context_tokens=self.context_tokens, max_output_tokens=self.max_output_tokens
        )
        await sandbox.write_file(f"{private}/model-metadata.json", json.dumps(metadata, indent=2))
        await sandbox.write_file(f"{private}/aider.conf.yml", b"{}\n")  # an empty YAML mapping
        await sandbox.write_file(f"{private}/aider.env", b"")
        for name in (CHAT_HISTORY_NAME, INPUT_HISTORY_NAME):
            await sandbox.write_file(f"{AGENT_LOG_DIR}/{name}", b"")  # no stale history survives
        result, log = await run_logged(
            sandbox,
            build_command(agent_path(sandbox, PACKAGE), instruction, endpoint, private=private),
            env=build_env(endpoint),
            log_path=f"{AGENT_LOG_DIR}/{LOG_NAME}",
            timeout_s=timeout_s,
        )
        return AgentRun(result=result, log=log, tools=parse_tool_counts(log))
