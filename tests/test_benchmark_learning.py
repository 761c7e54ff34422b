"""The learning benchmark: trained and frozen dev loops over seeds, judged on held-out pass@1 by the paired
difference's 95 % interval, plus the first run's time from a fresh cache; its quick configuration runs end
to end, reports every run and target, and leaves nothing running."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from harness_trainer.devloop.run import EXAMPLE_TASKS, reward_windows
from tests.benchmark_scripts import BENCHMARKS, load_benchmark, run_quick

benchmark_learning = load_benchmark("learning")


def test_reward_windows_are_a_quarter_of_the_steps() -> None:
    rewards = [0.0, 0.25, 0.5, 0.25, 0.5] + [1.0] * 10 + [1.0, 1.0, 0.75, 1.0, 1.0]
    assert reward_windows(rewards) == (5, pytest.approx(0.3), pytest.approx(0.95))
    assert reward_windows([0.5, 1.0]) == (1, 0.5, 1.0)


def runs_of(
    engine: str,
    trained_end: list[float],
    frozen_end: list[float],
    start: float = 0.5,
    mode: str = "black-box",
) -> list[dict]:
    """Hand-made runs of one arm: seed i's trained run ends at ``trained_end[i]``, its frozen one at
    ``frozen_end[i]`` (pass@k: the same plus 0.125)."""
    runs = []
    for seed, (trained, frozen) in enumerate(zip(trained_end, frozen_end, strict=True)):
        for kind, end in (("trained", trained), ("frozen", frozen)):
            runs.append({"mode": mode, "engine": engine, "kind": kind, "seed": seed, "start": start,
                         "end": end, "pass_at_k_start": start + 0.125, "pass_at_k_end": end + 0.125,
                         "rewards": [0.5, 0.75], "k": 1, "first": 0.5, "last": 0.75, "seconds": 480.0,
                         "cache": "cached"})  # fmt: skip
    return runs


def result_of(arms: dict[str, list[dict]], first_run_s: float = 600.0) -> dict[str, Any]:
    config = {"quick": False, "seeds": [0, 1, 2], "max_steps": 20, "tasks": "harness_trainer/examples/tasks",
              "eval_num_generations": 4, "eval_temperature": 0.7, "first_run_minutes": 12.0,
              "modes": ["black-box"]}  # fmt: skip
    return {
        "config": config,
        "arms": {
            engine: {"runs": runs, "summary": benchmark_learning.summarize(runs)}
            for engine, runs in arms.items()
        },
        "first_run": {"seconds": first_run_s, "k": 5, "first": 0.7, "last": 0.95, "pass_at_1": [0.0, 0.5]},
        "elapsed_s": 3600.0,
    }


def test_a_difference_interval_above_zero_passes_the_target() -> None:
    # Differences +0.25, +0.25, +0.375: mean +0.29, t(2) half-width 0.18.
    result = result_of({"black-box dev": runs_of("dev", [0.75, 0.75, 0.875], [0.5, 0.5, 0.5])})
    difference = result["arms"]["black-box dev"]["summary"]["difference"]["end"]
    assert difference["mean"] == pytest.approx(0.2917, abs=1e-4) and difference["low"] > 0
    names = benchmark_learning.TARGET_NAMES
    assert [(v["target"], v["pass"]) for v in benchmark_learning.verdicts(result)] == [
        (f"black-box dev: {names[0]}", True),
        (f"black-box dev: {names[2]}", True),  # 0.79 against 0.5: 1.58x
        (names[1], True),
    ]


def test_trained_must_end_at_least_one_and_a_half_times_frozen() -> None:
    # +0.2 on every seed: the interval passes, 0.6 against 0.4 (1.5x) passes, 0.59 against 0.4 does not.
    passing = result_of({"black-box dev": runs_of("dev", [0.6, 0.6, 0.6], [0.4, 0.4, 0.4])})
    ratio = benchmark_learning.verdicts(passing)[1]
    assert ratio["pass"] is True and ratio["measured"] == "0.600 vs 0.400: 1.50x"
    missing = result_of({"black-box dev": runs_of("dev", [0.59, 0.59, 0.59], [0.4, 0.4, 0.4])})
    assert [v["pass"] for v in benchmark_learning.verdicts(missing)[:2]] == [True, False]
    nothing = result_of({"black-box dev": runs_of("dev", [0.0, 0.0, 0.0], [0.0, 0.0, 0.0])})
    assert benchmark_learning.verdicts(nothing)[1]["pass"] is False  # 0 against 0 is no transfer


def test_a_positive_mean_difference_whose_interval_straddles_zero_misses() -> None:
    # Differences +0.5, 0, +0.25: mean +0.25, but over 3 seeds its interval is [-0.37, +0.87].
    result = result_of({"black-box dev": runs_of("dev", [1.0, 0.5, 0.75], [0.5, 0.5, 0.5])})
    verdict = benchmark_learning.verdicts(result)[0]
    assert verdict["pass"] is False
    assert verdict["measured"] == "+0.25 [-0.37, +0.87] over 3 seeds"


def test_the_first_run_must_take_under_twelve_minutes() -> None:
    arms = {"black-box dev": runs_of("dev", [0.75, 0.75, 0.875], [0.5, 0.5, 0.5])}
    assert benchmark_learning.verdicts(result_of(arms, first_run_s=11.5 * 60))[-1]["pass"] is True
    missed = benchmark_learning.verdicts(result_of(arms, first_run_s=12.5 * 60))[-1]
    assert missed["pass"] is False and missed["measured"] == "12.5 min (the default harness-trainer dev)"


def test_step_zero_and_the_end_are_summarized_per_kind_and_paired() -> None:
    summary = benchmark_learning.summarize(runs_of("dev", [0.75, 0.75, 0.875], [0.5, 0.5, 0.5]))
    assert summary["seeds"] == [0, 1, 2]
    assert (
        summary["trained"]["start"]
        == summary["frozen"]["start"]
        == {"mean": 0.5, "low": 0.5, "high": 0.5, "n": 3}
    )
    assert summary["difference"]["start"]["mean"] == 0.0
    assert summary["frozen"]["end"]["mean"] == 0.5
    assert summary["pass_at_k"]["trained"]["end"]["mean"] == pytest.approx(0.9167, abs=1e-4)


def test_runs_that_do_not_pair_by_seed_are_refused() -> None:
    runs = runs_of("dev", [0.75, 0.75], [0.5, 0.5])
    with pytest.raises(ValueError, match="nothing to pair"):
        benchmark_learning.summarize(runs[:-1])


def test_a_run_without_an_evaluation_at_its_end_is_an_error() -> None:
    assert benchmark_learning.start_and_end([0, 10, 20], [0.25, 0.5, 0.75], 20, "run") == (0.25, 0.75)
    with pytest.raises(RuntimeError, match=r"dev-trained-seed0: no held-out evaluation at step\(s\) \[20\]"):
        benchmark_learning.start_and_end([0, 5, 10, 15], [0.25] * 4, 20, "dev-trained-seed0")
    with pytest.raises(RuntimeError, match=r"step\(s\) \[0, 2\]"):
        benchmark_learning.start_and_end([], [], 2, "run")


def test_each_arm_mode_and_engine_has_its_own_targets_and_report_rows() -> None:
    from benchmarks import report

    result = result_of({
        "black-box dev": runs_of("dev", [0.75, 0.75, 0.875], [0.5, 0.5, 0.5]),
        "white-box vllm-lora": runs_of("vllm-lora", [1.0, 0.5, 0.75], [0.5, 0.5, 0.5], mode="white-box"),
    })  # fmt: skip
    verdicts = benchmark_learning.verdicts(result)
    names = benchmark_learning.TARGET_NAMES
    assert [v["target"] for v in verdicts] == [
        f"black-box dev: {names[0]}", f"black-box dev: {names[2]}",
        f"white-box vllm-lora: {names[0]}", f"white-box vllm-lora: {names[2]}", names[1],
    ]  # fmt: skip
    assert [v["pass"] for v in verdicts] == [True, True, False, True, True]
    section = report.section("learning", result)
    measures = [row.measure for row in section.rows]
    assert "white-box vllm-lora held-out pass@1 at step 20: trained - frozen, paired by seed" in measures
    assert "black-box dev held-out pass@k at step 20: trained vs frozen" in measures
    assert (
        "white-box vllm-lora held-out pass@1 trained 0.75 [0.13, 1.37] vs frozen 0.50 [0.50, 0.50]"
        in section.headline
    )


def test_the_report_headline_gives_both_arms_the_difference_and_the_first_run() -> None:
    from benchmarks import report

    result = result_of(
        {"black-box dev": runs_of("dev", [0.75, 0.75, 0.875], [0.5, 0.5, 0.5])}, first_run_s=672.0
    )
    section = report.section("learning", result, seconds=3600.0)
    assert section.headline == (
        "black-box dev held-out pass@1 trained 0.79 [0.61, 0.97] vs frozen 0.50 [0.50, 0.50]; diff +0.29 "
        "[+0.11, +0.47]; first run 11.2 min"
    )
    rows = {row.measure: row for row in section.rows}
    warm = rows["black-box dev held-out pass@1 at step 0 (the warm model): trained vs frozen"]
    assert warm.value == "0.50 [0.50, 0.50]"
    assert rows["first run (fresh cache, warm-up included)"].cells()[1:4] == (
        "11.2 min",
        "12 min target",
        "0.93x",
    )
    assert any(
        note.startswith("black-box dev trained seed 0: 8.0 min (cached); held-out pass@1 0.50 -> 0.75")
        for note in section.notes
    )
    assert (
        "first run: the default harness-trainer dev in an empty cache, 11.2 min (reward 0.70 over its first "
        "5 steps, 0.95 over the last; held-out pass@1 0.00 -> 0.50)" in section.notes
    )
    assert "## learning: " in report.render_section(section)


def parse(*argv: str) -> dict[str, Any]:
    parser = benchmark_learning.build_parser()
    return benchmark_learning.resolve(parser.parse_args(list(argv)), parser)


def test_the_default_configuration_is_the_reported_one_and_quick_is_the_plumbing() -> None:
    from harness_trainer.examples import TOY_SKILLS

    config = parse()
    assert (config["seeds"], config["max_steps"], config["eval_steps"], config["engines"]) == (
        [0, 1, 2, 3],
        10,
        10,
        ["dev"],
    )
    assert (config["eval_num_generations"], config["eval_temperature"]) == (8, 0.7)
    assert (config["tasks"], config["modes"], config["recipe"]) == (
        str(TOY_SKILLS),
        ["black-box", "white-box"],
        benchmark_learning.RECIPE,
    )
    assert config["first_run"] is True and parse("--no-first-run")["first_run"] is False
    quick = parse("--quick")
    assert (quick["seeds"], quick["max_steps"], quick["eval_steps"]) == ([0, 1], 2, 2)
    assert (quick["tasks"], quick["modes"], quick["recipe"]) == (str(EXAMPLE_TASKS), ["black-box"], "")
    assert parse("--quick", "--seeds", "3,4,5")["seeds"] == [3, 4, 5]


def test_the_recipe_reaches_both_arms_and_the_frozen_learning_rate_comes_last() -> None:
    config = parse("--recipe", "--groups-per-step 2 --learning-rate 0.5 --config 'my file.toml'")
    trained = benchmark_learning.run_flags(config, "white-box", "dev", "trained", 0)
    frozen = benchmark_learning.run_flags(config, "white-box", "dev", "frozen", 0)
    recipe = ["--groups-per-step", "2", "--learning-rate", "0.5", "--config", "my file.toml"]
    for flags in (trained, frozen):
        assert flags[flags.index("--groups-per-step") : flags.index("--groups-per-step") + 6] == recipe
    assert frozen[-2:] == ["--learning-rate", "1e-09"] and trained == frozen[:-2]


def test_a_relative_task_folder_is_passed_on_absolute(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(EXAMPLE_TASKS.parent)
    assert parse("--tasks", "tasks")["tasks"] == str(EXAMPLE_TASKS)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--engines", "dev,sglang"], "unknown engine(s) ['sglang']; choose from dev,vllm,vllm-lora"),
        (["--seeds", "0"], "--seeds needs at least 2 distinct seeds"),
        (["--seeds", "1,1"], "--seeds needs at least 2 distinct seeds"),
        (["--eval-steps", "3"], "--eval-steps 3 must divide --max-steps 10"),
        (["--eval-steps", "0"], "--eval-steps 0 must divide --max-steps 10"),
    ],
)
def test_a_configuration_without_a_verdict_is_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse(*argv)
    assert message in capsys.readouterr().err


def test_a_task_folder_without_a_test_split_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "train" / "one").mkdir(parents=True)
    (tmp_path / "train" / "one" / "task.toml").write_text("")
    with pytest.raises(SystemExit):
        parse("--tasks", str(tmp_path))
    assert "has no split test (it needs train, test)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("--tasks", str(tmp_path / "train" / "one" / "task.toml"))
    assert "no such folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("--tasks", str(tmp_path / "train" / "one"))  # a folder, but of no tasks
    assert "no task folders" in capsys.readouterr().err


def test_a_run_gets_the_seed_the_evaluation_the_arm_and_for_frozen_the_tiny_learning_rate() -> None:
    config = parse("--quick", "--eval-num-generations", "2", "--eval-temperature", "0.5")
    flags = benchmark_learning.run_flags(config, "black-box", "vllm-lora", "frozen", 1)
    assert flags[:6] == ["--seed", "1", "--tasks", config["tasks"], "--max-steps", "2"]
    assert flags[6:12] == ["--eval-steps", "2", "--eval-num-generations", "2", "--eval-temperature", "0.5"]
    assert flags[12:] == [
        *benchmark_learning.QUICK_FLAGS,
        "--mode",
        "black-box",
        "--engine",
        "vllm",
        "--lora",
        "--learning-rate",
        "1e-09",
    ]
    assert benchmark_learning.run_flags(config, "black-box", "dev", "trained", 1)[-2:] == [
        "--mode",
        "black-box",
    ]


def test_each_mode_is_an_arm_and_reaches_its_runs() -> None:
    config = parse("--quick", "--mode", "white-box,black-box")
    assert config["modes"] == ["white-box", "black-box"]
    for mode, engine, kind in (("white-box", "dev", "trained"), ("black-box", "vllm", "frozen")):
        flags = benchmark_learning.run_flags(config, mode, engine, kind, 0)
        assert flags[flags.index("--mode") + 1] == mode and flags.count("--mode") == 1
    for bad in ("grey-box", "black-box,black-box", ","):
        with pytest.raises(SystemExit):
            parse("--mode", bad)


def test_the_fresh_cache_is_empty_but_for_a_link_to_the_machines_tool_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HARNESS_TRAINER_CACHE", str(tmp_path / "normal"))
    fresh = benchmark_learning.fresh_cache(tmp_path / "fresh")
    assert [p.name for p in fresh.iterdir()] == ["tools"]
    assert (fresh / "tools").resolve() == (tmp_path / "normal" / "tools").resolve()


@pytest.mark.slow
@pytest.mark.timeout(1500)  # four dev loops; on 2 busy cores each took up to 2 min
def test_quick_learning_benchmark_runs_both_arms_over_two_seeds_and_leaves_nothing_running(
    tmp_path: Path,
) -> None:
    out = tmp_path / "result.json"

    run = run_quick(BENCHMARKS / "learning.py", out, 1200, "the quick learning benchmark", stop_s=90)

    assert run.returncode == 0, run.stdout[-4000:]
    lines = run.stdout.splitlines()
    labels = (
        "black-box dev trained",
        "black-box dev frozen (lr 1e-09)",
        "black-box dev trained - frozen, paired",
    )
    for label in labels:
        assert any(line.startswith(label) for line in lines), label
    for name in benchmark_learning.TARGET_NAMES:
        assert any(line.split()[:1] in (["PASS"], ["MISS"]) and name in line for line in lines), name
    result = json.loads(out.read_text())
    runs = result["arms"]["black-box dev"]["runs"]
    assert [(r["seed"], r["kind"]) for r in runs] == [
        (0, "trained"),
        (0, "frozen"),
        (1, "trained"),
        (1, "frozen"),
    ]
    for r in runs:
        assert r["eval_steps"] == [0, 2] and len(r["rewards"]) == 2 and r["seconds"] > 0
        assert r["cache"] == "cached" and "--mode" in r["flags"]  # the quick runs build no warm-up
    assert runs[1]["flags"][-2:] == ["--learning-rate", "1e-09"]
    # The first run is its own: the dev loop with no flag of the arms', in an empty cache.
    first = result["first_run"]
    assert first["flags"] == [*benchmark_learning.QUICK_FLAGS, "--max-steps", "2"] and first["seconds"] > 0
    assert first["eval_steps"] == [0] and len(first["pass_at_1"]) == 1 and first["built_warmup"] is False
    assert any(line.startswith("first run (the default dev loop, fresh cache") for line in lines)
    assert result["arms"]["black-box dev"]["summary"]["difference"]["end"]["n"] == 2
    assert result["leftover_processes"] == []


def test_a_family_whose_test_split_leaks_is_refused_naming_the_pair(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    from harness_trainer.examples import TOY_SKILLS

    leaky = tmp_path / "leaky"
    shutil.copytree(TOY_SKILLS, leaky)
    copied = sorted((leaky / "train").iterdir())[0]
    shutil.copytree(copied, leaky / "test" / "reworded-copy")
    (leaky / "test" / "reworded-copy" / "instruction.md").write_text("Say it another way.\n")
    with pytest.raises(SystemExit):
        parse("--tasks", str(leaky))
    said = capsys.readouterr().err
    assert "its test split is not held out" in said and "'reworded-copy'" in said and copied.name in said
    assert parse("--tasks", str(TOY_SKILLS))["tasks"] == str(TOY_SKILLS)  # the shipped family is held out
