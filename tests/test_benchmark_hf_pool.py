"""The pooled HF sandbox benchmark: its quick configuration end to end against the fake Hub (32 pooled
starts at once, scaled latencies), its verdict, and its section of the report."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks.report_sandboxes import hf_pool_section
from tests.benchmark_scripts import BENCHMARKS, load_benchmark, run_to_end

hf_pool = load_benchmark("hf_pool")

pytestmark = pytest.mark.docker  # the fake Hub's jobs run images exported from the Docker daemon


def test_quick_hf_pool_starts_every_sandbox_near_its_yardstick_and_leaves_no_job(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    command = [sys.executable, str(BENCHMARKS / "hf_pool.py"), "--quick", "--json", str(out)]

    run = run_to_end(command, 90, "the quick benchmark")

    assert run.returncode == 0, run.stdout[-4000:]
    result = json.loads(out.read_text())
    (burst,) = result["runs"]
    assert result["config"]["starts"] == 32 and burst["started"] == 32 and burst["failed"] == 0
    assert burst["hosts"] == 1 and result["leftover_jobs"] == 0
    # the yardstick: a host's start (3 s at scale 0.1) and 32 creates at 100/s; nothing beats the host's start
    assert burst["bound_s"] == pytest.approx(3.0 + 32 / 100) and burst["t_last_s"] >= 3.0
    assert burst["ratio"] == pytest.approx(burst["t_last_s"] / burst["bound_s"])
    assert [v["target"] for v in result["verdicts"]] == list(hf_pool.TARGETS) and result["all_pass"]
    section = hf_pool_section(result)
    assert section.name == "hf_pool" and section.verdicts == result["verdicts"]
    assert section.rows[0].ratios == [burst["ratio"]] and "32 pooled starts" in section.rows[0].measure
