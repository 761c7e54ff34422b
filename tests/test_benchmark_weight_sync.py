"""The weight-push benchmark's verdicts: the 0.5B targets fixed in its docstring, per push kind (its quick run
against a real vLLM: ``test_benchmark_weight_sync_vllm_cpu.py``)."""

from __future__ import annotations

from tests.benchmark_scripts import load_benchmark

weight_sync = load_benchmark("weight_sync")


def test_the_verdicts_judge_the_median_pause_and_speed_up_of_each_push_kind() -> None:
    m = {
        "restart_median_s": 60.0, "file_s": [5.0, 5.5, 20.0], "pause_s": [2.0, 3.5, 2.5],
        "adapter_s": [1.0, 1.0, 1.0], "adapter_pause_s": [0.5, 0.5, 4.0],
    }  # fmt: skip
    verdicts = {v["target"]: v for v in weight_sync.verdicts_for(m)}
    assert [v["pass"] for v in verdicts.values()] == [True, True, True, True]
    assert verdicts["file push: engine paused <= 3 s at 0.5B (median)"]["measured"] == "2.50 s (worst 3.50 s)"
    assert (
        "5.50 s vs 60.0 s: 10.9x (worst 3.0x)"
        in verdicts["file push >= 10x faster than save + restart at 0.5B (median)"]["measured"]
    )
    m["file_s"] = [7.0, 7.0, 7.0]
    assert [v["pass"] for v in weight_sync.verdicts_for(m)][:2] == [True, False]
    assert len(weight_sync.verdicts_for({**m, "adapter_s": None})) == 2  # no adapter arm: its rows left out
