"""The FSDP2 benchmark's ratios, and its quick configuration end to end: one process, two FSDP2 ranks and two
DDP ranks on CPU (gloo), each rank's memory and step time, and its report section."""

from __future__ import annotations

import json

import pytest
import torch

from tests.benchmark_scripts import BENCHMARKS, load_benchmark, run_quick

benchmark_fsdp2 = load_benchmark("fsdp2")


def test_ratios_put_each_two_rank_run_over_the_single_process_and_take_the_largest_rank() -> None:
    rank = {"parameters": 10, "step_s": [1.0, 3.0, 2.0], "peak_rss_mb": 100.0, "held_mb": {"params": 4.0}}
    other = {**rank, "peak_rss_mb": 120.0, "step_s": [2.5]}
    runs = {
        "single": benchmark_fsdp2.summarise([{**rank, "peak_rss_mb": 200.0, "held_mb": {"params": 8.0}}]),
        "fsdp2": benchmark_fsdp2.summarise([rank, other]),
    }
    assert runs["fsdp2"]["peak_rss_mb"] == 120.0 and runs["fsdp2"]["step_s"] == 2.5  # the worst rank
    assert benchmark_fsdp2.ratios(runs) == {"fsdp2": {"peak_rss_mb": 0.6, "held_mb": 0.5, "step_s": 1.25}}


def test_the_report_section_sets_fsdp2_against_both_single_processes_and_names_the_allocator() -> None:
    from benchmarks import report

    def run(rss: float, step: float, mapped: bool) -> dict:
        return {"peak_rss_mb": rss, "held_mb": 10.0, "step_s": step, "parameters": 5e6, "mapped": mapped}

    runs = {
        "single": run(1000.0, 10.0, False), "single_mapped": run(800.0, 10.0, True),
        "fsdp2": run(600.0, 5.0, True), "ddp": run(1100.0, 4.0, False),
    }  # fmt: skip
    config = {"hidden": 64, "layers": 2, "rows": 1, "seq": 32, "steps": 2, "cores": 2, "glibc_default": False}
    result = {
        "runs": runs, "ratios": benchmark_fsdp2.ratios(runs), "config": config, "verdicts": [],
        "fsdp2_vs_single_mapped": {"peak_rss_mb": 0.75, "step_s": 0.5},
    }  # fmt: skip
    section = report.section("fsdp2", result)
    # Like for like: both map large allocations (against glibc's default heap FSDP2 would read 0.60x).
    assert section.headline == (
        "FSDP2 peak RSS per rank 0.75x, step time 0.50x one process, both mapping large allocations"
    )
    mapped = section.rows[-1]
    assert mapped.measure == "one process, large allocations mapped: peak RSS" and mapped.ratios == [0.8]
    assert "the FSDP2 ranks map allocations of 64 KiB" in section.notes[1]
    assert section.notes[2].endswith("peak RSS per rank 0.75x, step time 0.50x")
    config["malloc_mmap_threshold_env"] = "65536"
    same_allocator = report.section("fsdp2", result)
    assert "MALLOC_MMAP_THRESHOLD_=65536 in every run" in same_allocator.notes[1]
    assert same_allocator.headline == "FSDP2 peak RSS per rank 0.60x, step time 0.50x one process"


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_quick_fsdp2_benchmark_measures_every_run_and_halves_the_state_held_per_rank(tmp_path) -> None:
    out = tmp_path / "fsdp2.json"
    run = run_quick(BENCHMARKS / "fsdp2.py", out, 180, "the quick FSDP2 benchmark", stop_s=30)
    assert run.returncode == 0, run.stdout[-4000:]
    result = json.loads(out.read_text())
    assert set(result["runs"]) == {"single", "single_mapped", "fsdp2", "ddp"}
    runs = [result["runs"][name] for name in ("single", "single_mapped", "fsdp2", "ddp")]
    assert [len(run["ranks"]) for run in runs] == [1, 1, 2, 2]
    # As the trainer runs them: FSDP2 ranks map large allocations, the unsharded baseline does not.
    assert [run["mapped"] for run in runs] == [False, True, True, False]
    assert set(result["fsdp2_vs_single_mapped"]) == {"peak_rss_mb", "step_s"}
    assert result["ratios"]["fsdp2"]["held_mb"] == pytest.approx(0.5, abs=0.05)  # sharded: half per rank
    assert result["ratios"]["ddp"]["held_mb"] == pytest.approx(1.0, abs=0.01)  # replicated
    assert all(r["peak_rss_mb"] > 0 and r["step_s"] > 0 for r in result["runs"].values())
    assert "peak RSS/rank" in run.stdout and result["verdicts"][0]["target"] == benchmark_fsdp2.VERDICT
