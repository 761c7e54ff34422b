"""The white-box model step against the dev engine on the tiny model: real sampling (the ``engine`` process)
and scripted replies (``scripted_engine``, the dev engine app replaying fixed ids with the model's own
logprobs), driven by OpenEnv's own MCP harness adapter."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("openenv")
pytest.importorskip("trl")

from openenv.core.env_server.mcp_types import Tool
from openenv.core.harness import (
    HarnessRunLimits,
    MCPHarnessAdapter,
    ResourceSession,
    ToolResult,
    VerifyResult,
)
from transformers import AutoTokenizer

from capture_proxy.sampling import SamplingPolicy
from harness_trainer.dev_engine.process import EngineProcess
from harness_trainer.net import free_port
from harness_trainer.trace import dump_trace, load_trace
from harness_trainer.trainer.step.rows import build_rows, row_stats
from harness_trainer.whitebox.episode import EmptyEpisode, build_trace, extends
from harness_trainer.whitebox.model_step import (
    PARSE_ERROR_TOOL,
    AnswersParseErrors,
    EngineCallError,
    TokenModelStep,
    TurnRecord,
)
from tests.whitebox.conftest import ScriptedEngine

BASH = Tool(
    name="bash",
    description="Run a shell command.",
    input_schema={"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
)
CALL_LS = '<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call><|im_end|>'
DONE = "Done.<|im_end|>"


class ListingSession(ResourceSession):
    """One user message and a ``bash`` tool that always lists the same files."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.closed = False

    def initial_messages(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": "List the files."}]

    def list_tools(self) -> list[Tool]:
        return [BASH]

    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        self.calls.append((name, arguments))
        return ToolResult(data="a.txt\nb.txt")

    def verify(self, transcript: list[dict[str, Any]], final_state: Any | None = None) -> VerifyResult:
        return VerifyResult(env_reward=1.0, done=True)

    def close(self) -> None:
        self.closed = True


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def make_step(tokenizer: Any, url: str, **overrides: Any) -> TokenModelStep:
    options: dict[str, Any] = {
        "policy": SamplingPolicy(temperature=1.0, seed=7),
        "context_budget": 4096,
        "max_completion_tokens": 64,
    }
    return TokenModelStep(tokenizer, url, "tiny", **{**options, **overrides})


def direct_completion(url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """The engine's own seeded ``/v1/completions`` reply for ``prompt``, as :func:`make_step`'s policy
    samples it (temperature 1, seed 7), to compare a turn with."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "seed": 7,
            "logprobs": 0, "return_token_ids": True}  # fmt: skip
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    reply.raise_for_status()
    return reply.json()


def run_episode(step: TokenModelStep, max_turns: int = 4, **limits: Any) -> tuple[Any, AnswersParseErrors]:
    session = AnswersParseErrors(ListingSession())
    result = MCPHarnessAdapter().run_white_box(step, session, HarnessRunLimits(max_turns=max_turns, **limits))
    return result, session


def test_a_turn_is_the_engines_own_ids_and_logprobs(engine: EngineProcess, tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "Say something."}]
    with make_step(tokenizer, engine.url, max_completion_tokens=12) as step:
        before = time.time()
        result = step(messages, [], {})
        after = time.time()
        episode = step.trace()
    prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert result.prompt_ids == list(prompt)
    direct = direct_completion(engine.url, list(prompt), max_tokens=12)
    assert result.completion_ids == direct["choices"][0]["token_ids"]
    assert result.logprobs == direct["choices"][0]["logprobs"]["token_logprobs"]
    assert len(result.completion_ids) == len(result.logprobs) > 0
    record = step.records[0]
    assert record.weight_version == httpx.get(f"{engine.url}/weight_version").json()["weight_version"]
    assert record.finish_reason == direct["choices"][0]["finish_reason"]
    assert record.sampling["temperature"] == 1.0
    # The call's own interval, on the trace as the capture proxy stamps a black-box call: the model time.
    assert record.started_at is not None and record.finished_at is not None
    assert before <= record.started_at < record.finished_at <= after
    meta = episode.trace.turns[0].metadata
    assert (meta["started_at"], meta["finished_at"]) == (record.started_at, record.finished_at)


def test_turns_that_extend_each_other_build_one_root_and_one_row(
    scripted_engine: ScriptedEngine, tokenizer: Any
) -> None:
    scripted_engine.script(CALL_LS, DONE)
    with make_step(tokenizer, scripted_engine.url) as step:
        result, session = run_episode(step, sampling={"temperature": 0.3, "top_p": 0.5})
        episode = step.trace()
    assert result.done and session.inner.calls == [("bash", {"cmd": "ls"})]
    first, second = episode.trace.turns
    assert extends(second.prompt_token_ids, first.prompt_token_ids, first.completion_token_ids)
    assert second.metadata["parent"] == first.node_id and second.metadata["root"] == first.node_id
    assert episode.metrics["whitebox/retemplated_turns"] == 0 and episode.metrics["whitebox/roots"] == 1
    assert scripted_engine.worker.prompts == [first.prompt_token_ids, second.prompt_token_ids]
    rows = build_rows(episode.trace, temperature=1.0)  # the pinned policy's, not the adapter's 0.3
    assert len(rows) == 1 and row_stats(episode.trace, rows).roots == 1
    assert rows[0].n_targets == len(first.completion_token_ids) + len(second.completion_token_ids)
    assert first.metadata["agent_params"] == {"temperature": 0.3, "top_p": 0.5}


def test_a_well_formed_tool_call_is_parsed_from_the_sampled_ids(
    scripted_engine: ScriptedEngine, tokenizer: Any
) -> None:
    text = (
        'I will look.\n<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls -a"}}\n</tool_call><|im_end|>'
    )
    scripted_engine.script(text)
    with make_step(tokenizer, scripted_engine.url) as step:
        result = step([{"role": "user", "content": "Look."}], [BASH], {})
    assert result.response.content == "I will look."
    [call] = result.response.tool_calls
    assert (call.name, call.args) == ("bash", {"cmd": "ls -a"})
    assert result.completion_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert step.records[0].finish_reason == "stop" and step.records[0].parse_error is None


def test_a_template_that_rewrites_history_starts_a_new_root_and_is_counted(
    scripted_engine: ScriptedEngine, tiny_model_dir: Path
) -> None:
    rewriting = AutoTokenizer.from_pretrained(tiny_model_dir)
    from trl.chat_template_utils import add_response_schema

    add_response_schema(rewriting)  # parse with the Qwen parser, then render past turns another way
    # Like a template that strips past reasoning: a past assistant turn's text is re-rendered upper-cased.
    rewriting.chat_template = rewriting.chat_template.replace(
        "{{- '\\n' + message.content }}", "{{- '\\n' + message.content | upper }}"
    )
    assert "| upper" in rewriting.chat_template
    scripted_engine.script("Let me look.\n" + CALL_LS, DONE)
    with make_step(rewriting, scripted_engine.url) as step:
        result, _ = run_episode(step)
        episode = step.trace()
    assert result.done
    first, second = episode.trace.turns
    assert not extends(second.prompt_token_ids, first.prompt_token_ids, first.completion_token_ids)
    assert second.metadata["parent"] is None and second.metadata["root"] == second.node_id
    assert second.metadata["retemplated"] is True
    assert episode.metrics["whitebox/retemplated_turns"] == 1 and episode.metrics["whitebox/roots"] == 2
    rows = build_rows(episode.trace)
    assert row_stats(episode.trace, rows).roots == 2 and len(rows) == 2
    # Each row trains its own turn, on the ids the engine saw for that call.
    assert [row.input_ids for row in rows] == [
        turn.prompt_token_ids + turn.completion_token_ids for turn in episode.trace.turns
    ]


def test_a_malformed_tool_call_comes_back_to_the_model_as_a_parse_error_and_is_counted(
    scripted_engine: ScriptedEngine, tokenizer: Any
) -> None:
    broken = '<tool_call>\n{"name": "bash", "arguments": {"cmd": \n</tool_call><|im_end|>'
    scripted_engine.script(broken, DONE)
    with make_step(tokenizer, scripted_engine.url) as step:
        result, session = run_episode(step)
        episode = step.trace()
    assert result.done and session.inner.calls == []  # the session's own tools never saw it
    [entry] = result.tool_trace
    assert entry.tool_name == PARSE_ERROR_TOOL and entry.result.error
    tool_message = next(m for m in result.messages if m["role"] == "tool")
    assert "could not be parsed" in tool_message["content"]
    assert episode.metrics["whitebox/parse_errors"] == 1 and episode.metrics["whitebox/tool_calls"] == 0
    first, second = episode.trace.turns
    assert first.metadata["parse_error"] and second.metadata["parse_error"] is None
    # The history now holds the stand-in call, not what was sampled: the next turn is a new root.
    assert second.metadata["retemplated"] and episode.metrics["whitebox/retemplated_turns"] == 1
    assert first.loss_mask.count(1) == len(first.completion_token_ids)  # still trained on


def test_the_context_budget_ends_the_episode_cleanly_with_the_turns_it_had(
    scripted_engine: ScriptedEngine, tokenizer: Any
) -> None:
    prompt = tokenizer.apply_chat_template(
        ListingSession().initial_messages(),
        tools=[{"type": "function", "function": {"name": "bash", "description": BASH.description,
                                                 "parameters": BASH.input_schema}}],
        add_generation_prompt=True, tokenize=True, return_dict=False,
    )  # fmt: skip
    reply = len(tokenizer(CALL_LS, add_special_tokens=False)["input_ids"])
    scripted_engine.script(CALL_LS, CALL_LS, DONE)
    with make_step(tokenizer, scripted_engine.url, context_budget=len(prompt) + reply + 3) as step:
        result, session = run_episode(step)
        episode = step.trace()
    assert result.done and len(session.inner.calls) == 1
    assert len(scripted_engine.worker.prompts) == 1  # the second turn was never sent
    assert episode.context_exhausted and episode.metrics["whitebox/context_exhausted"] == 1
    [turn] = episode.trace.turns
    assert turn.metadata["context_exhausted"] is True
    assert len(build_rows(episode.trace)) == 1  # still trainable
    assert load_trace(dump_trace(episode.trace)) == episode.trace


def test_a_completion_is_capped_by_the_room_left_in_the_budget(
    scripted_engine: ScriptedEngine, tokenizer: Any
) -> None:
    messages = [{"role": "user", "content": "Talk."}]
    prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    scripted_engine.script("one two three four five six seven eight nine ten<|im_end|>")
    with make_step(tokenizer, scripted_engine.url, context_budget=len(prompt) + 4) as step:
        result = step(messages, [], {})
        episode = step.trace()
    assert len(result.completion_ids) == 4 and step.records[0].finish_reason == "length"
    assert episode.context_exhausted
    assert step(messages, [], {}).completion_ids == []  # refused, not sent


def test_an_engine_that_is_not_there_raises_engine_call_error(tokenizer: Any) -> None:
    with make_step(tokenizer, f"http://127.0.0.1:{free_port()}", timeout_s=5) as step:
        with pytest.raises(EngineCallError, match="did not answer"):
            step([{"role": "user", "content": "hi"}], [], {})


def test_an_engine_that_returns_no_ids_raises_engine_call_error(tokenizer: Any) -> None:
    reply = {"choices": [{"text": "hi", "finish_reason": "stop", "logprobs": None}]}
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=reply))
    with make_step(tokenizer, "http://engine", transport=transport) as step:
        with pytest.raises(EngineCallError, match="no token ids"):
            step([{"role": "user", "content": "hi"}], [], {})


def record(prompt: list[int], completion: list[int]) -> TurnRecord:
    return TurnRecord(prompt, completion, [-0.5] * len(completion), "stop", 3, {"temperature": 1.0})


def test_hand_built_turns_that_do_not_extend_start_a_new_root() -> None:
    episode = build_trace([record([1, 2], [3]), record([1, 2, 3, 4], [5]), record([1, 9], [6])])
    assert [t.metadata["root"] for t in episode.trace.turns] == ["turn-0", "turn-0", "turn-2"]
    assert [t.metadata["depth"] for t in episode.trace.turns] == [0, 1, 0]
    assert episode.metrics["whitebox/retemplated_turns"] == 1
    assert episode.trace.turns[0].metadata["weight_version"] == 3


def test_an_episode_with_no_turn_has_no_trace() -> None:
    with pytest.raises(EmptyEpisode):
        build_trace([], context_exhausted=True)


def test_the_request_is_token_ids_under_the_pinned_policy_and_vllm_replies_take_the_pushed_version(
    tokenizer: Any,
) -> None:
    completion = tokenizer("Hi.<|im_end|>", add_special_tokens=False)["input_ids"]
    sent: list[dict[str, Any]] = []

    def vllm(request: httpx.Request) -> httpx.Response:  # vLLM's completions shape: no weight_version
        sent.append(json.loads(request.content))
        choice = {
            "text": "Hi.",
            "token_ids": completion,
            "finish_reason": "stop",
            "logprobs": {"token_logprobs": [-0.25] * len(completion)},
        }
        return httpx.Response(200, json={"choices": [choice]})  # fmt: skip

    policy = SamplingPolicy(temperature=0.7, seed=3, max_tokens=9)
    with make_step(tokenizer, "http://engine/v1", policy=policy, transport=httpx.MockTransport(vllm)) as step:
        step.policy_version = 5
        result = step([{"role": "user", "content": "hi"}], [], {"temperature": 0.1, "max_tokens": 999})
    [body] = sent
    assert body["prompt"] == result.prompt_ids and body["model"] == "tiny"
    assert (body["temperature"], body["top_p"], body["seed"], body["max_tokens"]) == (0.7, 1.0, 3, 9)
    assert body["return_token_ids"] and body["logprobs"] == 0
    assert result.completion_ids == completion and result.response.content == "Hi."
    assert step.records[0].weight_version == 5


def test_chat_template_kwargs_reach_the_template(tiny_model_dir: Path) -> None:
    from trl.chat_template_utils import add_response_schema

    noted = add_response_schema(AutoTokenizer.from_pretrained(tiny_model_dir))
    noted.chat_template = "{{- note | default('') }}" + noted.chat_template
    messages = [{"role": "user", "content": "hi"}]
    with make_step(noted, "http://unused", chat_template_kwargs={"note": "NOTE"}) as step:
        assert noted.decode(step.render(messages, [])).startswith("NOTE<|im_start|>system")


def test_the_adapters_turn_limit_ends_the_episode_with_a_valid_trace(
    scripted_engine: ScriptedEngine, tokenizer: Any
) -> None:
    scripted_engine.script(CALL_LS, CALL_LS)
    with make_step(tokenizer, scripted_engine.url) as step:
        result, session = run_episode(step, max_turns=2)
        episode = step.trace()
    assert not result.done and len(session.inner.calls) == 2
    assert episode.metrics["whitebox/turns"] == 2 and episode.metrics["whitebox/roots"] == 1
    assert not episode.context_exhausted and len(build_rows(episode.trace)) == 1
