"""The trainer in white-box mode (issue 23): ``harness_adapter=MCPHarnessAdapter()`` over
``WhiteBoxSessionFactory`` against a real ``harness-trainer serve`` process with local sandboxes, the engine
the dev engine app replaying scripted tool calls (``scripted_engine``) with the tiny model's logprobs."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openenv.core.harness")
pytest.importorskip("trl")

from openenv.core.env_server.mcp_types import Tool
from openenv.core.harness import (
    HarnessAdapter,
    HarnessRunLimits,
    MCPHarnessAdapter,
    ResourceSession,
    ResourceSessionFactory,
    ToolResult,
    VerifyResult,
)
from transformers import AutoTokenizer

from capture_proxy.sampling import SamplingPolicy
from harness_trainer import HarnessAsyncGRPOTrainer
from harness_trainer.net import free_port
from harness_trainer.rollouts.client.local_factory import LocalSessionFactory
from harness_trainer.rollouts.client.whitebox_session import WhiteBoxSessionFactory
from harness_trainer.rollouts.errors import RolloutServerBug, RolloutUnscorable
from harness_trainer.trainer.config.async_grpo import AsyncGRPOConfig
from harness_trainer.trainer.feed.failures import AdapterError, FailureKind, is_infrastructure, judge
from harness_trainer.trainer.feed.rollout_log import read_rollout_log
from harness_trainer.trainer.feed.scheduling import RolloutSchedulerError
from harness_trainer.trainer.feed.whitebox import (
    StepSettings,
    WhiteBoxRolloutFactory,
    check_white_box,
    white_box_factory,
)
from harness_trainer.whitebox.model_step import EngineCallError
from tests.hardening.faults import metrics_lines
from tests.rollouts.test_whitebox_server import HELLO, Server
from tests.whitebox.conftest import ScriptedEngine

WRITE = (
    '<tool_call>\n{"name": "write_file", "arguments": {"path": "/app/hello.txt", '
    '"content": "Hello, Harbor!\\n"}}\n</tool_call><|im_end|>'
)
DONE = "Done.<|im_end|>"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = Server(tmp_path_factory.mktemp("whitebox-trainer"))
    yield running
    running.stop()


@pytest.fixture
def builder(server: Server) -> Iterator[Any]:
    yield partial(WhiteBoxSessionFactory, server.url, sandbox="local")
    assert server.open_sessions() == 0, "a session was left open"
    assert server.sandbox_roots() == [], "a sandbox was left open"


def hello_rows(server: Server) -> list[dict[str, Any]]:
    rows = WhiteBoxSessionFactory(server.url, sandbox="local").prompt_rows()
    return [row for row in rows if row["task_name"] == HELLO]


def config(out: Path, engine_url: str, **overrides: Any) -> AsyncGRPOConfig:
    """Groups of 2, one rollout at a time: the scripted replies go out in a fixed order."""
    settings: dict[str, Any] = dict(
        output_dir=str(out), engine="dev", vllm_server_base_url=engine_url, num_generations=2,
        max_concurrent_rollouts=1, max_staleness=0, max_steps=2, learning_rate=1e-4, disable_tqdm=True,
        rollout_timeout=120, token_budget=4096, seed=7, max_completion_length=128, rollout_log_steps=1,
        drop_zero_variance_groups=False,
    )  # fmt: skip
    return AsyncGRPOConfig(**{**settings, **overrides})


@pytest.mark.slow
def test_the_trainer_trains_white_box_rollouts_on_the_engines_ids_and_leaks_nothing(
    scripted_engine: ScriptedEngine, builder: Any, server: Server, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Rollouts alternate: one writes the file through the sandbox's write_file tool (reward 1), the next
    only answers (reward 0), so each group of 2 has an advantage. An evaluation at the start, then two
    steps train, pushing weights to the engine; every trained turn is the ids the engine saw and sampled;
    no session or sandbox is left."""
    scripted_engine.script(*[WRITE, DONE, DONE] * 8)
    out = tmp_path / "out"
    args = config(out, scripted_engine.url, eval_on_start=True, eval_split="train", eval_num_generations=1)
    trainer = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir), builder, args, train_dataset=hello_rows(server), eval_dataset=hello_rows(server),
        harness_adapter=MCPHarnessAdapter(), harness_limits=HarnessRunLimits(max_turns=4),
    )  # fmt: skip
    trainer.train()

    evaluated, *lines = metrics_lines(out)
    # The eval rollout (the eval factory wrapped too) took the first scripted solution.
    assert evaluated["step"] == 0 and evaluated["eval/pass@1"] == 1.0 and evaluated["eval/unscorable"] == 0
    assert [line["step"] for line in lines] == [1, 2]
    assert [line["reward"] for line in lines] == [0.5, 0.5]
    assert all(line["rollout/unscorable"] == 0 and line["policy_version"] == line["step"] for line in lines)
    assert all(line["whitebox/turns"] == 1.5 and line["whitebox/tool_calls"] == 0.5 for line in lines)
    assert all(
        line["whitebox/retemplated_turns"] == 0 and line["tools/call_frequency"] == 0.5 for line in lines
    )
    assert scripted_engine.worker.weight_version == 2
    # Each turn's engine call is timed, as the capture proxy times a black-box one; the tools are environment.
    assert all(line["perf/rollout_llm_s"] > 0 and line["perf/rollout_env_s"] > 0 for line in lines)

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    replies = {text: tokenizer(text, add_special_tokens=False)["input_ids"] for text in (WRITE, DONE)}
    trained = [r for r in read_rollout_log(out) if r.step is not None and r.advantage is not None]
    assert len(trained) == 4 and sorted(r.reward for r in trained) == [0.0, 0.0, 1.0, 1.0]
    for record in trained:
        assert record.trace is not None and record.unscorable is None
        turns = record.trace.turns
        expected = [replies[WRITE], replies[DONE]] if record.reward == 1.0 else [replies[DONE]]
        assert [turn.completion_token_ids for turn in turns] == expected
        assert all(turn.prompt_token_ids in scripted_engine.worker.prompts for turn in turns)
        # Each turn was answered by the weights of its time: at or after the version its rollout started
        # under, and before the step that trained it pushed. Even at max_staleness 0 a push may land between
        # two turns: the next group is admitted when the trainer takes the last one, before it trains.
        versions = [turn.metadata["weight_version"] for turn in turns]
        assert all(record.policy_version <= v <= record.step - 1 for v in versions), (record, versions)
        assert record.tool_calls_by_name == ({"write_file": 1} if record.reward == 1.0 else {})
    # Let the fixture check the server: no session and no sandbox left (the run's last group included).


