"""OpenEnv's own TRL rollout function over this project's sessions (issue 23, item 3): the installed
openenv's ``build_harness_rollout_func`` with its ``MCPHarnessAdapter``, a :class:`WhiteBoxSessionFactory`
against a real ``harness-trainer serve`` with local sandboxes, and this project's :class:`TokenModelStep`
sampling a dev engine that replays scripted text (``tests/whitebox/conftest.py``). Nothing here is OpenEnv
code copied or faked: the function builds the sessions, runs the episodes, verifies and closes them itself."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("openenv.core.harness")

from openenv.core.harness import HarnessRunLimits, MCPHarnessAdapter, build_harness_rollout_func
from transformers import AutoTokenizer

from capture_proxy.sampling import SamplingPolicy
from harness_trainer.rollouts.client.whitebox_session import WhiteBoxSessionFactory
from harness_trainer.whitebox.model_step import TokenModelStep
from tests.rollouts.test_whitebox_server import HELLO, Server
from tests.whitebox.conftest import ScriptedEngine
from tests.whitebox.test_trainer_whitebox import DONE, WRITE


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = Server(tmp_path_factory.mktemp("rollout-func"))
    yield running
    running.stop()


@pytest.mark.slow
def test_openenvs_rollout_function_drives_our_sessions_and_returns_the_engines_ids(
    server: Server, scripted_engine: ScriptedEngine, tiny_model_dir: Any
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    factory = WhiteBoxSessionFactory(server.url, split="train", sandbox="local")
    rows = {row["task_name"]: row for row in factory.prompt_rows()}
    steps: list[TokenModelStep] = []

    def model_step_builder(trainer: Any, session: Any) -> TokenModelStep:
        step = TokenModelStep(
            tokenizer, scripted_engine.url, "tiny", policy=SamplingPolicy(temperature=1.0, seed=3),
            context_budget=4096, max_completion_tokens=64,
        )  # fmt: skip
        steps.append(step)
        return step

    rollout_func = build_harness_rollout_func(
        session_factory=factory,
        harness_adapter=MCPHarnessAdapter(),
        model_step_builder=model_step_builder,
        limits=HarnessRunLimits(max_turns=3),
    )
    # The hello task solved through write_file, then an answer; count-lines left untouched: only answered.
    scripted_engine.script(WRITE, DONE, DONE)
    prompts = [rows[HELLO]["prompt"], rows["count-lines"]["prompt"]]  # as TRL passes them: the messages
    try:
        out = rollout_func(prompts, None)
    finally:
        for step in steps:
            step.close()

    assert out["env_reward"] == [1.0, 0.0]
    assert [m["tool_calls_by_name"] for m in out["verify_metrics"]] == [{"write_file": 1}, {}]
    # The completion ids are what the engine sampled, by token ids, never re-tokenised: the scripted texts.
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in (WRITE, DONE, DONE)]
    assert out["completion_ids"] == [ids[0] + ids[1], ids[2]]
    assert [len(lp) for lp in out["logprobs"]] == [len(c) for c in out["completion_ids"]]
    assert all(lp <= 0.0 for row in out["logprobs"] for lp in row)
    # Each episode's first prompt is its task rendered by the chat template, sent as ids.
    first_prompts = scripted_engine.worker.prompts
    assert out["prompt_ids"][0][: len(first_prompts[0])] == first_prompts[0]
    assert out["prompt_ids"][1] == first_prompts[2]
    assert server.open_sessions() == 0 and server.sandbox_roots() == []  # the function closed them
