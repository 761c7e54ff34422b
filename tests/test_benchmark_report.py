"""The benchmark report: its pure rendering on hand-made results, and ``python -m benchmarks --quick`` end to
end (every section, the machine, ratio columns, the README block replaced in a copy)."""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks import learning_search, report
from benchmarks.report_rows import Row
from tests.benchmark_scripts import ROOT, run_to_end

MACHINE_KEYS = ("CPU", "cores", "RAM", "OS", "Python", "torch", "date", "git commit")


def verdict(target: str, ok: bool) -> dict[str, Any]:
    return {"target": target, "pass": ok, "measured": f"measured {target}"}


def engine_result() -> dict[str, Any]:
    repeats = [{"baseline_tps": 100.0, "server_tps": 90.0}, {"baseline_tps": 100.0, "server_tps": 95.0}]
    return {
        "config": {"prompts": 2, "max_tokens": 16, "threads": 1},
        "repeats": repeats,
        "baseline_tps": {"median": 100.0, "min": 100.0, "max": 100.0},
        "server_tps": {"median": 92.5, "min": 90.0, "max": 95.0},
        "verdicts": [verdict("server overhead < 10%", True)],
        "elapsed_s": 9.0,
    }


def proxy_result() -> dict[str, Any]:
    def target(rps: float, p50: float, repeats: list[dict[str, float]]) -> dict[str, Any]:
        return {"rps": rps, "p50_ms": p50, "added_p50_ms": 0.5, "added_p99_ms": 1.5, "repeats": repeats}

    point = {
        "paced": False,
        "targets": {
            "direct": target(1000, 1.0, [{"p50_ms": 1.0}, {"p50_ms": 2.0}]),
            "passthrough": target(800, 1.2, [{}, {}]),
            "proxy": target(
                600, 2.0, [{"vs_passthrough": 0.7, "p50_ms": 2.0}, {"vs_passthrough": 0.8, "p50_ms": 3.0}]
            ),
        },
    }
    return {
        "config": {"turns": 4, "repeats": 2, "agents": [1]},
        "points": {"c1 json": point},
        "memory": {"per_session_mb": 0.08, "trace_export_ms": {"median": 2.0}},
        "verdicts": [verdict("throughput", False), verdict("cpu", True)],
    }


def rollouts_result() -> dict[str, Any]:
    point = {"sessions": 8, "held": 6, "failed": 2, "cpu_pct_core": 3.5}
    return {
        "config": {"steps": 2},
        "raw": {"median_s": 0.1},
        "rollout": {"median_s": 0.15, "runs_s": [0.14, 0.16]},
        "overhead_s": 0.05,
        "overhead_parts_s": {"sandbox_start": 0.02, "rest": 0.03},
        "points": [point],
        "verdict": verdict(">= 512 sessions", False),
    }


def trainer_result() -> dict[str, Any]:
    def variant(tps: float, ratio: float) -> dict[str, Any]:
        return {"tps": {"median": tps}, "repeats": [{"vs_padded": ratio}]}

    return {
        "config": {"token_budget": 2048},
        "packing": {
            "workload": {"rows": 12, "tokens": 5000},
            "variants": {"packed": variant(750.0, 1.5), "padded": variant(500.0, 1.0)},
        },
        "rows": {
            "forwarded_tokens": 101,
            "unique_tokens": 100,
            "forwarded_per_unique": 1.01,
            "ms_per_million_input": 3.4,
        },
        "verdicts": [verdict("packed >= 1.5x padded", True)],
    }


def soak_result() -> dict[str, Any]:
    process = {"rss_mb_start": 60.0, "rss_mb_end": 61.0, "rss_slope_mb_per_100": 0.5}
    process |= {"fds_start": 20, "fds_end": 21, "threads_start": 10, "threads_end": 10}

    def wave(label: str, per_call: float, server: dict[str, float] | None) -> dict[str, Any]:
        common = {"rollouts": 4, "seconds": 0.4, "failed": 0, "bytes_per_call": per_call, "server": server}
        return {"wave": label, "counted": label.isdigit(), **common}

    waves = [wave("warm-up 1", 5000.0, {"rss_mb": 60.0, "fds": 20}), wave("1", 5000.0, None)]
    waves.append(wave("2", 5100.0, {"rss_mb": 61.0, "fds": 21}))
    journal = {"bytes_per_call_first": 5000.0, "expected_bytes": 80000.0, "written_bytes": 80800.0}
    end = {"sessions": 0, "capture_sessions": 0, "sandboxes": 0}
    return {
        "config": {"concurrency": 4, "steps": 4, "warmup": 4},
        "counted_rollouts": 8,
        "processes": {"server": process, "engine": dict(process)},
        "journal": journal,
        "waves": waves,
        "end": end,
        "leftover_processes": [],
        "verdicts": [verdict("memory flat", True), verdict("no fd growth", True)],
    }


