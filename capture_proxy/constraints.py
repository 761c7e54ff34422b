"""Refuse constrained decoding before anything is forwarded or counted.

Logit bias, token allow/deny lists, guided or structured output, a forced tool choice and ``min_tokens``
all change the distribution the engine samples from, so the behaviour logprobs it returns would no longer
describe the policy being trained. Such a request is answered with a 400 that names the field, before any
budget is spent. Checked on the agent's own parameters, after its dialect mapped them to Chat Completions
names (dialects refuse their own spellings, e.g. Anthropic's ``tool_choice: any``).
"""

from __future__ import annotations

from typing import Any

from capture_proxy.dialects.base import DialectError

_GUIDED = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "structured_outputs",
    "allowed_token_ids",
    "bad_words",
    "logit_bias",
)


def refuse_constrained(params: dict[str, Any]) -> None:
    """Raise :class:`DialectError` (400) if ``params`` ask for constrained decoding."""
    for name in _GUIDED:
        if params.get(name):
            raise DialectError(
                f"'{name}' is constrained decoding, which the capture proxy refuses: the engine's logprobs "
                "would no longer be the policy's",
                param=name,
            )
    response_format = params.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        raise DialectError(
            f"response_format {response_format.get('type')!r} is structured output (constrained decoding), "
            "which the capture proxy refuses",
            param="response_format",
        )
    min_tokens = params.get("min_tokens")
    if min_tokens:
        raise DialectError(
            "'min_tokens' suppresses end-of-sequence (constrained decoding)", param="min_tokens"
        )
    tool_choice = params.get("tool_choice")
    if tool_choice is not None and tool_choice not in ("auto", "none"):
        raise DialectError(
            f"tool_choice {tool_choice!r} forces a tool call (constrained decoding); use 'auto' or 'none'",
            param="tool_choice",
        )
