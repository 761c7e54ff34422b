"""The built-in ReAct adapter: driven by the real ``TokenModelStep`` against the dev engine app replaying
scripted replies (``scripted_engine``, the tiny model's own logprobs), on ``LocalWhiteBoxSessionFactory``
sessions in real local sandboxes on the bundled tasks; and the trainer training with it end to end."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openenv.core.harness")
pytest.importorskip("trl")

from openenv.core.harness import HarnessAdapter, HarnessRunLimits, MCPHarnessAdapter
from transformers import AutoTokenizer

from capture_proxy.sampling import SamplingPolicy
from harness_trainer import HarnessAsyncGRPOTrainer, LocalWhiteBoxSessionFactory, ReActAdapter
from harness_trainer.examples import TASKS as EXAMPLES
from harness_trainer.tasks.sources import LocalTaskSource
from harness_trainer.trainer.config.async_grpo import AsyncGRPOConfig
from harness_trainer.trainer.feed.rollout_log import read_rollout_log
from harness_trainer.trainer.feed.whitebox import check_white_box
from harness_trainer.whitebox.model_step import PARSE_ERROR_TOOL, TokenModelStep
from harness_trainer.whitebox.react import DEFAULT_SYSTEM_PROMPT
from tests.hardening.faults import metrics_lines
from tests.whitebox.conftest import ScriptedEngine

HELLO = "hello-file"
WRITE = (
    '<tool_call>\n{"name": "write_file", "arguments": {"path": "/app/hello.txt", '
    '"content": "Hello, Harbor!\\n"}}\n</tool_call><|im_end|>'
)
SUBMIT = '<tool_call>\n{"name": "submit", "arguments": {"summary": "wrote it"}}\n</tool_call><|im_end|>'
LS = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls /app"}}\n</tool_call><|im_end|>'
TWO_CALLS = (
    '<tool_call>\n{"name": "bash", "arguments": {"command": "echo one"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "bash", "arguments": {"command": "echo two"}}\n</tool_call><|im_end|>'
)
BROKEN = '<tool_call>\n{"name": "bash", "arguments": {"command": \n</tool_call><|im_end|>'
DONE = "Done.<|im_end|>"


def roots(base: Path) -> list[str]:
    return sorted(p.name for p in base.glob("ht-*"))


def loops() -> int:
    """Background loops of LocalWhiteBoxSessionFactory instances still running."""
    return sum(thread.name == "local-whitebox" for thread in threading.enumerate())


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("react-sandboxes")


@pytest.fixture(scope="module")
def factory(base: Path) -> Iterator[LocalWhiteBoxSessionFactory]:
    local = {"local": {"base_dir": str(base)}}
    with LocalWhiteBoxSessionFactory(str(EXAMPLES), split="train", sandbox_options=local) as made:
        yield made
    assert roots(base) == []


def hello_row(factory: LocalWhiteBoxSessionFactory) -> dict[str, Any]:
    return next(row for row in factory.prompt_rows() if row["task_name"] == HELLO)


def episode(
    engine: ScriptedEngine,
    tokenizer: Any,
    factory: LocalWhiteBoxSessionFactory,
    replies: list[str],
    adapter: ReActAdapter | None = None,
    **limits: Any,
) -> tuple[Any, Any, TokenModelStep]:
    """An episode on hello-file with the scripted ``replies``: the adapter's result, the verdict, the step."""
    engine.script(*replies)
    step = TokenModelStep(
        tokenizer, engine.url, "tiny", policy=SamplingPolicy(temperature=1.0), context_budget=4096,
        max_completion_tokens=128,
    )  # fmt: skip
    with step, factory.create(hello_row(factory)) as session:
        result = (adapter or ReActAdapter()).run_white_box(step, session, HarnessRunLimits(**limits))
        verdict = session.verify(result.messages)
    return result, verdict, step