def weight_sync_result() -> dict[str, Any]:
    model = {"parameters": 494_000_000, "first_start_s": 50.0, "file_s": [10.0, 12.0], "restart_s": [60.0],
             "file_median_s": 11.0, "restart_median_s": 60.0, "speedups": [6.0, 5.0],
             "pause_s": [5.0, 6.0], "pause_median_s": 5.5, "adapter_s": [1.0, 3.0],
             "adapter_pause_s": [0.2, 0.4], "adapter_median_s": 2.0, "adapter_pause_median_s": 0.3,
             "adapter_parameters": 1_000_000}  # fmt: skip
    return {"models": {"qwen": model}, "verdicts": [verdict("10x", False)], "elapsed_s": 300.0}


def engine_idle_result() -> dict[str, Any]:
    run0 = {"idle": [0.9, 0.6, 0.5], "idle_median": 0.55, "step_s": [4.0], "calls": 20, "seconds": 90.0}
    run1 = {"idle": [0.9, 0.3, 0.2], "idle_median": 0.25, "step_s": [3.0], "calls": 22, "seconds": 80.0}
    adaptive = {"idle": [0.8, 0.1, 0.05], "idle_median": 0.075, "step_s": [3.0], "calls": 30, "seconds": 80.0,
                "staleness_tokens_median": [0.0, 1.0, 1.0], "concurrency_limit": [4.0, 5.0, 6.0]}  # fmt: skip
    return {
        "config": {"engine": "vllm", "steps": 3, "quick": True, "arms": {"0": ["--max-staleness", "0"]}},
        "runs": {"0": run0, "1": run1, "1-adaptive": adaptive},
        "idle_ratio_1_vs_0": 0.25 / 0.55,
        "verdicts": [],
        "elapsed_s": 170.0,
    }


RESULTS = {
    "engine_idle": engine_idle_result,
    "weight_sync": weight_sync_result,
    "engine": engine_result,
    "proxy": proxy_result,
    "rollouts": rollouts_result,
    "trainer": trainer_result,
    "soak": soak_result,
}


def test_rows_give_the_median_ratio_and_the_spread_over_repeats() -> None:
    assert Row("m", "9", "10", [0.9, 1.1, 1.0]).cells() == ("m", "9", "10", "1.00x", "0.90-1.10", "3")
    assert Row("m", "9", "10", [0.9]).cells()[3:] == ("0.90x", "-", "1")  # one repeat: no spread
    assert Row("m", "9").cells()[2:] == ("-", "-", "-", "-")  # no baseline


def test_each_section_has_ratio_rows_against_its_baseline_and_the_verdicts() -> None:
    engine = report.section("engine", engine_result())
    assert engine.rows[0].ratios == [0.9, 0.95] and engine.headline.startswith("server 0.93x [0.90-0.95]")
    proxy = report.section("proxy", proxy_result())
    assert proxy.rows[0].ratios == [0.7, 0.8]  # req/s against the pass-through, per repeat
    assert proxy.rows[1].ratios == [2.0, 1.5]  # p50 latency against the direct engine, per repeat
    assert "0.75x pass-through" in proxy.headline and [v["pass"] for v in proxy.verdicts] == [False, True]
    rollouts = report.section("rollouts", rollouts_result())
    assert rollouts.rows[0].ratios == pytest.approx([1.4, 1.6]) and rollouts.rows[1].ratios == [0.75]
    assert rollouts.verdicts == [verdict(">= 512 sessions", False)]  # its single verdict, as a list
    trainer = report.section("trainer", trainer_result())
    assert [row.ratios for row in trainer.rows[:3]] == [[1.5], [1.0], [1.01]]
    sync = report.section("weight_sync", weight_sync_result())
    assert sync.rows[0].ratios == [6.0, 5.0] and sync.rows[0].measure.startswith("qwen (494.0M params)")
    assert "file push 11.00 s vs restart 60.0 s; engine paused 5.50 s" in sync.headline
    assert [row.ratios for row in sync.rows[1:]] == [[], [60.0, 20.0], []]  # pauses have no baseline
    assert "adapter pushes (1.0M values) 1.00 (paused 0.20), 3.00 (paused 0.40) s" in sync.notes[0]
    assert "nccl: not measured" in sync.notes[-2] and "oneDNN" in sync.notes[-1]
    idle = report.section("engine_idle", engine_idle_result())
    assert [r for row in idle.rows for r in row.ratios] == pytest.approx([0.25 / 0.55, 0.075 / 0.55])
    assert "staleness (median) per step 0 1 1; concurrency limit per step 4 5 6" in idle.notes[2]
    assert idle.headline == "arms 0, 1, 1-adaptive: 0.55 -> 0.25 -> 0.07 idle of a step"
    soak = report.section("soak", soak_result(), seconds=12.0)
    measures = [row.measure for row in soak.rows]
    assert "server RSS, end vs start" in measures and "journal bytes, written vs expected" in measures
    assert soak.seconds == 12.0 and "+0.50 MB/100 rollouts" in soak.headline


