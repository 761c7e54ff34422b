"""The trainer in white-box mode (issue 23): ``harness_adapter=MCPHarnessAdapter()`` over
``WhiteBoxSessionFactory`` against a real ``harness-trainer serve`` process with local sandboxes, the engine
the dev engine app replaying scripted tool calls (``scripted_engine``) with the tiny model's logprobs."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openenv.core.harness")
pytest.importorskip("trl")

from openenv.core.harness import HarnessAdapter, HarnessRunLimits, MCPHarnessAdapter
from transformers import AutoTokenizer

from harness_trainer import HarnessAsyncGRPOTrainer
from harness_trainer.rollouts.client.local_factory import LocalSessionFactory
from harness_trainer.rollouts.client.whitebox_session import WhiteBoxSessionFactory
from harness_trainer.trainer.config import AsyncGRPOConfig
from harness_trainer.trainer.rollout_log import read_rollout_log
from harness_trainer.trainer.scheduling import RolloutSchedulerError
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
        agent_timeout=120, token_budget=4096, seed=7, max_completion_length=128, rollout_log_steps=1,
        drop_zero_variance_groups=False,
    )  # fmt: skip
    return AsyncGRPOConfig(**{**settings, **overrides})


def test_the_trainer_trains_white_box_rollouts_on_the_engines_ids_and_leaks_nothing(
    scripted_engine: ScriptedEngine, builder: Any, server: Server, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Rollouts alternate: one writes the file through the sandbox's write_file tool (reward 1), the next
    only answers (reward 0), so each group of 2 has an advantage. Two steps train, pushing weights to the
    engine; every trained turn is the ids the engine saw and sampled; no session or sandbox is left."""
    scripted_engine.script(*[WRITE, DONE, DONE] * 8)
    out = tmp_path / "out"
    trainer = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir), builder, config(out, scripted_engine.url), train_dataset=hello_rows(server),
        harness_adapter=MCPHarnessAdapter(), harness_limits=HarnessRunLimits(max_turns=4),
    )  # fmt: skip
    trainer.train()

    lines = metrics_lines(out)
    assert [line["step"] for line in lines] == [1, 2]
    assert [line["reward"] for line in lines] == [0.5, 0.5]
    assert all(line["rollout/unscorable"] == 0 and line["policy_version"] == line["step"] for line in lines)
    assert all(line["whitebox/turns"] == 1.5 and line["whitebox/tool_calls"] == 0.5 for line in lines)
    assert all(
        line["whitebox/retemplated_turns"] == 0 and line["tools/call_frequency"] == 0.5 for line in lines
    )
    assert scripted_engine.worker.weight_version == 2

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
        assert all(turn.metadata["weight_version"] == record.policy_version for turn in turns)
        assert record.tool_calls_by_name == ({"write_file": 1} if record.reward == 1.0 else {})
    # Let the fixture check the server: no session and no sandbox left (the run's last group included).


class RaisingAdapter(HarnessAdapter):
    """An adapter with a bug: each episode samples nothing and raises."""

    def __init__(self) -> None:
        self.runs = 0

    def run_white_box(self, model_step: Any, session: Any, limits: Any = None) -> Any:
        self.runs += 1
        session.list_tools()
        raise KeyError("a bug in the adapter")

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
    assert isinstance(raised.value.__cause__, KeyError) and "max_unexpected_errors=2" in str(raised.value)
    assert adapter.runs == 3
    tracebacks = [r for r in caplog.records if "Traceback" in r.getMessage()]
    assert len(tracebacks) == 1 and "a bug in the adapter" in tracebacks[0].getMessage()
    assert not (out / "metrics.jsonl").exists() or metrics_lines(out) == []
    failed = [r for r in read_rollout_log(out) if r.unscorable is not None]
    assert all(r.trace is None and r.reward is None for r in failed)
    assert sum("unexpected KeyError" in str(r.unscorable) for r in failed) == 3


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
