"""``harness-trainer dev --harness toy,mini-swe-agent``: one run trains across two real agents, each GRPO
group on one, and its metrics, coverage, curves and viewer say which; a resumed run goes on with the same
schedule and the counts it had."""

from __future__ import annotations

import json
import subprocess
from collections import Counter

import pytest

from harness_trainer.rollouts.harness_mix import harness_mix
from harness_trainer.trainer.feed.coverage import COVERAGE_FILE
from harness_trainer.trainer.feed.rollout_log import read_rollout_log
from tests.devloop.test_dev_command import ROOT, dev

pytestmark = pytest.mark.slow
MIX = ["toy", "mini-swe-agent"]


def test_a_run_across_two_harnesses_deals_groups_splits_its_metrics_and_resumes_the_schedule(tmp_path):
    for steps, extra in ((2, []), (4, ["--resume"])):
        done = subprocess.run(
            dev(tmp_path, "--harness", ",".join(MIX), "--max-steps", str(steps), *extra), cwd=ROOT,
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = tmp_path / "run"
    schedule = harness_mix(MIX)

    records = read_rollout_log(run, validate_traces=False)
    assert records and all(r.harness == schedule.for_group(r.group) for r in records)
    # Each group on one harness, and what ran says so: each agent's own system prompt in its captures.
    taken = {(r.group, r.harness) for r in records if r.step is not None}
    assert {harness for _, harness in taken} == set(MIX)
    prompts = {
        harness: {
            r.trace.turns[0].request["messages"][0]["content"]
            for r in records
            if r.harness == harness and r.trace is not None and r.trace.turns
        }
        for harness in MIX
    }
    assert all(len(p) == 1 for p in prompts.values()) and prompts["toy"] != prompts["mini-swe-agent"]
    # mini-swe-agent's own trajectory agrees with what the proxy saw; the toy agent keeps none.
    checked = [r for r in records if r.agreement is not None]
    assert checked and all(
        r.agreement == ("match" if r.harness == "mini-swe-agent" else "not_available") for r in checked
    ), [(r.harness, r.agreement, r.agreement_detail) for r in checked]

    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    for line in lines:
        step_groups = {(r.group, r.harness) for r in records if r.step == line["step"]}
        for harness, count in Counter(h for _, h in step_groups).items():
            assert line[f"harness/{harness}/groups"] == count
            assert line[f"harness/{harness}/agreement_mismatch"] == 0
            assert f"harness/{harness}/rollouts" in line and f"harness/{harness}/unscorable" in line
        assert not {key.split("/")[1] for key in line if key.startswith("harness/")} - {
            h for _, h in step_groups
        }

    # The coverage counts every group the four steps took, across the resume, once.
    coverage = json.loads((run / COVERAGE_FILE).read_text())
    counted = Counter()
    for by_harness in coverage["tasks"].values():
        for harness, counts in by_harness.items():
            counted[harness] += counts["groups"]
    assert counted == Counter(harness for _, harness in taken)
    assert coverage["harnesses"] == sorted(MIX)

    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    viewer = (run / "viewer.html").read_text()
    assert "harness toy" in viewer and "harness mini-swe-agent" in viewer
