"""How a real run stops: SIGTERM (what a job scheduler sends) to ``harness-trainer dev``, then ``--resume``;
and a malformed capture injected between the capture proxy and the engine, which must stop training.

The SIGTERM scenarios run the assembled stack as a user runs it (``python -m harness_trainer.cli dev``:
dev engine, in-process capture proxy, local sandboxes, the toy agent, the trainer); the signal goes to the
dev process alone (as ``docker stop`` or Kubernetes send it to PID 1), so closing its children is its job.
``tests/devloop/test_dev_command.py`` covers Ctrl-C (SIGINT, to the whole process group).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from harness_trainer import CaptureContractError, HarnessAsyncGRPOTrainer
from harness_trainer.trainer.policy import vocab_size
from tests.devloop.test_dev_command import dev
from tests.hardening.faults import (
    ROOT,
    SOLVE,
    FaultyUpstream,
    alive,
    descendants,
    describe,
    hello_rows,
    leftover_capture_sessions,
    leftover_sandbox_roots,
    new_processes,
    out_of_vocabulary,
    recording_builder,
    training_config,
    wait_until,
)
from tests.rollouts.conftest import live_sandbox_processes, scripted_engine  # noqa: F401

pytestmark = pytest.mark.slow
STOP_BOUND_S = 30.0  # from the signal to the dev process's exit, everything closed


class DevRun:
    """``harness-trainer dev`` as its own process (own session, output in a file), killed on every path."""

    def __init__(self, argv: list[str], log: Path, tmp: Path) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.log = log
        with log.open("ab") as out:
            # TMPDIR: the local sandboxes' roots go there, so the test can see none is left.
            self.process = subprocess.Popen(
                argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "TMPDIR": str(tmp)},
            )  # fmt: skip

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def running(self) -> bool:
        assert self.process.poll() is None, f"the dev run exited early:\n{self.output()[-3000:]}"
        return True

    def terminate_and_time(self, timeout: float = 120.0) -> float:
        """SIGTERM to the dev process alone; seconds until it exited."""
        signalled = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout)
        return time.monotonic() - signalled

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)


def engine_started(pid: int) -> set[int]:
    """The dev engine processes below ``pid`` (``harness_trainer.cli engine``)."""
    found = set()
    for child in alive(descendants(pid)):
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"harness_trainer.cli" in command and b"engine" in command:
            found.add(child)
    return found


def test_sigterm_mid_training_checkpoints_closes_everything_in_bounded_time_and_resume_reaches_max_steps(
    tmp_path,
) -> None:
    """SIGTERM to a ``harness-trainer dev`` run once it has trained a step: it exits 143 within
    ``STOP_BOUND_S`` seconds, saying it was stopped by SIGTERM, having written the checkpoint of its last
    step; its engine, agents and every other child are gone, and no sandbox root or capture session is
    left. ``--resume`` then starts at that checkpoint's step (metrics go on from it, none repeated) and
    reaches its max steps."""
    run, sandboxes = tmp_path / "run", tmp_path / "tmp"
    metrics = run / "metrics.jsonl"
    first = DevRun(dev(tmp_path, "--max-steps", "50"), tmp_path / "first.log", sandboxes)
    try:
        assert wait_until(lambda: first.running() and metrics.exists() and bool(metrics.read_text()), 240)
        started = descendants(first.process.pid)
        assert engine_started(first.process.pid), describe(started)
        seconds = first.terminate_and_time()
    finally:
        first.kill()
    output = first.output()
    assert first.process.returncode == 143, output[-3000:]
    assert seconds < STOP_BOUND_S, f"{seconds:.1f} s from SIGTERM to exit"
    assert "stopped by SIGTERM" in output and "SIGTERM: stopped at step" in output, output[-3000:]
    assert wait_until(lambda: not alive(started), 10), describe(alive(started))
    assert live_sandbox_processes() == []
    assert leftover_sandbox_roots(sandboxes) == []
    assert leftover_capture_sessions(run / "capture") == []
    steps = len(metrics.read_text().splitlines())
    state = json.loads((run / f"checkpoint-{steps}" / "trainer_state.json").read_text())
    assert state["step"] == steps

    resumed = DevRun(
        dev(tmp_path, "--max-steps", str(steps + 1), "--resume"), tmp_path / "again.log", sandboxes
    )
    try:
        assert resumed.process.wait(300) == 0, resumed.output()[-3000:]
    finally:
        resumed.kill()
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, steps + 2))
    assert (run / f"checkpoint-{steps + 1}" / "trainer_state.json").exists()
    assert leftover_sandbox_roots(sandboxes) == []


def test_sigterm_while_the_engine_starts_stops_it_and_exits_143(tmp_path) -> None:
    """SIGTERM to ``harness-trainer dev`` as soon as its engine process exists (before any training): the
    dev process exits 143 within ``STOP_BOUND_S`` seconds and takes its engine with it (the engine runs in
    its own session, so nothing else would: an unhandled SIGTERM left it running, orphaned)."""
    run = DevRun(dev(tmp_path, "--max-steps", "5"), tmp_path / "dev.log", tmp_path / "tmp")
    try:
        engines: set[int] = set()

        def engine_up() -> bool:
            engines.update(engine_started(run.process.pid) if run.running() else ())
            return bool(engines)

        assert wait_until(engine_up, 120)
        seconds = run.terminate_and_time()
    finally:
        run.kill()
        still = alive(engines)
        for pid in still:  # the bug this guards against: do not leave it behind for the next tests
            os.kill(pid, signal.SIGKILL)
    assert run.process.returncode == 143, run.output()[-3000:]
    assert seconds < STOP_BOUND_S, f"{seconds:.1f} s from SIGTERM to exit"
    assert not still, describe(still)
    assert "stopped by SIGTERM" in run.output()
    assert not list((tmp_path / "run").glob("checkpoint-*"))


def test_an_out_of_vocabulary_id_injected_into_an_engine_reply_stops_training_naming_session_and_rule(
    scripted_engine,  # noqa: F811
    tiny_model_dir,
    tmp_path,
) -> None:
    """Between the capture proxy and the engine, the run's first reply gets a sampled id of
    ``vocab_size + 5``, in ``token_ids`` and in its ``logprobs`` entry alike: the proxy's pairing check
    passes (the call is journaled as trainable), but the trainer's vocabulary check must not. ``train()``
    raises ``CaptureContractError`` with rule ``out_of_vocabulary``, naming the rollout's capture session
    and the bad id, after closing everything: no agent or other child process, sandbox root or capture
    session is left, and no step was trained."""
    engine = scripted_engine(SOLVE * 10)
    before = descendants(os.getpid())
    faulty = FaultyUpstream(engine.url).start()
    sandboxes, capture, out = tmp_path / "sandboxes", tmp_path / "capture", tmp_path / "out"
    made: list[Any] = []
    try:
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(tiny_model_dir).vocab_size
        faulty.fail_next(out_of_vocabulary(vocab))
        builder = recording_builder(
            faulty.url,
            made,
            model="tiny",
            data_dir=capture,
            sandbox_options={"local": {"base_dir": sandboxes}},
        )
        trainer = HarnessAsyncGRPOTrainer(
            str(tiny_model_dir), builder, training_config(out, engine.url), train_dataset=hello_rows()
        )
        with pytest.raises(CaptureContractError) as raised:
            trainer.train()
    finally:
        faulty.stop()

    assert trainer.model is not None and vocab_size(trainer.model) == vocab
    assert faulty.injected == ["out_of_vocabulary"]
    (rewritten,) = faulty.rewritten
    assert rewritten["choices"][0]["token_ids"][0] == vocab + 5
    error = raised.value
    session = made[0].session_id
    assert session is not None and error.session_id == session
    assert error.rules == ["out_of_vocabulary"]
    assert repr(session) in str(error) and str(vocab + 5) in str(error) and "vocabulary" in str(error)
    assert trainer.state.step == 0
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text()
    assert live_sandbox_processes() == []
    leaked = new_processes(before)
    assert not leaked, describe(leaked)
    assert leftover_sandbox_roots(sandboxes) == []
    assert leftover_capture_sessions(capture) == []