def test_the_report_has_the_machine_a_summary_and_every_section() -> None:
    machine = {key: f"{key} value" for key in MACHINE_KEYS}
    sections = [report.section(name, build()) for name, build in RESULTS.items()]
    sections.append(report.section("engine", None, "exit code 1; the end of its output:\nTraceback"))

    text = report.render_report(machine, sections, "python -m benchmarks")

    assert text.startswith("# Benchmarks") and "## Machine" in text and "## Summary" in text
    for key in MACHINE_KEYS:
        assert f"| {key} | {key} value |" in text
    for name in RESULTS:
        assert f"## {name}: {report.TITLES[name]}" in text
    assert text.count("| " + " | ".join(report.COLUMNS) + " |") == len(RESULTS)
    assert "| PASS | memory flat |" in text and "| MISS | throughput |" in text
    assert "<details><summary>per wave</summary>" in text
    assert "**FAILED**: exit code 1" in text and "Traceback" in text
    assert "FAILED: exit code 1" in report.summary_table(sections)  # the summary says so too


def test_targets_summary_names_the_misses() -> None:
    assert report.targets_summary([]) == "-"
    assert report.targets_summary([verdict("a", True), verdict("b", False)]) == "PASS 1/2 (MISS: b)"


def test_the_readme_block_is_replaced_between_the_markers_only() -> None:
    text = f"intro\n{report.START}\nold table\n{report.END}\nrest\n"
    block = report.readme_block({"CPU": "cpu"}, [report.section("engine", engine_result())], "cmd")

    replaced = report.replace_block(text, block)

    assert replaced.startswith(f"intro\n{report.START}\nMeasured by `cmd` on cpu")
    assert replaced.endswith(f"{report.END}\nrest\n") and "old table" not in replaced
    assert "| engine | plain `model.generate` |" in replaced
    assert report.replace_block(replaced, block) == replaced  # idempotent
    with pytest.raises(ValueError, match="no"):
        report.replace_block("no markers here", block)


def test_the_readme_has_the_markers() -> None:
    text = (ROOT / "README.md").read_text()
    assert text.count(report.START) == 1 and text.index(report.START) < text.index(report.END)


@pytest.mark.slow
def test_quick_run_writes_the_report_and_updates_a_readme_copy(tmp_path: Path) -> None:
    out, json_dir, readme = tmp_path / "BENCHMARKS.md", tmp_path / "json", tmp_path / "README.md"
    shutil.copy(ROOT / "README.md", readme)
    command = [
        sys.executable,
        "-m",
        "benchmarks",
        "--quick",
        "--output",
        str(out),
        "--json-dir",
        str(json_dir),
    ]
    # Two cheap benchmarks show the whole path: subprocesses, JSON, report, README block. Every other
    # benchmark's quick test renders its own real result as its section (benchmark_scripts.run_quick), and
    # the vLLM ones start real vLLMs (minutes each): their arithmetic and sections are tested apart.
    names = ["proxy", "soak"]
    command += ["--update-readme", "--readme", str(readme), "--only", ",".join(names)]
    run = run_to_end(command, 420, "python -m benchmarks --quick", stop_s=150)

    assert run.returncode == 0, run.stdout[-4000:]
    text = out.read_text()
    for key in MACHINE_KEYS:
        assert f"| {key} | " in text, key
    for name in names:
        assert f"## {name}: " in text, name
        assert json.loads((json_dir / f"{name}.json").read_text())["elapsed_s"] > 0
    assert text.count("| " + " | ".join(report.COLUMNS) + " |") == len(names)
    assert "FAILED" not in text and ("| PASS |" in text or "| MISS |" in text)
    updated = readme.read_text()
    assert updated != (ROOT / "README.md").read_text()  # the copy was updated, the README itself not
    block = updated[updated.index(report.START) : updated.index(report.END)]
    assert "Measured by `python -m benchmarks --quick --update-readme`" in block
    assert all(f"| {name} | " in block for name in names)
    assert "machine load: other processes used" in text


