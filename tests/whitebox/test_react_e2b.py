"""White-box training on E2B sandboxes: the trainer with the built-in ``ReActAdapter`` over
``LocalWhiteBoxSessionFactory(sandbox="e2b")``, whose sandboxes come from the fake E2B cloud
(``tests/sandboxes/fake_e2b.py``, bound to the real SDK's signatures; the CI cannot reach E2B). The tools run
as commands in the fake's sandboxes, the verifier scores what they left, and every sandbox is killed."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest

pytest.importorskip("openenv.core.harness")
pytest.importorskip("trl")
pytest.importorskip("e2b")

from harness_trainer import LocalWhiteBoxSessionFactory
from harness_trainer.examples import TASKS as EXAMPLES
from harness_trainer.rollouts.errors import RolloutConfigError
from harness_trainer.trainer.feed.rollout_log import read_rollout_log
from tests.hardening.faults import metrics_lines
from tests.sandboxes.fake_e2b import FakeE2BCloud
from tests.whitebox.conftest import ScriptedEngine
from tests.whitebox.test_react import DONE, SUBMIT, WRITE, loops, train_two_steps

pytestmark = pytest.mark.docker  # the fake E2B cloud runs images exported from the Docker daemon


@pytest.mark.slow
def test_the_trainer_trains_white_box_rollouts_in_e2b_sandboxes(
    scripted_engine: ScriptedEngine, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rollouts alternate: one writes the file through ``write_file`` and submits (reward 1), the next only
    answers (reward 0); two steps train; each rollout had its own E2B sandbox and none is left alive."""
    monkeypatch.setenv("E2B_API_KEY", "e2b_test")
    cloud = FakeE2BCloud(tmp_path / "e2b")
    scripted_engine.script(*[WRITE, SUBMIT, DONE] * 8)
    running = loops()
    e2b = {"e2b": {"template": "fake", "sandbox_class": cloud, "kill_grace_s": 0.5, "retry_backoff_s": 0}}
    builder = partial(LocalWhiteBoxSessionFactory, str(EXAMPLES), split="train", sandbox="e2b",
                      sandbox_options=e2b)  # fmt: skip
    out = train_two_steps(scripted_engine, tiny_model_dir, builder, tmp_path / "out")

    lines = metrics_lines(out)
    assert [line["step"] for line in lines] == [1, 2]
    assert [line["reward"] for line in lines] == [0.5, 0.5]
    assert all(line["rollout/unscorable"] == 0 and line["policy_version"] == line["step"] for line in lines)
    trained = [r for r in read_rollout_log(out) if r.step is not None and r.advantage is not None]
    assert sorted(r.reward for r in trained) == [0.0, 0.0, 1.0, 1.0]
    for record in trained:
        assert record.tool_calls_by_name == ({"write_file": 1, "submit": 1} if record.reward == 1.0 else {})
    # One E2B sandbox per rollout, each created from the template named and killed once its episode ended.
    assert len(cloud.create_calls) == len(cloud.sandboxes) >= 4
    assert {call["template"] for call in cloud.create_calls} == {"fake"}
    assert all(sandbox.killed for sandbox in cloud.sandboxes), "an E2B sandbox was left alive"
    assert loops() == running, "a factory's loop was left running"


def test_e2b_white_box_sessions_without_a_key_are_refused_when_the_factory_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    with pytest.raises(RolloutConfigError, match="sandbox e2b needs E2B_API_KEY"):
        LocalWhiteBoxSessionFactory(str(EXAMPLES), split="train", sandbox="e2b")
