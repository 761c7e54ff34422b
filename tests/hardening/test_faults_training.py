"""Faults injected into small real training runs: the whole stack (dev engine, capture proxy, rollout
runtime, local sandboxes, the toy agent, the trainer), one fault per test, and what the run must do.

Each run rolls ``hello-file`` out in groups of two, one rollout at a time, against a scripted dev engine,
so which rollout meets which reply (and which fault) is fixed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from harness_trainer import HarnessAsyncGRPOTrainer
from harness_trainer.sandboxes import SANDBOXES
from harness_trainer.trainer.feed.rollout_log import read_rollout_log
from tests.hardening.faults import (
    GIVE_UP,
    INJECTED,
    SOLVE,
    SOLVE_CMD,
    FaultyUpstream,
    FlakyStartBackend,
    StartLedger,
    assert_trained_around_group_1,
    describe,
    hello_rows,
    leftover_capture_sessions,
    leftover_sandbox_roots,
    local_builder,
    metrics_lines,
    new_processes,
    recording_builder,
    training_config,
)
from tests.rollouts.conftest import bash_call, live_sandbox_processes, scripted_engine  # noqa: F401

pytestmark = pytest.mark.slow


def assert_nothing_left(before: set[int], sandboxes: Path, capture: Path) -> None:
    """No agent or other child process, no sandbox root, no capture session journal left behind."""
    assert live_sandbox_processes() == []
    leaked = new_processes(before)
    assert not leaked, describe(leaked)
    assert leftover_sandbox_roots(sandboxes) == []
    assert leftover_capture_sessions(capture) == []


def test_sandbox_starts_that_fail_make_rollouts_unscorable_and_counted_and_training_reaches_its_steps(
    scripted_engine,  # noqa: F811
    tiny_model_dir,
    tmp_path,
    monkeypatch,
) -> None:
    """30 % of sandbox starts fail (seeded: starts 3 and 4 of the first six, i.e. both members of group
    1): the run still trains its 2 steps (on groups 0 and 2), the failed rollouts are unscorable with the
    start error as reason, counted in ``rollout/unscorable_total`` and the rollout log, and no sandbox,
    agent process or capture session is left."""
    engine = scripted_engine((SOLVE + GIVE_UP) * 10)
    before = _children()
    ledger = StartLedger()
    monkeypatch.setitem(SANDBOXES, "flaky", FlakyStartBackend)
    sandboxes, capture, out = tmp_path / "sandboxes", tmp_path / "capture", tmp_path / "out"
    options = {"failure_rate": 0.3, "seed": 2, "ledger": ledger, "base_dir": sandboxes}
    builder = local_builder(engine.url, sandbox="flaky", sandbox_options={"flaky": options}, data_dir=capture)
    trainer = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir), builder, training_config(out, engine.url), train_dataset=hello_rows()
    )
    trainer.train()

    failed = assert_trained_around_group_1(trainer, out)
    assert all(INJECTED in (r.unscorable or "") for r in failed)
    assert ledger.failures >= 2 and ledger.starts >= 6
    assert all(sandbox.closed for sandbox in ledger.started)
    assert_nothing_left(before, sandboxes, capture)


def test_an_agent_killed_mid_rollout_and_one_that_hangs_keep_their_turns_and_the_group_is_scored(
    scripted_engine,  # noqa: F811
    tiny_model_dir,
    tmp_path,
) -> None:
    """Member 0's agent is SIGKILLed right after its first model call (its tool command kills it: ``kill
    -9 $PPID``, after writing the answer file); member 1's agent hangs in ``sleep 60`` past its 10 s
    timeout (long enough for the other agent to start and solve on a loaded 2-core machine).
    Both keep their one captured turn, the hang is ``timed_out``, the killed one is a plain (scored)
    result, the group is scored (rewards 1 and 0) and trained, and the ``sleep`` is gone."""
    engine = scripted_engine([bash_call(f"{SOLVE_CMD}; kill -9 $PPID"), bash_call("sleep 60")])
    before = _children()
    sandboxes, capture, out = tmp_path / "sandboxes", tmp_path / "capture", tmp_path / "out"
    made: list[Any] = []
    builder = recording_builder(
        engine.url,
        made,
        agent_timeout_sec=10,
        data_dir=capture,
        sandbox_options={"local": {"base_dir": sandboxes}},
    )
    trainer = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir),
        builder,
        training_config(out, engine.url, max_steps=1),
        train_dataset=hello_rows(),
    )
    trainer.train()

    (line,) = metrics_lines(out)
    assert line["reward"] == 0.5 and line["rollout/unscorable"] == 0 and line["rollout/timed_out_frac"] == 0.5
    assert line["loss"] != 0
    killed, hung = [r for r in read_rollout_log(out) if r.step is not None]  # the one step's group
    assert (killed.reward, killed.timed_out, killed.unscorable) == (1.0, False, None)
    assert (hung.reward, hung.timed_out, hung.unscorable) == (0.0, True, None)
    assert killed.trace is not None and len(killed.trace.turns) == 1
    assert hung.trace is not None and len(hung.trace.turns) == 1
    assert killed.advantage is not None and killed.advantage > 0 and hung.advantage is not None
    results = [session.result for session in made[:2]]
    assert results[0].exit_code in (-9, 137) and not results[0].timed_out
    assert results[1].timed_out and results[1].exit_code is None
    assert_nothing_left(before, sandboxes, capture)


def test_an_engine_that_fails_for_a_while_makes_those_rollouts_unscorable_and_training_completes(
    scripted_engine,  # noqa: F811
    tiny_model_dir,
    tmp_path,
) -> None:
    """Between the proxy and the engine, the first model call answers 503 three times and the second has
    its connection dropped three times: each is retried exactly 3 times (the proxy's bound), its agent
    gets an error and stops, and both rollouts of group 0 are unscorable with the engine's failure as
    reason (not zero rewards). Once the engine is back, the run trains its 2 steps on groups 1 and 2."""
    engine = scripted_engine((SOLVE + GIVE_UP) * 10)
    before = _children()
    faulty = FaultyUpstream(engine.url).start()
    sandboxes, capture, out = tmp_path / "sandboxes", tmp_path / "capture", tmp_path / "out"
    try:
        faulty.fail_next(*["5xx"] * 3, *["drop"] * 3)
        builder = local_builder(
            faulty.url, model="tiny", data_dir=capture, sandbox_options={"local": {"base_dir": sandboxes}}
        )
        trainer = HarnessAsyncGRPOTrainer(
            str(tiny_model_dir), builder, training_config(out, engine.url), train_dataset=hello_rows()
        )
        trainer.train()
    finally:
        faulty.stop()

    assert faulty.injected == ["5xx"] * 3 + ["drop"] * 3 and faulty.faults == []
    lines = metrics_lines(out)
    assert [line["step"] for line in lines] == [1, 2] and trainer.trained_groups == [1, 2]
    assert [line["reward"] for line in lines] == [0.5, 0.5]
    assert lines[-1]["rollout/unscorable_total"] == 2 and lines[-1]["rollout/dropped_groups_total"] == 1
    failed = [r for r in read_rollout_log(out) if r.step is not None and r.unscorable is not None]
    assert [(r.group, r.member) for r in failed] == [(0, 0), (0, 1)]
    assert all("engine" in (r.unscorable or "") for r in failed), [r.unscorable for r in failed]
    assert_nothing_left(before, sandboxes, capture)


def _children() -> set[int]:
    from tests.hardening.faults import descendants

    return descendants(os.getpid())