def summary_lines(text: str) -> list[str]:
    """The lines of the summary table that follows ``## Summary`` (BENCHMARKS.md) or the README block."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| benchmark | baseline |"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return lines[start:end]


def test_the_readme_table_is_the_summary_of_benchmarks_md_from_the_same_run() -> None:
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index(report.START) : readme.index(report.END)]
    benchmarks = (ROOT / "BENCHMARKS.md").read_text()
    summary = benchmarks[benchmarks.index("## Summary") :]

    assert summary_lines(block) == summary_lines(summary)
    machine = dict(
        (cells[1].strip(), cells[2].strip())
        for line in benchmarks[: benchmarks.index("## Summary")].splitlines()
        if len(cells := line.split("|")) == 4
    )
    for key in ("CPU", "date"):
        assert machine[key] in block, key
    assert f"commit {machine['git commit']}" in block


def test_a_benchmark_runs_again_once_when_other_processes_loaded_the_machine(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    main = importlib.import_module("benchmarks.__main__")
    loads = iter([0.9, 0.1])
    runs: list[str] = []

    class Meter:
        def other_cores(self) -> float:
            return next(loads)

    def run_one(name: str, quick: bool, json_dir: Path) -> tuple[dict, str, float]:
        runs.append(name)
        return {"run": len(runs)}, "", 1.0

    monkeypatch.setattr(main, "LoadMeter", Meter)
    monkeypatch.setattr(main, "run_one", run_one)
    result, error, _, note = main.run_measured("engine", True, tmp_path)
    assert runs == ["engine", "engine"] and result == {"run": 2} and not error
    assert "0.90 cores on average during its first run" in note and "at 0.10" in note
    loads = iter([0.2])
    assert main.run_measured("engine", True, tmp_path)[3].endswith("0.20 cores on average while it ran")
    assert len(runs) == 3  # a quiet machine: one run


def test_the_load_meter_counts_other_processes_cpu_not_its_childrens() -> None:
    main = importlib.import_module("benchmarks.__main__")
    busy, started = main.busy_seconds(), time.perf_counter()
    meter = main.LoadMeter()
    burn = "import time\nend = time.process_time() + 1.0\nwhile time.process_time() < end: pass"
    subprocess.run([sys.executable, "-c", burn], check=True)
    others = meter.other_cores() * (time.perf_counter() - started)
    # What the machine was busy with, less what is left for others, is the child's second of CPU (and
    # whatever this process did itself); other work running beside the test cancels out.
    assert main.busy_seconds() - busy - others >= 0.9


def run_main_recording(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *argv: str) -> tuple[list[str], str]:
    """``python -m benchmarks ARGV`` with each benchmark's run replaced by a recorded failure (what is
    under test is which run and how the report names the rest): the names run and the report."""
    main = importlib.import_module("benchmarks.__main__")
    ran: list[str] = []

    def run_measured(name: str, quick: bool, json_dir: Path) -> tuple[None, str, float, str]:
        ran.append(name)
        return None, "not run by this test", 0.0, "machine load: none"

    monkeypatch.setattr(main, "run_measured", run_measured)
    out = tmp_path / "BENCHMARKS.md"
    assert main.main([*argv, "--output", str(out)]) == 1  # every run "failed" here
    return ran, out.read_text()


def test_the_default_run_leaves_the_long_ones_out_and_its_report_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ran, text = run_main_recording(monkeypatch, tmp_path)
    assert "learning" in report.LONG
    assert ran == [name for name in report.BENCHMARKS if name not in report.LONG]
    for name in (*report.LONG, *report.ELSEWHERE):
        assert f"## {name}: " in text and f"| {name} | " in text, name
    learning = text[text.index("## learning: ") :]
    assert learning.splitlines()[2].startswith("Baseline: ") and "not in this run (too long" in learning
    assert "--long" in learning and learning_search.START in learning and learning_search.END in learning
    assert "not in this run (not runnable here)" in text[text.index("## gpu_trainer: ") :]


def test_long_runs_them_too_and_a_chosen_few_is_only_those(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ran, text = run_main_recording(monkeypatch, tmp_path, "--long")
    assert ran == list(report.BENCHMARKS) and "## gpu_trainer: " in text
    assert "not in this run (too long" not in text and "Generated by `python -m benchmarks --long`" in text
    ran, text = run_main_recording(monkeypatch, tmp_path, "--only", "learning,engine")
    assert ran == ["engine", "learning"] and "not in this run" not in text and "## gpu_trainer" not in text
