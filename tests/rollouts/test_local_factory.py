"""Whole rollouts in process: local sandbox, the toy agent, the capture proxy and a scripted dev engine."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from harness_trainer.rollouts.client.local_factory import LocalSessionFactory
from harness_trainer.rollouts.client.session import RolloutUnscorable
from harness_trainer.rollouts.errors import RolloutConfigError
from harness_trainer.trainer.feed.evaluation import Evaluator, read_eval, read_eval_rollouts
from tests.rollouts.conftest import EXAMPLES, bash_call, live_sandbox_processes

HELLO = [bash_call("printf 'Hello, Harbor!\\n' > /app/hello.txt"), {"content": "Done."}]


def factory_for(engine_url: str, **options: object) -> LocalSessionFactory:
    options = {"harness": "toy", **options}
    return LocalSessionFactory(str(EXAMPLES), upstream=engine_url, split="train", **options)


def hello_row(factory: LocalSessionFactory) -> dict:
    return next(row for row in factory.prompt_rows() if row["task_name"] == "hello-file")


@pytest.mark.slow
def test_the_toy_agent_solves_a_task_and_its_trace_is_exactly_the_scripted_replies(
    scripted_engine, tiny_model_dir
):
    engine = scripted_engine(HELLO)
    with factory_for(engine.url, sampling={"temperature": 1.0}) as factory:
        session = factory.create(hello_row(factory), seed=0, episode_id="e1")
        assert session.wait_for_completion(timeout_s=120) == 0
        trace = session.fetch_training_trace()
        verified = session.verify([])
        session.close()
    assert verified.env_reward == 1.0
    assert verified.metrics["tool_calls_by_name"] == {"bash": 1}
    first, second = trace.turns
    assert second.metadata["parent"] == first.node_id
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = [tokenizer.decode(t.completion_token_ids) for t in trace.turns]
    assert "Hello, Harbor!" in texts[0] and "Done." in texts[1]
    assert all(sum(t.loss_mask) == len(t.completion_token_ids) for t in trace.turns)
    assert live_sandbox_processes() == []


@pytest.mark.slow
def test_an_agent_that_hangs_is_stopped_and_its_turns_stay_trainable(scripted_engine):
    engine = scripted_engine([bash_call("sleep 60"), {"content": "never"}])
    with factory_for(engine.url, agent_timeout_sec=3) as factory:
        session = factory.create(hello_row(factory))
        with pytest.raises(TimeoutError):
            session.wait_for_completion(timeout_s=120)
        assert len(session.fetch_training_trace().turns) == 1
        assert session.verify([]).env_reward == 0.0
        session.close()
    assert live_sandbox_processes() == []


@pytest.mark.slow
def test_a_client_side_timeout_stops_the_agent_and_keeps_the_turns(scripted_engine):
    engine = scripted_engine([bash_call("sleep 60"), {"content": "never"}])
    with factory_for(engine.url) as factory:
        session = factory.create(hello_row(factory))
        with pytest.raises(TimeoutError):
            session.wait_for_completion(timeout_s=3)
        assert session.timed_out and len(session.fetch_training_trace().turns) == 1
        session.close()
    assert live_sandbox_processes() == []


@pytest.mark.slow
def test_a_task_whose_environment_cannot_be_built_is_unscorable(scripted_engine, tmp_path):
    import shutil

    engine = scripted_engine(HELLO)
    broken = tmp_path / "tasks" / "train" / "broken"
    shutil.copytree(EXAMPLES / "train" / "hello-file", broken)
    (broken / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\nRUN exit 3\n")
    with LocalSessionFactory(str(tmp_path / "tasks"), upstream=engine.url, harness="toy") as factory:
        session = factory.create(0)
        with pytest.raises(RolloutUnscorable, match="exit"):
            session.wait_for_completion(timeout_s=60)
        assert session.verify([]).env_reward is None
        session.close()


@pytest.mark.slow
def test_an_agent_that_crashes_is_a_result_with_the_turns_it_made(scripted_engine):
    engine = scripted_engine([bash_call("echo hi")])  # the second model call fails: script exhausted
    with factory_for(engine.url) as factory:
        session = factory.create(hello_row(factory))
        assert session.wait_for_completion(timeout_s=120) == 1
        assert len(session.fetch_training_trace().turns) == 1
        verified = session.verify([])
        assert verified.env_reward == 0.0 and verified.metrics["model_calls"] == 1
        assert factory.open_capture_sessions() == 0
        session.close()
    assert live_sandbox_processes() == []


@pytest.mark.slow
def test_closing_a_running_session_cleans_up(scripted_engine):
    engine = scripted_engine([bash_call("sleep 60"), {"content": "never"}])
    with factory_for(engine.url) as factory:
        session = factory.create(hello_row(factory))
        import time

        time.sleep(2)
        session.close()
        session.close()
    assert live_sandbox_processes() == []


@pytest.mark.slow
def test_the_factory_rolls_out_through_an_external_capture_proxy_and_leaves_it_running(
    scripted_engine, tmp_path
):
    """With ``capture_url`` and ``admin_key``, the in-process factory starts no proxy of its own: the
    rollout's calls go through a ``python -m capture_proxy`` process (its metrics count the journaled
    calls), the trace and session id come back as usual, the rollout's session is deleted there, and
    closing the factory leaves the external proxy running."""
    from harness_trainer.net import free_port
    from tests.hardening.faults import ProxyProcess

    engine = scripted_engine(HELLO)
    data = tmp_path / "capture"
    proxy = ProxyProcess(engine.url, data, free_port(), "factory-admin-key", tmp_path / "proxy.log")
    proxy.start()
    try:
        with factory_for(engine.url, capture_url=proxy.url, admin_key="factory-admin-key") as factory:
            session = factory.create(hello_row(factory), seed=0, episode_id="e1")
            assert session.wait_for_completion(timeout_s=120) == 0
            assert session.session_id is not None
            trace = session.fetch_training_trace()
            assert session.verify([]).env_reward == 1.0
            session.close()
        assert len(trace.turns) == 2
        assert proxy.open_sessions() == []  # answering, with the rollout's session deleted
        metrics = httpx.get(proxy.url + "/metrics", timeout=5).text
        journaled = next(
            line for line in metrics.splitlines() if line.startswith("capture_proxy_journal_bytes")
        )
        assert float(journaled.split()[-1]) > 0
    finally:
        proxy.stop()
    assert live_sandbox_processes() == []


def test_an_external_capture_proxy_needs_its_admin_key():
    """``capture_url`` without ``admin_key`` is refused when the factory is built, before anything runs."""
    with pytest.raises(ValueError, match="admin key"):
        factory_for("http://127.0.0.1:9", capture_url="http://127.0.0.1:9")


@pytest.mark.parametrize(
    ("harness", "options", "says"),
    [
        ("toy", {"bogus": 1}, r"harness 'toy' does not take options \['bogus'\]"),
        ("mini-swe-agent", {"agent_config": {"agent": 1}}, "sections must be mappings"),
    ],
)
def test_harness_options_the_harness_refuses_are_refused_when_the_factory_is_built(harness, options, says):
    with pytest.raises(RolloutConfigError, match=says):
        LocalSessionFactory(
            str(EXAMPLES), upstream="http://127.0.0.1:9", harness=harness, harness_options=options
        )


@pytest.mark.slow
def test_an_evaluation_of_a_mix_rolls_each_task_out_k_times_under_each_real_agent(scripted_engine, tmp_path):
    """The toy agent and mini-swe-agent, one model call each (step limit 1), one rollout at a time, harness
    by harness: the toy agent's calls write the file, mini-swe-agent's do not; then a toy-only factory's
    evaluation, written as before harnesses could mix."""
    engine = scripted_engine([HELLO[0]] * 2 + [bash_call("true")] * 2 + [HELLO[0]] * 2)
    options = dict(sampling={"temperature": 1.0}, agent_step_limit=1, agent_timeout_sec=120)

    def evaluate(factory: LocalSessionFactory, output: Path) -> dict[str, float]:
        output.mkdir()
        evaluator = Evaluator(
            factory, [hello_row(factory)], k=2, seed=0, temperature=1.0, pass_reward=1.0,
            max_concurrent_rollouts=1, rollout_timeout=None, vocab_size=None, reward_fn=None,
            output_dir=output, split="train",
        )  # fmt: skip
        evaluated = evaluator.evaluate(2, 2, threading.Event())
        assert evaluated is not None
        return evaluated[0]

    mix = ["toy", "mini-swe-agent"]
    with factory_for(engine.url, harness=mix, **options) as factory:
        with pytest.raises(RolloutConfigError, match="'codex' is not one of this run's: toy, mini-swe-agent"):
            factory.create(hello_row(factory), harness="codex")
        metrics = evaluate(factory, tmp_path / "mixed")
    lines = read_eval(tmp_path / "mixed")
    assert [(line["task_name"], line["harness"], line["rewards"]) for line in lines] == [
        ("hello-file", "toy", [1.0, 1.0]), ("hello-file", "mini-swe-agent", [0.0, 0.0]),
    ]  # fmt: skip
    samples = read_eval_rollouts(tmp_path / "mixed")
    assert sorted((s.harness, s.member) for s in samples) == [(h, m) for h in sorted(mix) for m in (0, 1)]
    # Each sample ran the agent it names: that agent's own system prompt is in its capture.
    prompts = {
        h: {s.trace.turns[0].request["messages"][0]["content"] for s in samples if s.harness == h}
        for h in mix
    }
    assert all(len(p) == 1 for p in prompts.values()) and prompts["toy"] != prompts["mini-swe-agent"]
    assert metrics["eval/harness/toy/pass@1"] == 1.0 and metrics["eval/harness/mini-swe-agent/pass@1"] == 0.0
    assert metrics["eval/pass@1"] == 0.5 and metrics["eval/tasks"] == 1

    with factory_for(engine.url, **options) as factory:  # the toy agent alone
        metrics = evaluate(factory, tmp_path / "one")
    (line,) = read_eval(tmp_path / "one")
    assert "harness" not in line and line["rewards"] == [1.0, 1.0]
    assert not any(key.startswith("eval/harness/") for key in metrics)
    assert all(s.harness is None for s in read_eval_rollouts(tmp_path / "one"))
    assert live_sandbox_processes() == []
