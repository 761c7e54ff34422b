"""The trainer's model step for white-box rollouts (issue 23): token ids in, token ids out.

OpenEnv's ``HarnessAdapter.run_white_box(model_step, session, limits)`` calls the model step once per
turn with the conversation so far, the session's tools and ``limits.sampling``. :class:`TokenModelStep`
answers each call in this order:

1. **Render** ``messages`` + ``tools`` with the model's chat template (``apply_chat_template``, generation
   prompt added, ``chat_template_kwargs`` passed through), straight to token ids. Tool-call arguments given
   as JSON strings (OpenEnv's ``LLMResponse.to_message_dict`` writes them so) are parsed to objects first,
   as vLLM does, because Qwen-style templates render them with ``tojson`` (the dev engine's own
   ``normalize_messages``).
2. **Budget.** ``room = context_budget - len(prompt)``; with no room left the step samples nothing and
   returns an empty reply (no content, no tool calls), which ends OpenEnv's MCP loop cleanly. The episode
   is marked ``context_exhausted`` and keeps the turns it had. Otherwise it asks for at most
   ``min(max_completion_tokens, room)`` tokens (and no more than the policy's own ``max_tokens``, when set).
3. **Sample** with ``POST /v1/completions``, the prompt given as token ids, under the pinned sampling policy
   (:class:`capture_proxy.sampling.SamplingPolicy`, the black-box one: temperature only, ``top_p`` 1,
   optional seed). The ``sampling`` dict OpenEnv passes is recorded, never applied (as the capture proxy
   records and overrides an agent's own parameters). The reply's ``choices[0].token_ids`` and
   ``logprobs.token_logprobs`` (processed logprobs, one per sampled id) are the turn; text is never
   retokenised. The engine's echo of the prompt ids must equal the ids sent.
4. **Parse** the sampled ids with TRL's ``parse_response(tokenizer, ids, prefix=prompt, tools=...)`` (the
   tokenizer gets TRL's ``add_response_schema`` when it has no response parser yet). A reply that holds the
   tool-call opener (``<tool_call>`` for Qwen) yet parses to no well-formed tool call is a **parse error**:
   the step returns one tool call named :data:`PARSE_ERROR_TOOL` whose arguments carry the reason, so the
   adapter hands an error back to the model instead of ending the episode (wrap the session in
   :class:`AnswersParseErrors` to answer it); it counts as a failed tool call.
5. **Record** the turn (:class:`TurnRecord`): prompt ids, completion ids, logprobs, finish reason, the
   weight version (the reply's ``weight_version``, which the dev engine sends; else :attr:`policy_version`,
   which the trainer sets after each push, as the capture proxy's ``PUT /policy`` does for vLLM).

:meth:`TokenModelStep.trace` builds the episode's :class:`~harness_trainer.trace.TrainingTrace` from the
records (rules in :mod:`harness_trainer.whitebox.episode`). One step object serves one episode.

Errors: an engine that cannot be reached, answers non-200, or returns ids and logprobs that break the
contract raises :class:`EngineCallError` (the rollout is unscorable, not the model's fault).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from capture_proxy.sampling import SamplingPolicy
from harness_trainer.dev_engine.chat import normalize_messages
from harness_trainer.whitebox.episode import WhiteBoxTrace, build_trace

try:
    from openenv.core.env_server.mcp_types import Tool
    from openenv.core.harness import (
        Message,
        ModelStepResult,
        ResourceSession,
        ToolResult,
        VerifyResult,
    )
    from openenv.core.llm_client import LLMResponse, ToolCall
except ImportError as exc:  # an optional extra: only white-box rollouts need it
    raise ImportError(
        "harness_trainer.whitebox needs the `openenv` and `trl` extras: "
        "pip install 'harness-trainer[openenv,trl]'"
    ) from exc

PARSE_ERROR_TOOL = "invalid_tool_call"
"""The name of the tool call a parse error is returned as; :class:`AnswersParseErrors` answers it."""


class EngineCallError(RuntimeError):
    """The engine could not be reached, refused the call, or broke the token-id contract."""


@dataclass
class TurnRecord:
    """One engine call of the episode, as the engine saw and answered it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    """The engine's processed logprob of each completion id (as many)."""
    finish_reason: str
    weight_version: int | None
    """The weights that sampled it: the reply's own version, else the step's ``policy_version``."""
    sampling: dict[str, Any]
    """The policy it was sampled under (``temperature`` is what the trainer checks)."""
    agent_params: dict[str, Any] = field(default_factory=dict)
    """The ``sampling`` dict the adapter passed: recorded, not applied."""
    text: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    parse_error: str | None = None
    """Why the reply's tool call could not be parsed, or None."""
    model: str = ""
    """The served model the call named (the newest adapter's name, with ``lora_sync="adapter"``)."""
    started_at: float | None = None
    finished_at: float | None = None
    """When the engine call was sent and answered (unix seconds), as the capture proxy stamps a black-box
    call: the rollout's model time (``perf/rollout_llm_s``) is their union."""