class RaisingAdapter(HarnessAdapter):
    """An adapter with a bug: each episode samples nothing and raises (with ``kinds``, each episode the next
    kind of bug, round robin)."""

    def __init__(self, kinds: tuple[type[Exception], ...] = (KeyError,)) -> None:
        self.runs, self.kinds = 0, kinds

    def run_white_box(self, model_step: Any, session: Any, limits: Any = None) -> Any:
        self.runs += 1
        session.list_tools()
        raise self.kinds[(self.runs - 1) % len(self.kinds)]("a bug in the adapter")

    def run_black_box(self, session: Any, limits: Any = None) -> Any:
        raise NotImplementedError


def test_an_adapter_that_raises_makes_its_rollouts_unscorable_and_stops_past_max_unexpected_errors(
    scripted_engine: ScriptedEngine,
    builder: Any,
    server: Server,
    tiny_model_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The adapter's exception is a bug by the trainer's rules: each rollout unscorable, the traceback
    logged once, and the run stopped with a RolloutSchedulerError once more than max_unexpected_errors
    came; every session (and its sandbox) is closed."""
    adapter = RaisingAdapter()
    out = tmp_path / "out"
    args = config(out, scripted_engine.url, engine="none", max_unexpected_errors=2)
    trainer = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir), builder, args,
        train_dataset=hello_rows(server), harness_adapter=adapter,
    )  # fmt: skip
    with caplog.at_level(logging.ERROR), pytest.raises(RolloutSchedulerError) as raised:
        trainer.train()
    cause = raised.value.__cause__
    assert isinstance(cause, AdapterError) and isinstance(cause.__cause__, KeyError)
    assert cause.adapter == "RaisingAdapter" and "max_unexpected_errors=2" in str(raised.value)
    assert adapter.runs == 3
    tracebacks = [r for r in caplog.records if "Traceback" in r.getMessage()]
    assert len(tracebacks) == 1 and "a bug in the adapter" in tracebacks[0].getMessage()
    assert not (out / "metrics.jsonl").exists() or metrics_lines(out) == []
    failed = [r for r in read_rollout_log(out) if r.unscorable is not None]
    assert all(r.trace is None and r.reward is None for r in failed)
    assert sum("harness adapter RaisingAdapter raised KeyError" in str(r.unscorable) for r in failed) == 3


@pytest.mark.slow
def test_a_second_kind_of_adapter_bug_in_a_row_stops_the_run_naming_the_adapter(
    scripted_engine: ScriptedEngine, builder: Any, server: Server, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A KeyError, then a ValueError: stopped at the second rollout, well before max_unexpected_errors,
    naming the adapter and both bugs; every session and sandbox closed (the fixture checks)."""
    adapter = RaisingAdapter(kinds=(KeyError, ValueError))
    args = config(tmp_path / "out", scripted_engine.url, engine="none", max_unexpected_errors=10)
    trainer = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir), builder, args, train_dataset=hello_rows(server), harness_adapter=adapter
    )
    second_kind = "adapter RaisingAdapter failed with a second kind"
    with pytest.raises(RolloutSchedulerError, match=second_kind) as raised:
        trainer.train()
    assert adapter.runs == 2
    assert "KeyError at" in str(raised.value) and "then ValueError at" in str(raised.value)
    assert isinstance(raised.value.__cause__, AdapterError)


