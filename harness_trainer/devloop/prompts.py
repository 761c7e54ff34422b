"""The dev loop's compact agent prompt: mini-swe-agent told what it must know in ~60 tokens, not ~1,000.

Stock ``mini.yaml`` wraps every task in about 1,000 tokens of workflow advice and examples. On a 2-core CPU
those tokens are most of what each turn prefills, what the warm-up fine-tunes over, and what each GRPO
step forwards, while the tiny model reads none of it. The dev loop therefore runs mini-swe-agent with
:data:`MINI_SWE_AGENT_COMPACT` (through the harness's ``agent_config``): the same agent, tool, parser and
submit command, with prompts that keep only the rules the agent enforces. The rules come before the task,
so every task's prompt starts with the same ids (a warm-up forwards them once; an engine's prefix cache
keeps them). ``harness-trainer dev --stock-prompt`` runs mini.yaml's own prompts instead.

qwen-code's and gemini-cli's own system prompts and default tools take about 15,000 of the tiny model's
16,000-token context, so the dev loop offers each its shell tool alone and a smaller output cap
(:data:`COMPACT_HARNESS_OPTIONS`).
Harnesses without an entry run with their own prompts and tools.
"""

from __future__ import annotations

from typing import Any

from harness_trainer.harnesses.gemini_cli import GeminiCliHarness
from harness_trainer.harnesses.mini_swe_agent import SUBMIT_COMMAND, MiniSweAgentHarness
from harness_trainer.harnesses.qwen_code import QwenCodeHarness
from harness_trainer.rollouts.harness_mix import HarnessValue, harness_mix

MINI_SWE_AGENT_COMPACT: dict[str, Any] = {
    "agent": {
        "system_template": "You are a helpful assistant that can interact with a computer.\n",
        "instance_template": (
            "Solve the task below with the bash tool: one command per response, each run in a new "
            f"subshell. When it is done, submit with `{SUBMIT_COMMAND}` as a command of its own.\n\n"
            "Task: {{task}}\n"
        ),
    }
}
"""mini-swe-agent's ``agent_config`` in the dev loop (see the module docstring)."""

COMPACT_HARNESS_OPTIONS: dict[str, dict[str, Any]] = {
    MiniSweAgentHarness.name: {"agent_config": MINI_SWE_AGENT_COMPACT},
    QwenCodeHarness.name: {"tools": [QwenCodeHarness.dialect.shell_tool], "max_output_tokens": 1024},
    GeminiCliHarness.name: {"tools": [GeminiCliHarness.dialect.shell_tool], "max_output_tokens": 1024},
}


def dev_harness_options(harness: HarnessValue, *, stock_prompt: bool = False) -> dict[str, Any]:
    """The harness options the dev loop runs ``harness`` with: its compact prompt, unless ``stock_prompt``
    or it has none; for several harnesses, each one's under its name."""
    mix = harness_mix(harness)
    if mix.mixed:
        return {name: dev_harness_options(name, stock_prompt=stock_prompt) for name in mix.names}
    return {} if stock_prompt else COMPACT_HARNESS_OPTIONS.get(mix.first, {})