def test_an_episode_ends_on_submit_and_the_written_file_gets_reward_1(
    scripted_engine: ScriptedEngine, tokenizer: Any, factory: LocalWhiteBoxSessionFactory
) -> None:
    result, verdict, step = episode(scripted_engine, tokenizer, factory, [WRITE, SUBMIT], max_turns=4)
    assert result.done and result.metrics["stop_reason"] == "submitted"
    assert result.metrics["turns"] == 2 and result.metrics["tool_calls"] == 2
    assert result.metrics["parse_errors"] == 0
    assert verdict.env_reward == 1.0 and verdict.metrics["submitted"]
    assert verdict.metrics["tool_calls_by_name"] == {"write_file": 1, "submit": 1}
    roles = [m["role"] for m in result.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert result.messages[0]["content"] == DEFAULT_SYSTEM_PROMPT
    assert result.messages[1] == hello_row(factory)["prompt"][0]
    assert [entry.tool_name for entry in result.tool_trace] == ["write_file", "submit"]
    # The model saw the system prompt and the tools in its chat template's own format.
    first_prompt = tokenizer.decode(scripted_engine.worker.prompts[0])
    assert DEFAULT_SYSTEM_PROMPT in first_prompt and '"name": "write_file"' in first_prompt
    # The result's ids are the engine's own, and the second turn extends the first (native format kept).
    assert len(scripted_engine.worker.prompts) == 2
    assert result.completion_ids == [i for record in step.records for i in record.completion_ids]
    assert result.prompt_ids == [i for record in step.records for i in record.prompt_ids]
    assert len(result.logprobs) == len(result.completion_ids)
    trace = step.trace()
    assert len(trace.trace.turns) == 2 and trace.metrics["whitebox/retemplated_turns"] == 0


def test_a_plain_text_reply_ends_the_episode_and_the_system_prompt_is_the_adapters(
    scripted_engine: ScriptedEngine, tokenizer: Any, factory: LocalWhiteBoxSessionFactory
) -> None:
    result, verdict, _ = episode(scripted_engine, tokenizer, factory, [DONE], ReActAdapter("Be brief."))
    assert result.done and result.metrics["stop_reason"] == "no_tool_call"
    assert result.metrics["turns"] == 1 and result.metrics["tool_calls"] == 0 and not result.tool_trace
    assert result.messages[0] == {"role": "system", "content": "Be brief."}
    assert verdict.env_reward == 0.0
    result, _, _ = episode(scripted_engine, tokenizer, factory, [DONE], ReActAdapter(system_prompt=None))
    assert [m["role"] for m in result.messages] == ["user", "assistant"]
    assert DEFAULT_SYSTEM_PROMPT not in tokenizer.decode(scripted_engine.worker.prompts[0])


def test_the_episode_stops_at_max_turns(
    scripted_engine: ScriptedEngine, tokenizer: Any, factory: LocalWhiteBoxSessionFactory
) -> None:
    result, verdict, _ = episode(scripted_engine, tokenizer, factory, [LS, LS, LS], max_turns=2)
    assert not result.done and result.metrics["stop_reason"] == "max_turns"
    assert result.metrics["turns"] == 2 and result.metrics["tool_calls"] == 2
    assert len(scripted_engine.worker.prompts) == 2  # the third reply was never asked for
    assert result.messages[-1]["role"] == "tool"  # the last turn's call ran; no reply was sampled after it
    assert verdict.env_reward == 0.0 and verdict.metrics["tool_calls_by_name"] == {"bash": 2}


def test_tool_calls_are_capped_per_turn_and_in_total(
    scripted_engine: ScriptedEngine, tokenizer: Any, factory: LocalWhiteBoxSessionFactory
) -> None:
    replies = [TWO_CALLS] * 3
    result, verdict, step = episode(
        scripted_engine, tokenizer, factory, replies, max_turns=5, max_tool_calls_per_turn=1,
        max_total_tool_calls=2,
    )  # fmt: skip
    assert [len(record.tool_calls) for record in step.records] == [2, 2, 2]  # each reply parsed two calls
    assert [entry.arguments["command"] for entry in result.tool_trace] == ["echo one", "echo one"]
    assert not result.done and result.metrics["stop_reason"] == "max_total_tool_calls"
    assert result.metrics["turns"] == 3 and result.metrics["tool_calls"] == 2
    assert verdict.metrics["tool_calls_by_name"] == {"bash": 2}


def test_a_malformed_tool_call_is_answered_as_a_parse_error_and_the_episode_goes_on(
    scripted_engine: ScriptedEngine, tokenizer: Any, factory: LocalWhiteBoxSessionFactory
) -> None:
    result, verdict, step = episode(scripted_engine, tokenizer, factory, [BROKEN, WRITE, SUBMIT], max_turns=4)
    assert [entry.tool_name for entry in result.tool_trace] == [PARSE_ERROR_TOOL, "write_file", "submit"]
    assert result.tool_trace[0].result.error is not None
    tool_messages = [m for m in result.messages if m["role"] == "tool"]
    assert "could not be parsed" in tool_messages[0]["content"]  # the model reads how to write a call
    assert result.metrics["parse_errors"] == 1 and result.metrics["stop_reason"] == "submitted"
    assert verdict.env_reward == 1.0
    assert verdict.metrics["tool_calls_by_name"] == {"write_file": 1, "submit": 1}  # the sandbox never saw it
    assert step.trace().metrics["whitebox/parse_errors"] == 1


def test_it_is_white_box_only_and_the_trainer_accepts_it_with_the_local_factory() -> None:
    adapter = ReActAdapter()
    assert isinstance(adapter, HarnessAdapter) and isinstance(adapter, MCPHarnessAdapter)
    with pytest.raises(NotImplementedError, match="white-box harness"):
        adapter.run_black_box(None)  # type: ignore[arg-type]
    check_white_box(adapter, partial(LocalWhiteBoxSessionFactory, str(EXAMPLES), split="train"))


def train_two_steps(scripted_engine: ScriptedEngine, tiny_model_dir: Path, builder: Any, out: Path) -> Path:
    """Two GRPO steps of 2 rollouts on hello-file with the ``ReActAdapter`` over ``builder``'s sessions,
    the engine replaying what the test scripted; the run's output folder."""
    rows = [row for row in LocalTaskSource(EXAMPLES).prompt_rows("train") if row["task_name"] == HELLO]
    config = AsyncGRPOConfig(
        output_dir=str(out), engine="dev", vllm_server_base_url=scripted_engine.url, num_generations=2,
        max_concurrent_rollouts=1, max_staleness=0, max_steps=2, learning_rate=1e-4, disable_tqdm=True,
        rollout_timeout=120, token_budget=4096, seed=7, max_completion_length=128, rollout_log_steps=1,
        drop_zero_variance_groups=False,
    )  # fmt: skip
    trainer = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir), builder, config, train_dataset=rows, harness_adapter=ReActAdapter(),
        harness_limits=HarnessRunLimits(max_turns=4),
    )  # fmt: skip
    trainer.train()
    return out


