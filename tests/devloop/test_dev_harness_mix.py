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
from harness_trainer.trainer.feed.evaluation import pass_at_k, read_eval, read_eval_rollouts
from harness_trainer.trainer.feed.rollout_log import read_rollout_log
from tests.devloop.test_dev_command import ROOT, dev, one_task, with_a_held_out_task

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


def test_a_run_across_two_harnesses_evaluates_each_held_out_task_k_times_under_each(tmp_path):
    with_a_held_out_task(one_task(tmp_path))
    done = subprocess.run(
        dev(tmp_path, "--harness", ",".join(MIX), "--max-steps", "1", "--eval-steps", "1",
            "--eval-num-generations", "2"),
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = tmp_path / "run"
    evals = read_eval(run)
    assert [(e["step"], e["task_name"], e["harness"], len(e["rewards"])) for e in evals] == [
        (step, "greet-script", harness, 2) for step in (0, 1) for harness in MIX
    ]
    # Every sample under the harness its line names, that agent's own system prompt in its capture.
    samples = read_eval_rollouts(run)
    assert Counter((s.step, s.harness) for s in samples) == {(step, h): 2 for step in (0, 1) for h in MIX}
    prompts = {
        harness: {
            s.trace.turns[0].request["messages"][0]["content"]
            for s in samples
            if s.harness == harness and s.trace is not None and s.trace.turns
        }
        for harness in MIX
    }
    assert all(len(p) == 1 for p in prompts.values()) and prompts["toy"] != prompts["mini-swe-agent"]
    for e in evals:
        mine = sorted(
            (s for s in samples if (s.step, s.harness) == (e["step"], e["harness"])), key=lambda s: s.member
        )
        assert e["rewards"] == [s.reward for s in mine]

    # Each evaluation's metrics: each harness's from its own samples, the overall over both.
    lines = {line["step"]: line for line in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    for step in (0, 1):
        line, mine = lines[step], {e["harness"]: e for e in evals if e["step"] == step}
        for harness, e in mine.items():
            scored = [r for r in e["rewards"] if r is not None]
            passed = sum(r >= 1.0 for r in scored)
            assert line[f"eval/harness/{harness}/pass@1"] == pass_at_k(len(scored), passed, 1)
            assert line[f"eval/harness/{harness}/pass@k"] == pass_at_k(len(scored), passed, 2)
        assert line["eval/pass@1"] == sum(e["pass@1"] for e in mine.values()) / 2
        assert line["eval/tasks"] == 1
    assert "over 1 tasks of split 'test' under each of 2 harnesses" in done.stdout + done.stderr
    viewer = (run / "viewer.html").read_text()
    assert "under toy · 2 sample(s)" in viewer and "under mini-swe-agent · 2 sample(s)" in viewer
