"""The prefix-step benchmark runs end to end in its quick configuration (synthetic groups: its numbers mean
nothing) and reports every way and target; its pure parts on their own."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from tests.benchmark_scripts import BENCHMARKS, load_benchmark, run_quick

prefix_step = load_benchmark("prefix_step")


def test_forward_counts_count_each_groups_prompt_once_and_packing_every_time() -> None:
    groups = prefix_step.synthetic_groups(4, 2, seed=0)
    counts = prefix_step.forward_counts(groups, token_budget=8192)
    lengths = [len(r.input_ids) for g in groups for r in g]
    assert counts["packed"] == sum(lengths)
    assert counts["by_prefix"] == counts["unique"] == sum(lengths) - 2 * 3 * 1450
    # Two groups of one task share its prompt: the bound is the tree of all rows, not each group's summed.
    prompt = groups[0][0].input_ids[:1450]
    again = [replace(r, input_ids=prompt + r.input_ids[1450:], rollout=r.rollout + 100) for r in groups[1]]
    both = prefix_step.forward_counts([groups[0], again], token_budget=8192)
    assert both["by_prefix"] == both["unique"] == both["unique_per_group"] - 1450


@pytest.mark.slow
def test_quick_prefix_step_benchmark_reports_every_way_and_target(tmp_path: Path) -> None:
    out = tmp_path / "result.json"

    run = run_quick(BENCHMARKS / "prefix_step.py", out, 300, "the quick benchmark", stop_s=30)

    assert run.returncode == 0, run.stdout[-4000:]
    result = json.loads(out.read_text())
    (measured,) = result["members"].values()
    assert list(measured["ways"]) == list(prefix_step.WAYS) and measured["source"] == "synthetic"
    assert all(way["tps"]["median"] > 0 for way in measured["ways"].values())
    assert measured["ways"][prefix_step.BASELINE]["vs_baseline"]["median"] == pytest.approx(1.0)
    assert len(result["verdicts"]) == 2 and all(isinstance(v["pass"], bool) for v in result["verdicts"])
    assert sum(line.split()[:1] in (["PASS"], ["MISS"]) for line in run.stdout.splitlines()) == 2