@pytest.mark.slow
def test_the_trainer_trains_two_steps_with_the_react_adapter_on_local_sessions(
    scripted_engine: ScriptedEngine, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Rollouts alternate: one writes the file and submits (reward 1), the next only answers (reward 0), so
    each group of 2 has an advantage; two steps train and push weights; nothing is left open."""
    scripted_engine.script(*[WRITE, SUBMIT, DONE] * 8)
    running = loops()
    sandboxes = tmp_path / "sandboxes"
    sandboxes.mkdir()
    builder = partial(
        LocalWhiteBoxSessionFactory, str(EXAMPLES), split="train",
        sandbox_options={"local": {"base_dir": str(sandboxes)}},
    )  # fmt: skip
    out = train_two_steps(scripted_engine, tiny_model_dir, builder, tmp_path / "out")

    lines = metrics_lines(out)
    assert [line["step"] for line in lines] == [1, 2]
    assert [line["reward"] for line in lines] == [0.5, 0.5]
    assert all(line["rollout/unscorable"] == 0 and line["policy_version"] == line["step"] for line in lines)
    assert all(line["whitebox/turns"] == 1.5 and line["whitebox/retemplated_turns"] == 0 for line in lines)
    assert all(line["tools/call_frequency"] == 1.0 for line in lines)  # write_file + submit, every other one
    assert scripted_engine.worker.weight_version == 2
    trained = [r for r in read_rollout_log(out) if r.step is not None and r.advantage is not None]
    assert len(trained) == 4 and sorted(r.reward for r in trained) == [0.0, 0.0, 1.0, 1.0]
    for record in trained:
        assert record.trace is not None and record.unscorable is None
        assert len(record.trace.turns) == (2 if record.reward == 1.0 else 1)
        assert record.tool_calls_by_name == ({"write_file": 1, "submit": 1} if record.reward == 1.0 else {})
    assert roots(sandboxes) == [], "a sandbox was left open"
    assert loops() == running, "a factory's loop was left running"
