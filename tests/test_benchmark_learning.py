"""The learning benchmark runs the dev loop (trained, then frozen) end to end in its quick configuration,
reports both curves and every target, and leaves nothing running."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness_trainer.devloop.run import reward_windows
from tests.benchmark_scripts import BENCHMARKS, load_benchmark, run_quick

benchmark_learning = load_benchmark("learning")


def test_reward_windows_are_a_quarter_of_the_steps() -> None:
    rewards = [
        0.0,
        0.25,
        0.5,
        0.25,
        0.5,
        1.0,
        0.75,
        1.0,
        1.0,
        0.75,
        1.0,
        1.0,
        0.5,
        1.0,
        1.0,
        1.0,
        1.0,
        0.75,
        1.0,
        1.0,
    ]
    assert reward_windows(rewards) == (5, pytest.approx(0.3), pytest.approx(0.95))
    assert reward_windows([0.5, 1.0]) == (1, 0.5, 1.0)


def test_verdicts_need_a_rise_over_the_first_steps_and_over_the_frozen_run() -> None:
    run = {"k": 5, "seconds": 480.0}
    result = {
        "config": {"quick": False},
        "trained": run | {"first": 0.6, "last": 0.95},
        "frozen": run | {"first": 0.6, "last": 0.55},
    }
    assert [v["pass"] for v in benchmark_learning.verdicts(result)] == [True, True, True]
    result["frozen"]["last"] = 0.9  # the same rise without training: not learning
    assert [v["pass"] for v in benchmark_learning.verdicts(result)] == [True, False, True]
    result["trained"] |= {"first": 0.8, "seconds": 660.0}
    assert [v["pass"] for v in benchmark_learning.verdicts(result)] == [False, False, False]


def test_the_vllm_arm_has_its_own_rise_targets_and_report_rows() -> None:
    from benchmarks import report

    run = {"k": 5, "seconds": 480.0, "rewards": [0.5] * 20}
    result = {
        "config": {"quick": False},
        "trained": run | {"first": 0.6, "last": 0.95},
        "frozen": run | {"first": 0.6, "last": 0.55},
        "vllm": {"trained": run | {"first": 0.5, "last": 0.6}, "frozen": run | {"first": 0.5, "last": 0.5}},
    }
    verdicts = benchmark_learning.verdicts(result)
    assert [v["target"].startswith("vllm: ") for v in verdicts] == [False, False, False, True, True]
    assert [v["pass"] for v in verdicts] == [True, True, True, False, False]  # vllm: +0.10 and +0.10
    section = report.section("learning", result)
    measures = [row.measure for row in section.rows]
    assert "vllm trained: mean reward, last 5 steps vs first 5" in measures
    assert "vllm last 5 steps: trained vs frozen" in measures
    assert "vllm reward 0.50 -> 0.60" in section.headline


def test_the_lora_arm_runs_the_vllm_flags_with_lora_and_reports_under_its_own_name() -> None:
    from benchmarks import report

    assert benchmark_learning.ENGINE_ARMS["vllm-lora"] == [*benchmark_learning.ENGINE_ARMS["vllm"], "--lora"]
    run = {"k": 5, "seconds": 480.0, "rewards": [0.5] * 20}
    result = {
        "config": {"quick": False},
        "vllm-lora": {
            "trained": run | {"first": 0.5, "last": 0.8},
            "frozen": run | {"first": 0.5, "last": 0.7},
        },
    }
    verdicts = benchmark_learning.verdicts(result)
    arms_and_passes = [(v["target"].split(":")[0], v["pass"]) for v in verdicts]
    assert arms_and_passes == [("vllm-lora", True), ("vllm-lora", False)]  # +0.30 rise, +0.10 over frozen
    section = report.section("learning", result)
    assert [row.measure for row in section.rows] == [
        "vllm-lora trained: mean reward, last 5 steps vs first 5",
        "vllm-lora last 5 steps: trained vs frozen",
    ]
    assert section.headline.startswith("vllm-lora reward 0.50 -> 0.80")


def test_an_unknown_arm_is_refused_naming_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        benchmark_learning.main(["--engines", "dev,sglang"])
    assert "unknown engine(s) ['sglang']; choose from dev,vllm,vllm-lora" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(600)  # it ran past 300 s beside another test process (pytest -n 2) on 2 cores
def test_quick_learning_benchmark_runs_both_dev_loops_and_leaves_nothing_running(tmp_path: Path) -> None:
    out = tmp_path / "result.json"

    run = run_quick(BENCHMARKS / "learning.py", out, 400, "the quick learning benchmark", stop_s=90)

    assert run.returncode == 0, run.stdout[-4000:]
    lines = run.stdout.splitlines()
    assert any(line.startswith("trained ") for line in lines) and any(
        line.startswith("frozen ") for line in lines
    )
    for name in benchmark_learning.TARGET_NAMES:
        assert any(line.split()[:1] in (["PASS"], ["MISS"]) and name in line for line in lines), name
    result = json.loads(out.read_text())
    for name in ("trained", "frozen"):
        assert len(result[name]["rewards"]) == 2 and result[name]["k"] == 1 and result[name]["seconds"] > 0
    assert result["frozen"]["flags"][-2:] == ["--learning-rate", "1e-09"]
    assert result["leftover_processes"] == []
