"""``sandbox="hf"`` trains in the dev-loop shape against the fake Hub (:mod:`tests.sandboxes.fake_hf`): the
whole stack runs for real (dev engine, capture proxy, rollout runtime, the toy agent, the trainer), with
dedicated HF sandboxes (the default) made through ``huggingface_hub``'s own client; only the Hub is the fake,
whose jobs are namespaces on this machine sharing its network, so the agent in one reaches the capture
proxy on loopback (against Hugging Face, the rollout server needs ``--public-url``). The scenario of
``tests/hardening/test_faults_e2b.py``, without its faults and with a host lost under its rollouts."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from harness_trainer import HarnessAsyncGRPOTrainer
from harness_trainer.sandboxes.hf_sdk import RUN_LABEL
from harness_trainer.trainer.feed.rollout_log import read_rollout_log
from tests.hardening.faults import (
    GIVE_UP,
    SOLVE,
    assert_trained_around_group_1,
    descendants,
    describe,
    hello_rows,
    leftover_capture_sessions,
    local_builder,
    metrics_lines,
    new_processes,
    training_config,
)
from tests.rollouts.conftest import bash_call, live_sandbox_processes, scripted_engine  # noqa: F401
from tests.sandboxes.conftest import live_processes, wait_until_gone
from tests.sandboxes.fake_hf import FakeHub

pytestmark = [pytest.mark.slow, pytest.mark.docker]  # the fake's jobs run images exported from Docker


def test_a_grpo_step_trains_on_rollouts_in_dedicated_hf_sandboxes_and_leaves_no_job(
    fake_hub: FakeHub,
    scripted_engine,  # noqa: F811
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    """One GRPO step on a group of 2 ``hello-file`` rollouts (one solves it, one gives up), each in a
    dedicated sandbox job of the run: both scored (1 and 0), the step trained on their mean, and once the
    trainer is done no job is left running on the Hub, no process or capture session here."""
    engine = scripted_engine((SOLVE + GIVE_UP) * 4)
    before = descendants(os.getpid())
    capture, out = tmp_path / "capture", tmp_path / "out"
    options: dict[str, Any] = {"run_id": "run-train", "kill_grace_s": 0.5, "retry_backoff_s": 0}
    builder = local_builder(engine.url, sandbox="hf", sandbox_options={"hf": options}, data_dir=capture)
    config = training_config(out, engine.url, max_steps=1)
    trainer = HarnessAsyncGRPOTrainer(str(tiny_model_dir), builder, config, train_dataset=hello_rows())
    trainer.train()

    lines = metrics_lines(out)
    assert [line["step"] for line in lines] == [1] and trainer.trained_groups == [0]
    assert lines[0]["reward"] == 0.5 and lines[0].get("rollout/unscorable_total", 0) == 0
    trained = [r for r in read_rollout_log(out) if r.step == 1]
    assert sorted(r.reward for r in trained) == [0.0, 1.0] and all(r.unscorable is None for r in trained)
    sandboxes = [job for job in fake_hub.jobs.values() if job.labels.get(RUN_LABEL) == "run-train"]
    assert len(sandboxes) >= 2 and {job.spec["dockerImage"] for job in sandboxes} == {"ubuntu:24.04"}
    assert fake_hub.running() == [], "every sandbox job was cancelled"
    assert live_sandbox_processes() == [] and leftover_capture_sessions(capture) == []
    leaked = new_processes(before)
    assert not leaked, describe(leaked)


class JobKiller(threading.Thread):
    """Ends, from the Hub's side, every running sandbox job of ``run`` while a ``sleep MARK`` runs on this
    machine (only an agent's command scripted for it runs one): a host lost under a rollout in flight."""

    def __init__(self, hub: FakeHub, run: str, mark: str) -> None:
        super().__init__(daemon=True)
        self.hub, self.run_id, self.needle = hub, run, f"sleep {mark}"
        self.stopping, self.ended = threading.Event(), 0

    def run(self) -> None:
        while not self.stopping.wait(0.1):
            if live_processes(self.needle):
                for job in self.hub.running(**{RUN_LABEL: self.run_id}):
                    self.hub.end_job(job.id, "ERROR", "the VM was lost")
                    self.ended += 1
                # The next rollout's job must not be taken for this one's: wait until its sleep is gone.
                wait_until_gone(self.needle, 30.0)


def test_a_sandbox_job_lost_under_its_rollouts_makes_them_unscorable_naming_why_and_training_goes_on(
    fake_hub: FakeHub,
    scripted_engine,  # noqa: F811
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    """Groups of 2, one rollout at a time (the scripted replies go out in order): group 0 trains; both
    members of group 1 run a command during which the Hub loses their sandbox's job, so each is
    unscorable with that reason and the group is dropped; group 2, in new jobs, trains the second step.
    Nothing is left running on the Hub or here."""
    mark = f"87.{os.getpid()}"  # no other process here sleeps for this long, this test in another one neither
    lost = [bash_call(f"sleep {mark}")]
    engine = scripted_engine(SOLVE + GIVE_UP + lost + lost + SOLVE + GIVE_UP)
    before = descendants(os.getpid())
    capture, out = tmp_path / "capture", tmp_path / "out"
    options: dict[str, Any] = {"run_id": "run-lost", "kill_grace_s": 0.5, "retry_backoff_s": 0}
    builder = local_builder(engine.url, sandbox="hf", sandbox_options={"hf": options}, data_dir=capture)
    trainer = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir), builder, training_config(out, engine.url), train_dataset=hello_rows()
    )
    killer = JobKiller(fake_hub, "run-lost", mark)
    killer.start()
    try:
        trainer.train()
    finally:
        killer.stopping.set()
        killer.join(30)

    failed = assert_trained_around_group_1(trainer, out)
    assert killer.ended == 2
    for record in failed:
        assert "has ended (ERROR: the VM was lost)" in (record.unscorable or ""), record.unscorable
    assert fake_hub.running() == [], "every sandbox job was cancelled or ended"
    assert live_sandbox_processes() == [] and leftover_capture_sessions(capture) == []
    leaked = new_processes(before)
    assert not leaked, describe(leaked)
