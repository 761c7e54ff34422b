"""Harness adapters: one module per agent program, registered by name in ``HARNESSES``.

``make_harness(name, **options)`` builds one with the options its class documents. Each adapter
installs its pinned agent (its bundle, :mod:`.bundles`; the network install of :mod:`.tools` is the
fallback), points it at the capture proxy, runs it headless and counts
its tool calls from the agent's own log (:mod:`.base` holds the protocol and the shared types).
"""

from __future__ import annotations

from typing import Any

from harness_trainer.harnesses.aider import AiderHarness
from harness_trainer.harnesses.base import (
    AgentEndpoint,
    AgentRun,
    Dialect,
    Harness,
    HarnessError,
    ToolCounts,
)
from harness_trainer.harnesses.claude_code import ClaudeCodeHarness
from harness_trainer.harnesses.codex import CodexHarness
from harness_trainer.harnesses.gemini_cli import GeminiCliHarness
from harness_trainer.harnesses.mini_swe_agent import MiniSweAgentHarness
from harness_trainer.harnesses.opencode import OpencodeHarness
from harness_trainer.harnesses.pi_agent import PiHarness
from harness_trainer.harnesses.qwen_code import QwenCodeHarness
from harness_trainer.harnesses.toy import ToyHarness

HARNESSES: dict[str, type[Harness]] = {
    "opencode": OpencodeHarness,
    "mini-swe-agent": MiniSweAgentHarness,
    "claude-code": ClaudeCodeHarness,
    "codex": CodexHarness,
    "gemini-cli": GeminiCliHarness,
    "pi": PiHarness,
    "qwen-code": QwenCodeHarness,
    "aider": AiderHarness,
    "toy": ToyHarness,  # a stdlib agent for tests, benchmarks and the dev loop
}


def make_harness(name: str, **options: Any) -> Harness:
    """The harness registered as ``name``, built with ``options`` (the keyword arguments its class
    documents: e.g. mini-swe-agent's ``agent_config``, opencode's ``max_output_tokens``).

    Raises:
        ValueError: an unknown name, or options its class does not take or refuses.
    """
    try:
        harness_class = HARNESSES[name]
    except KeyError:
        raise ValueError(f"unknown harness {name!r}; known: {', '.join(sorted(HARNESSES))}") from None
    try:
        return harness_class(**options)
    except TypeError as exc:
        raise ValueError(f"harness {name!r} does not take options {sorted(options)}: {exc}") from None


__all__ = [
    "HARNESSES",
    "AgentEndpoint",
    "AgentRun",
    "AiderHarness",
    "ClaudeCodeHarness",
    "CodexHarness",
    "Dialect",
    "GeminiCliHarness",
    "Harness",
    "HarnessError",
    "MiniSweAgentHarness",
    "OpencodeHarness",
    "PiHarness",
    "QwenCodeHarness",
    "ToolCounts",
    "ToyHarness",
    "make_harness",
]