def test_what_an_adapter_passes_on_from_its_session_or_engine_is_not_an_adapter_bug() -> None:
    assert is_infrastructure(RolloutUnscorable("sandbox died", kind="sandbox"))
    assert is_infrastructure(RolloutServerBug("the server's bug", kind="unexpected"))  # counted, as its own
    assert not is_infrastructure(KeyError("x"))
    bug = AdapterError("MyAdapter", KeyError("x"))
    assert judge(bug, stopping=False).kind is FailureKind.UNEXPECTED and "MyAdapter" in str(bug)


def test_a_factory_whose_sessions_have_no_tools_is_refused_when_the_trainer_is_made(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """LocalSessionFactory's sessions are loop-owning agents with no tools: refused before anything starts
    (no sandbox, no server, no engine call); so are a non-adapter and a builder function annotated to make
    such a factory."""
    args = config(tmp_path, "http://127.0.0.1:1", engine="none")
    with pytest.raises(TypeError, match="ResourceSessionFactory"):
        HarnessAsyncGRPOTrainer(
            str(tiny_model_dir), partial(LocalSessionFactory, "tasks", upstream="http://x"), args,
            harness_adapter=MCPHarnessAdapter(),
        )  # fmt: skip

    def annotated(**options: Any) -> LocalSessionFactory:
        raise AssertionError("never called")

    with pytest.raises(TypeError, match="LocalSessionFactory is not a ResourceSessionFactory"):
        HarnessAsyncGRPOTrainer(str(tiny_model_dir), annotated, args, harness_adapter=MCPHarnessAdapter())
    with pytest.raises(TypeError, match="HarnessAdapter"):
        HarnessAsyncGRPOTrainer(
            str(tiny_model_dir), partial(WhiteBoxSessionFactory, "http://x"), args, harness_adapter=object()
        )


# -- the wrapper alone, in process: a fake resource session factory, the scripted engine ------------------


class ListingFactory(ResourceSessionFactory):
    """Sessions with one ``bash`` tool that lists two files, after ``tool_delay_s``."""

    def __init__(self, tool_delay_s: float = 0.0) -> None:
        self.tool_delay_s = tool_delay_s
        self.sessions: list[ListingSession] = []

    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> ListingSession:
        session = ListingSession(self.tool_delay_s)
        self.sessions.append(session)
        return session


class ListingSession(ResourceSession):
    def __init__(self, tool_delay_s: float) -> None:
        self.tool_delay_s, self.closed = tool_delay_s, 0

    def initial_messages(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": "List the files."}]

    def list_tools(self) -> list[Tool]:
        schema = {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}
        return [Tool(name="bash", description="Run a shell command.", input_schema=schema)]

    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        time.sleep(self.tool_delay_s)
        return ToolResult(data="a.txt\nb.txt")

    def verify(self, transcript: list[dict[str, Any]], final_state: Any | None = None) -> VerifyResult:
        return VerifyResult(env_reward=float(len(transcript)), done=True, metrics={"mine": 1})

    def close(self) -> None:
        self.closed += 1


CALL_LS = '<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call><|im_end|>'
BROKEN = '<tool_call>\n{"name": "bash", "arguments": {"cmd": \n</tool_call><|im_end|>'


def wrapper(url: str, tokenizer: Any, inner: ResourceSessionFactory) -> WhiteBoxRolloutFactory:
    return white_box_factory(
        inner, MCPHarnessAdapter(), tokenizer=tokenizer, base_url=url, sampling={"temperature": 1.0},
        max_completion_length=64, limits=HarnessRunLimits(max_turns=4), policy_version=lambda: 9,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_a_rollout_verifies_the_adapters_transcript_and_counts_parse_errors_as_failed_tool_calls(
    scripted_engine: ScriptedEngine, tokenizer: Any
) -> None:
    scripted_engine.script(BROKEN, CALL_LS, DONE)
    inner = ListingFactory()
    factory = wrapper(scripted_engine.url, tokenizer, inner)
    assert factory.settings.model == "tiny" and factory.settings.context_budget == 4096
    assert not hasattr(factory, "prompt_rows")  # the inner factory has none, so neither has the wrapper
    rollout = factory.create({"prompt": "x"}, seed=1, episode_id="g0-m0")
    assert rollout.wait_for_completion(timeout_s=60) == 0
    trace = rollout.fetch_training_trace()
    verdict = rollout.verify([])
    rollout.close()
    rollout.close()
    served = scripted_engine.worker.weight_version  # the dev engine names it (vLLM would not: then 9)
    assert len(trace.turns) == 3 and all(t.metadata["weight_version"] == served for t in trace.turns)
    assert verdict.env_reward == 6.0  # user, 3 assistant turns, 2 tool results: the adapter's transcript
    assert verdict.metrics["mine"] == 1
    assert verdict.metrics["tool_calls_by_name"] == {"invalid_tool_call": 1, "bash": 1}
    assert verdict.metrics["tool_failure_count"] == 1
    assert verdict.metrics["whitebox/parse_errors"] == 1 and verdict.metrics["whitebox/turns"] == 3
    assert verdict.metrics["whitebox/done"] == 1.0
    assert inner.sessions[0].closed == 1


def test_past_the_timeout_the_episode_samples_no_more_and_keeps_its_turns(
    scripted_engine: ScriptedEngine, tokenizer: Any
) -> None:
    scripted_engine.script(CALL_LS, CALL_LS)
    factory = wrapper(scripted_engine.url, tokenizer, ListingFactory(tool_delay_s=0.5))
    rollout = factory.create(0)
    with pytest.raises(TimeoutError):
        rollout.wait_for_completion(timeout_s=0.3)
    assert len(scripted_engine.worker.prompts) == 1  # the second turn was never sent
    assert len(rollout.fetch_training_trace().turns) == 1
    rollout.close()


def test_an_engine_that_fails_a_turn_or_an_episode_with_no_turn_is_unscorable(tokenizer: Any) -> None:
    settings = StepSettings(tokenizer, f"http://127.0.0.1:{free_port()}", "tiny", SamplingPolicy(), 4096, 64)
    dead = WhiteBoxRolloutFactory(ListingFactory(), MCPHarnessAdapter(), settings).create(0)
    with pytest.raises(RolloutUnscorable) as raised:
        dead.wait_for_completion()
    assert raised.value.kind == "engine" and isinstance(raised.value.__cause__, EngineCallError)
    assert judge(raised.value, stopping=False).kind is FailureKind.INFRASTRUCTURE
    with pytest.raises(RolloutUnscorable, match="sampled no turn") as empty:
        dead.fetch_training_trace()
    assert empty.value.kind == "harness"
    dead.close()


def test_a_builder_function_of_unknown_type_is_checked_once_built(scripted_engine: ScriptedEngine) -> None:
    def any_factory(**options: Any) -> Any:
        raise AssertionError("never called")

    check_white_box(MCPHarnessAdapter(), lambda **options: object())  # nothing to tell from its type
    check_white_box(MCPHarnessAdapter(), any_factory)
    with pytest.raises(TypeError, match="object is not a ResourceSessionFactory"):
        white_box_factory(
            object(), MCPHarnessAdapter(), tokenizer=None, base_url=scripted_engine.url, sampling={}
        )
