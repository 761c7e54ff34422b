"""The built-in white-box adapter for coding tasks: a plain ReAct loop over the session's tools.

:class:`ReActAdapter` is an OpenEnv ``HarnessAdapter`` for the trainer's ``harness_adapter=``. One episode:

1. The messages are a system prompt for coding tasks (:data:`DEFAULT_SYSTEM_PROMPT`, or the constructor's;
   None for none), then the session's ``initial_messages()`` (the task's instruction); the tools are the
   session's ``list_tools()``, given to the model in its native tool-call format (the chat template renders
   them; the model step parses the reply's calls).
2. Each turn calls ``model_step(messages, tools, limits.sampling)`` and runs the reply's tool calls in order
   through ``session.call_tool`` (at most ``limits.max_tool_calls_per_turn`` of them; calls past the cap
   are dropped), each result appended as a ``tool`` message. A tool's mistake is a result the model reads
   next turn. A reply whose tool call could not be parsed (the model step's
   :data:`~harness_trainer.whitebox.model_step.PARSE_ERROR_TOOL` call) is answered with an error result
   saying how to write a call (:class:`~harness_trainer.whitebox.model_step.AnswersParseErrors`), and the
   episode goes on.
3. The episode ends, and ``metrics["stop_reason"]`` says why, on the first of: a tool result with ``done``
   set (the ``submit`` tool's: ``"submitted"``); a reply with no tool call (``"no_tool_call"``; also the
   empty reply the trainer's model step gives once the context budget or the episode's time is spent);
   ``limits.max_total_tool_calls`` reached (``"max_total_tool_calls"``); ``limits.max_turns`` replies
   (``"max_turns"``).
4. It returns OpenEnv's ``HarnessRolloutResult``: the whole transcript (system prompt included), the tool
   trace, the events, the concatenated prompt / completion ids and logprobs, ``done`` (True for the first
   two stop reasons), and ``metrics``: ``turns`` (replies sampled), ``tool_calls`` (tools run, parse errors
   included), ``parse_errors`` and ``stop_reason``.

Why a subclass of OpenEnv's ``MCPHarnessAdapter`` and not a loop of its own: that loop already is a ReAct
loop with exactly rules 2 and 3 (its turn and tool-call caps, ``done`` results, the events and id
bookkeeping), so this adapter only adds what it lacks: the system prompt and the parse-error answers (a view
of the session, :class:`_CodingSession`) and the metrics it does not keep (the stop reason; ``turns`` and
``tool_calls`` also when it stops at ``max_total_tool_calls``, where it returns before counting them). A
copy of the loop would drift from OpenEnv's for no behaviour gained.
"""

from __future__ import annotations

from typing import Any, Literal

from harness_trainer.whitebox.model_step import PARSE_ERROR_TOOL, AnswersParseErrors

try:
    from openenv.core.harness import (
        HarnessRolloutResult,
        HarnessRunLimits,
        MCPHarnessAdapter,
        Message,
        ModelStep,
        ResourceSession,
    )
except ImportError as exc:  # an optional extra, as for the model step
    raise ImportError(
        "harness_trainer.whitebox.react needs the `openenv` and `trl` extras: "
        "pip install 'harness-trainer[openenv,trl]'"
    ) from exc

DEFAULT_SYSTEM_PROMPT = (
    "You are a coding agent working in a sandbox. Act only through tool calls: bash runs a shell "
    "command; read_file, write_file and list_dir work on files. Take one step at a time and read each "
    "result before the next. When the task is done, call submit."
)
"""The system prompt :class:`ReActAdapter` uses unless given another: it names the sandbox's tools
(:mod:`harness_trainer.sandboxes.tools`), says to act with tool calls and to call ``submit`` when done."""

StopReason = Literal["submitted", "no_tool_call", "max_total_tool_calls", "max_turns"]


class _CodingSession(AnswersParseErrors):
    """The session as the loop sees it: the system prompt before its messages, parse errors answered."""

    def __init__(self, inner: ResourceSession, system_prompt: str | None) -> None:
        super().__init__(inner)
        self.system_prompt = system_prompt

    def initial_messages(self) -> list[Message]:
        messages = list(self.inner.initial_messages())
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages


class ReActAdapter(MCPHarnessAdapter):
    """A ReAct loop over the session's tools, white-box only (contract in the module docstring).

    Args:
        system_prompt: the system message put before the session's messages; None or empty for none.
    """

    def __init__(self, system_prompt: str | None = DEFAULT_SYSTEM_PROMPT) -> None:
        self.system_prompt = system_prompt

    def run_white_box(
        self,
        model_step: ModelStep,
        session: ResourceSession,
        limits: HarnessRunLimits | None = None,
    ) -> HarnessRolloutResult:
        """Run one episode with the trainer sampling each turn; see the module docstring."""
        result = super().run_white_box(model_step, _CodingSession(session, self.system_prompt), limits)
        result.metrics["turns"] = sum(event.type == "model_response" for event in result.events)
        result.metrics["tool_calls"] = len(result.tool_trace)
        trace = result.tool_trace
        result.metrics["parse_errors"] = sum(entry.tool_name == PARSE_ERROR_TOOL for entry in trace)
        result.metrics["stop_reason"] = stop_reason(result)
        return result

    def run_black_box(self, session: ResourceSession, limits: HarnessRunLimits | None = None) -> Any:
        """Not supported: the loop needs the trainer's model step."""
        raise NotImplementedError(
            "ReActAdapter is a white-box harness: the trainer samples each turn (run_white_box). To run an "
            "agent that owns its loop, use a black-box session factory (HarborSessionFactory or "
            "LocalSessionFactory with harness=...) without harness_adapter="
        )


def stop_reason(result: HarnessRolloutResult) -> StopReason:
    """Why OpenEnv's MCP loop ended ``result`` (rule 3 of the module docstring), read from what it recorded:
    it flags ``truncated`` at the tool-call cap; otherwise the last event is a ``tool_call`` whose result
    was ``done``, a reply without tool calls, or neither (the turn cap)."""
    if result.metrics.get("truncated"):
        return "max_total_tool_calls"
    last = result.events[-1] if result.events else None
    if last is not None and last.type == "tool_call" and last.payload.get("done"):
        return "submitted"
    if last is not None and last.type == "model_response" and not last.payload.get("tool_calls"):
        return "no_tool_call"
    return "max_turns"


def react_trainer_options(max_turns: int = 0) -> dict[str, Any]:
    """The trainer's white-box keywords for the built-in adapter: ``harness_adapter`` (a
    :class:`ReActAdapter`) and ``harness_limits`` (``max_turns`` turns; 0: OpenEnv's default)."""
    limits = HarnessRunLimits(max_turns=max_turns) if max_turns else HarnessRunLimits()
    return {"harness_adapter": ReActAdapter(), "harness_limits": limits}