class TokenModelStep:
    """OpenEnv's ``ModelStep`` over an OpenAI-compatible engine's ``/v1/completions`` (contract above).

    Raises (on construction):
        ValueError: a budget that leaves no room, or a chat template TRL has no response parser for.
    """

    def __init__(
        self,
        tokenizer: Any,
        base_url: str,
        model: str,
        *,
        policy: SamplingPolicy | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        context_budget: int,
        max_completion_tokens: int,
        tool_call_open: str = "<tool_call>",
        timeout_s: float = 300.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if max_completion_tokens < 1 or context_budget < 2:
            raise ValueError(
                f"context_budget {context_budget} and max_completion_tokens {max_completion_tokens} must "
                "leave room for a prompt and at least one sampled token"
            )
        self.tokenizer = _with_response_parser(tokenizer)
        self.model = model
        self.policy = policy or SamplingPolicy()
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.context_budget = context_budget
        self.max_completion_tokens = max_completion_tokens
        self.tool_call_open = tool_call_open
        self.policy_version: int | None = None
        """The weight version the trainer last pushed; recorded when the engine's reply names none."""
        self.records: list[TurnRecord] = []
        self.context_exhausted = False
        base = base_url.rstrip("/").removesuffix("/v1")
        self._client = httpx.Client(base_url=base, timeout=timeout_s, transport=transport)

    def __call__(
        self, messages: list[Message], tools: list[Tool], sampling: dict[str, Any]
    ) -> ModelStepResult:
        """One turn: render, sample by ids, parse, record (steps 1-5 of the module docstring)."""
        tool_dicts = [_openai_tool(tool) for tool in tools]
        prompt_ids = self.render(messages, tool_dicts)
        room = self.context_budget - len(prompt_ids)
        if self.context_exhausted or room < 1:
            self.context_exhausted = True  # nothing sampled: the adapter sees a final, empty reply
            return ModelStepResult(response=LLMResponse(content=""))
        limit = min(self.max_completion_tokens, room, self.policy.max_tokens or room)
        model, started_at = self.model, time.time()
        reply = self._complete(prompt_ids, limit)
        finished_at = time.time()
        completion_ids, logprobs, finish, version = _read_reply(reply, prompt_ids)
        response, parse_error = self._parse(prompt_ids, completion_ids, tool_dicts)
        self.records.append(
            TurnRecord(
                prompt_ids=prompt_ids,
                completion_ids=completion_ids,
                logprobs=logprobs,
                finish_reason=finish,
                weight_version=version if version is not None else self.policy_version,
                sampling=self.policy.model_dump(exclude_none=True),
                agent_params=dict(sampling),
                text=response.content,
                tool_calls=[{"name": call.name, "arguments": call.args} for call in response.tool_calls],
                parse_error=parse_error,
                model=model,
                started_at=started_at,
                finished_at=finished_at,
            )
        )
        if finish == "length" and len(prompt_ids) + len(completion_ids) >= self.context_budget:
            self.context_exhausted = True  # the next turn could not even hold this one's history
        return ModelStepResult(
            response=response, prompt_ids=prompt_ids, completion_ids=completion_ids, logprobs=logprobs
        )

    def render(self, messages: list[Message], tools: list[dict[str, Any]]) -> list[int]:
        """The prompt ids of ``messages`` and ``tools`` under the chat template, generation prompt added."""
        ids = self.tokenizer.apply_chat_template(
            normalize_messages(messages),
            tools=tools or None,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            **self.chat_template_kwargs,
        )
        return list(ids)

    def trace(self) -> WhiteBoxTrace:
        """The episode's validated trace and its counters (see :mod:`harness_trainer.whitebox.episode`)."""
        return build_trace(self.records, context_exhausted=self.context_exhausted)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> TokenModelStep:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _complete(self, prompt_ids: list[int], max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,  # read once per call: the trainer may name a newer adapter between turns
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": self.policy.temperature,
            "top_p": 1.0,
            "n": 1,
            "stream": False,
            "logprobs": 0,  # the sampled token's own logprob, no alternatives
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        if self.policy.seed is not None:
            body["seed"] = self.policy.seed
        try:
            reply = self._client.post("/v1/completions", json=body)
        except httpx.HTTPError as exc:
            raise EngineCallError(f"the engine at {self._client.base_url} did not answer: {exc}") from exc
        if reply.status_code != 200:
            raise EngineCallError(f"the engine answered {reply.status_code}: {reply.text[:500]}")
        return reply.json()

    def _parse(
        self, prompt_ids: list[int], completion_ids: list[int], tools: list[dict[str, Any]]
    ) -> tuple[LLMResponse, str | None]:
        """The reply as OpenEnv's response, and the parse error when its tool call is malformed."""
        from trl.chat_template_utils import parse_response

        parsed = parse_response(self.tokenizer, completion_ids, prefix=prompt_ids, tools=tools or None)
        content = parsed.get("content") or ""
        calls, error = [], None
        for call in parsed.get("tool_calls") or []:
            function = call.get("function", call)
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    arguments = None
            if not isinstance(arguments, dict):
                error = f"the arguments of tool call {function.get('name')!r} are not a JSON object"
                break
            calls.append(ToolCall(id=f"call-{uuid.uuid4().hex[:24]}", name=function["name"], args=arguments))
        raw = self.tokenizer.decode(completion_ids, skip_special_tokens=False)
        if error is None and not calls and self.tool_call_open in raw:
            error = f"the reply opens {self.tool_call_open} but holds no well-formed tool call"
        if error is not None:
            parse_error = ToolCall(
                id=f"call-{uuid.uuid4().hex[:24]}", name=PARSE_ERROR_TOOL, args={"error": error}
            )
            text = self.tokenizer.decode(completion_ids, skip_special_tokens=True)
            return LLMResponse(content=text, tool_calls=[parse_error]), error
        return LLMResponse(content=content, tool_calls=calls), None


class AnswersParseErrors(ResourceSession):
    """A session that answers :data:`PARSE_ERROR_TOOL` calls with an error result; the rest goes to ``inner``.

    The error result's ``data`` is what the model reads next turn (OpenEnv's MCP loop shows it ``data``);
    ``error`` holds the reason, so the call counts as a failed tool call.
    """

    def __init__(self, inner: ResourceSession) -> None:
        self.inner = inner

    def initial_messages(self) -> list[Message]:
        return self.inner.initial_messages()

    def list_tools(self) -> list[Tool]:
        return self.inner.list_tools()

    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        if name != PARSE_ERROR_TOOL:
            return self.inner.call_tool(name, arguments)
        reason = str(arguments.get("error", "malformed tool call"))
        text = (
            f"error: your tool call could not be parsed ({reason}). Write each call as "
            '<tool_call>\n{"name": <tool name>, "arguments": <JSON object>}\n</tool_call>'
        )
        return ToolResult(data=text, error=reason, metadata={"parse_error": True})

    def verify(self, transcript: list[Message], final_state: Any | None = None) -> VerifyResult:
        return self.inner.verify(transcript, final_state)

    def close(self) -> None:
        self.inner.close()


def _with_response_parser(tokenizer: Any) -> Any:
    """The tokenizer, given TRL's response parser for its chat template when it has none (in place)."""
    if getattr(tokenizer, "response_template", None) or getattr(tokenizer, "response_schema", None):
        return tokenizer
    from trl.chat_template_utils import add_response_schema

    return add_response_schema(tokenizer)  # ValueError for a template TRL does not know


def _openai_tool(tool: Tool) -> dict[str, Any]:
    """An MCP tool as the OpenAI function spec chat templates render."""
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": tool.input_schema},
    }


def _read_reply(
    reply: dict[str, Any], prompt_ids: list[int]
) -> tuple[list[int], list[float], str, int | None]:
    """Completion ids, logprobs, finish reason and weight version of a ``/v1/completions`` reply.

    Raises:
        EngineCallError: ids missing, not ints, another prompt echoed, logprobs missing, misaligned,
            not finite or positive.
    """
    try:
        choice = reply["choices"][0]
        ids = choice["token_ids"]
        logprobs = choice["logprobs"]["token_logprobs"]
    except (KeyError, IndexError, TypeError) as exc:
        raise EngineCallError(
            "the engine returned no token ids or logprobs (choices[0].token_ids, "
            "choices[0].logprobs.token_logprobs): serve vLLM with --return-tokens-as-token-ids and "
            "--logprobs-mode processed_logprobs"
        ) from exc
    echoed = choice.get("prompt_token_ids", reply.get("prompt_token_ids"))
    if echoed is not None and echoed != prompt_ids:
        raise EngineCallError("the engine's prompt ids are not the ids sent")
    if not isinstance(ids, list) or any(type(t) is not int or t < 0 for t in ids):
        raise EngineCallError("the engine's completion ids are not non-negative ints")
    if not isinstance(logprobs, list) or len(logprobs) != len(ids):
        raise EngineCallError(f"{len(logprobs or [])} logprobs for {len(ids)} completion ids")
    for value in logprobs:
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value > 0
        ):
            raise EngineCallError(f"the engine returned the logprob {value!r}: not a finite number <= 0")
    version = reply.get("weight_version")
    version = version if type(version) is int else None
    return list(ids), [float(v) for v in logprobs], str(choice.get("finish_reason") or "length"), version
