"""Sessions from our factories satisfy OpenEnv's ``TrainableSession`` and run under TRL's loop-owning worker.

TRL 1.16's ``HarnessRolloutWorker`` needs a vLLM client, a tokenizer and accelerate to start; the part
that drives a loop-owning session is ``_HarnessRolloutLoop._run_session``. The shim builds that loop
object without its GPU-bound ``__init__`` (``__new__`` + the attributes ``_run_session`` reads) and runs
the real method: create → ``wait_for_completion`` → ``fetch_training_trace`` → ``to_trace_entries`` →
``verify`` → TRL's row building → close. It imports TRL's private loop class on purpose: it is the code
path under test and TRL exposes no public entry for it.
"""

from __future__ import annotations

import threading

import pytest

from harness_trainer.rollouts.client.local_factory import LocalSessionFactory
from tests.rollouts.conftest import EXAMPLES, bash_call

HELLO = [bash_call("printf 'Hello, Harbor!\\n' > /app/hello.txt"), {"content": "Done."}]


@pytest.mark.slow
def test_a_local_session_is_an_openenv_trainable_session(scripted_engine):
    harness = pytest.importorskip("openenv.core.harness")
    engine = scripted_engine(HELLO)
    with LocalSessionFactory(str(EXAMPLES), upstream=engine.url, harness="toy") as factory:
        session = factory.create(next(r for r in factory.prompt_rows() if r["task_name"] == "hello-file"))
        assert isinstance(session, harness.TrainableSession)
        session.wait_for_completion(timeout_s=120)
        harness.TrainingTrace.model_validate(session.fetch_training_trace().model_dump())
        session.close()


@pytest.mark.slow
def test_trls_harness_rollout_loop_trains_on_our_session(scripted_engine):
    worker = pytest.importorskip("trl.experimental.async_grpo.openenv_harness")
    engine = scripted_engine(HELLO)
    outcomes = []
    with LocalSessionFactory(str(EXAMPLES), upstream=engine.url, harness="toy") as factory:
        loop = worker._HarnessRolloutLoop.__new__(worker._HarnessRolloutLoop)
        loop._factory = factory
        loop._adapter = None
        loop._live_sessions = set()
        loop._stop_event = threading.Event()
        loop._fork_threshold_tokens = 0
        loop._rollout_reward_fn = lambda outcome: outcomes.append(outcome) or outcome.env_reward
        prompt = next(r for r in factory.prompt_rows() if r["task_name"] == "hello-file")["prompt"]
        (completion, completion_ids, sequences, tool_calls, _, reward), metrics = loop._run_session(prompt)
    assert reward == 1.0 and outcomes[0].env_reward == 1.0 and not outcomes[0].timed_out
    assert outcomes[0].tool_calls_by_name == {"bash": 1} and tool_calls == 1
    assert metrics["turns"] == 2 and len(sequences) == 1 and completion_ids
    assert completion[-1] == {"role": "assistant", "content": "Done."}
    assert loop._live_sessions == set()
