"""Sandbox starts that fail, against the E2B backend: the scenario of ``test_faults_training`` with the fake
E2B cloud (``tests/sandboxes/fake_e2b.py``) in place of the flaky local backend.

The whole stack runs for real (dev engine, capture proxy, rollout runtime, the toy agent, the trainer);
only E2B's API is the fake, whose sandboxes are namespaces on this machine: the agent runs inside them and
reaches the capture proxy on loopback (a fake sandbox shares the host's network). The cloud's ``create``
answers as E2B does when it fails (errors made by the SDK's own mapping), so the backend's retries and
their classification (``harness_trainer/sandboxes/e2b_errors.py``) run as they would against E2B.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("e2b")

from harness_trainer import HarnessAsyncGRPOTrainer
from tests.hardening.faults import (
    GIVE_UP,
    SOLVE,
    assert_trained_around_group_1,
    descendants,
    describe,
    drawn_failures,
    hello_rows,
    leftover_capture_sessions,
    local_builder,
    new_processes,
    training_config,
)
from tests.rollouts.conftest import live_sandbox_processes, scripted_engine  # noqa: F401
from tests.sandboxes.fake_e2b import FakeE2BCloud, api_error

pytestmark = [
    pytest.mark.slow,
    pytest.mark.docker,
]  # the fake E2B cloud runs images exported from the Docker daemon

TEMPLATE = "ht-hello"


def test_e2b_creates_that_fail_make_rollouts_unscorable_and_counted_and_training_reaches_its_steps(
    scripted_engine,  # noqa: F811
    tiny_model_dir,
    tmp_path,
) -> None:
    """30 % of sandbox starts fail (the local scenario's seeded draw: starts 3 and 4 of the first six, both
    members of group 1), each the way E2B fails: start 3's creates are all rate limited (429, retried with
    backoff until its 3 tries are spent), start 4's template is unknown (404, not retried). The run still
    trains its 2 steps (on groups 0 and 2); both rollouts are unscorable with the E2B error as reason,
    counted in ``rollout/unscorable_total`` and the rollout log; no sandbox is left alive in the cloud, and
    no process or capture session is left here."""
    engine = scripted_engine((SOLVE + GIVE_UP) * 10)
    before = descendants(os.getpid())
    assert drawn_failures(6, failure_rate=0.3, seed=2) == [3, 4]
    rate_limited = [api_error(429, "too many sandbox creations for this team") for _ in range(3)]
    unknown_template = [api_error(404, f"template '{TEMPLATE}' not found")]
    failures_by_start: dict[int, list[Exception]] = {3: rate_limited, 4: unknown_template}
    cloud = FakeE2BCloud(tmp_path / "e2b")
    cloud.create_failures = [f for start in range(1, 7) for f in failures_by_start.get(start, [None])]
    capture, out = tmp_path / "capture", tmp_path / "out"
    options: dict[str, Any] = {
        "sandbox_class": cloud,
        "template": TEMPLATE,
        "retry_backoff_s": 0.01,
        "rate_limit_backoff_s": 0.02,
        "kill_grace_s": 0.5,
    }
    # Cold starts only: the failures are scripted by create order, and with one setup per group a member
    # whose start from its group's snapshot fails starts cold (tests/rollouts/test_group_setup.py).
    builder = local_builder(
        engine.url, sandbox="e2b", sandbox_options={"e2b": options}, data_dir=capture, group_setup=False
    )
    trainer = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir), builder, training_config(out, engine.url), train_dataset=hello_rows()
    )
    trainer.train()

    failed = assert_trained_around_group_1(trainer, out)
    reasons = [
        f"SandboxStartError: E2B sandbox for hello-file (template '{TEMPLATE}') did not start after 3 tries; "
        f"last error: rate limited (RateLimitException): {rate_limited[-1]}",
        f"SandboxStartError: E2B refused to create a sandbox for hello-file (template '{TEMPLATE}') after "
        f"1 try; last error: template not found (SandboxException): {unknown_template[0]}",
    ]
    for record, reason in zip(failed, reasons, strict=True):  # the session raises "RolloutUnscorable: …"
        assert (record.unscorable or "").endswith(f"unscorable: {reason}"), record.unscorable
    # Starts 1, 2, 5, 6 created once each; start 3 tried 3 times, start 4 once. Later starts (the trainer
    # may begin a group it then cancels) only add successful creates.
    assert cloud.create_failures == [] and len(cloud.create_calls) >= 8
    assert len(cloud.sandboxes) == len(cloud.create_calls) - 4
    assert all(call["template"] == TEMPLATE for call in cloud.create_calls)
    assert_nothing_left(before, cloud, capture)


def assert_nothing_left(before: set[int], cloud: FakeE2BCloud, capture: Path) -> None:
    """Every sandbox the cloud made is killed (its namespace and files gone); no agent or other child
    process, no capture session journal left behind."""
    assert [s.sandbox_id for s in cloud.sandboxes if not s.killed] == []
    assert sorted(p.name for p in cloud.root.glob("fake-*")) == []
    assert live_sandbox_processes() == []
    leaked = new_processes(before)
    assert not leaked, describe(leaked)
    assert leftover_capture_sessions(capture) == []
