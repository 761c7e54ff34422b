"""Training curves: a PNG from a real metrics.jsonl, clear errors on bad input, and the CLI functions."""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path

import pytest

from harness_trainer.plots import (
    CURVES_FILE,
    DPI,
    FIGURE_SIZE_IN,
    add_plot_arguments,
    harness_eval_curves,
    logged_points,
    plot_metrics,
    read_metrics,
    run_plot,
)
from harness_trainer.trainer.reporting import METRICS_FILE, MetricsReporter

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from the PNG's IHDR chunk, which follows the signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def write_run(run_dir: Path, steps: int = 6) -> Path:
    with MetricsReporter(run_dir, "none") as reporter:
        for step in range(1, steps + 1):
            metrics = {
                "reward": step / steps,
                "reward_std": 0.1,
                "completions/mean_length": 40.0 + step,
                "tools/call_frequency": 2.0,
                "loss": float("nan") if step == 3 else 0.5 / step,  # logged as null: a gap
            }
            reporter.log(metrics, step)
    return run_dir / METRICS_FILE


def parser() -> argparse.ArgumentParser:
    built = argparse.ArgumentParser(prog="harness-trainer plot")
    add_plot_arguments(built)
    return built


def test_curves_of_a_real_metrics_file_are_a_png_of_the_expected_size(tmp_path: Path) -> None:
    metrics = write_run(tmp_path)
    out = plot_metrics(metrics)
    assert out == tmp_path / CURVES_FILE
    assert png_size(out) == (int(FIGURE_SIZE_IN[0] * DPI), int(FIGURE_SIZE_IN[1] * DPI))
    assert out.stat().st_size > 10_000  # six panels with axes and curves, not an empty canvas


def test_metrics_the_run_did_not_log_leave_their_panel_empty(tmp_path: Path) -> None:
    with MetricsReporter(tmp_path, "none") as reporter:
        reporter.log({"reward": 0.5}, 1)
    out = plot_metrics(tmp_path / METRICS_FILE, tmp_path / "plots" / "only-reward.png")
    assert out == tmp_path / "plots" / "only-reward.png" and png_size(out)[0] == FIGURE_SIZE_IN[0] * DPI


def test_a_resumed_run_plots_its_latest_timeline(tmp_path: Path) -> None:
    write_run(tmp_path, steps=4)
    with MetricsReporter(tmp_path, "none") as reporter:  # resumed from step 2's checkpoint
        reporter.log({"reward": -1.0}, 3)
    assert [(line["step"], line["reward"]) for line in read_metrics(tmp_path)] == [
        (1, 0.25), (2, 0.5), (3, -1.0),
    ]  # fmt: skip


def test_an_empty_metrics_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / METRICS_FILE).write_text("\n")
    with pytest.raises(ValueError, match=rf"{METRICS_FILE}: no metrics lines to plot"):
        plot_metrics(tmp_path / METRICS_FILE)


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("{not json", r":2: not valid JSON"),
        ("[1, 2]", r":2: expected a JSON object, got list"),
        ('{"reward": 1.0}', r":2: a metrics line needs an integer 'step'"),
    ],
)
def test_a_malformed_line_is_named_by_file_and_line(tmp_path: Path, line: str, problem: str) -> None:
    path = tmp_path / METRICS_FILE
    path.write_text(json.dumps({"step": 1, "reward": 0.0}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=METRICS_FILE + problem):
        plot_metrics(path)


def test_the_plot_command_takes_a_run_folder_and_an_output(tmp_path: Path, capsys) -> None:
    write_run(tmp_path)
    assert run_plot(parser().parse_args([str(tmp_path), "-o", str(tmp_path / "c.png")])) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "c.png")
    assert png_size(tmp_path / "c.png")[1] == FIGURE_SIZE_IN[1] * DPI


def test_the_plot_command_reports_a_missing_or_bad_file_and_exits_2(tmp_path: Path, capsys) -> None:
    assert run_plot(parser().parse_args([str(tmp_path / "nowhere.jsonl")])) == 2
    assert "error:" in capsys.readouterr().err
    (tmp_path / METRICS_FILE).write_text("")
    assert run_plot(parser().parse_args([str(tmp_path)])) == 2
    assert "no metrics lines" in capsys.readouterr().err


def test_eval_metrics_are_drawn_at_the_steps_that_evaluated(tmp_path: Path) -> None:
    with MetricsReporter(tmp_path, "none") as reporter:
        reporter.log({"eval/pass@1": 0.25, "eval/pass@k": 0.5}, 0)
        for step in (1, 2, 3, 4):
            metrics = {"reward": 0.5}
            if step % 2 == 0:
                metrics.update({"eval/pass@1": 0.25 * step, "eval/pass@k": 1.0})
            reporter.log(metrics, step)
    lines = read_metrics(tmp_path)
    assert logged_points(lines, "eval/pass@1") == ([0, 2, 4], [0.25, 0.5, 1.0])
    assert logged_points(lines, "reward") == ([1, 2, 3, 4], [0.5] * 4)
    assert png_size(plot_metrics(tmp_path)) == (int(FIGURE_SIZE_IN[0] * DPI), int(FIGURE_SIZE_IN[1] * DPI))


def test_a_mix_draws_each_harnesses_eval_pass_at_1_at_the_steps_that_evaluated(tmp_path: Path) -> None:
    with MetricsReporter(tmp_path, "none") as reporter:
        for step in (0, 1, 2):
            metrics: dict[str, float] = {"reward": 0.5} if step else {}
            if step % 2 == 0:
                metrics |= {
                    "eval/pass@1": 0.5, "eval/pass@k": 1.0, "eval/harness/toy/pass@1": 0.25 * (step + 1),
                    "eval/harness/toy/pass@k": 1.0, "eval/harness/mini-swe-agent/pass@1": 0.75,
                }  # fmt: skip
            reporter.log(metrics, step)
    curves = harness_eval_curves(read_metrics(tmp_path))
    assert curves == {"mini-swe-agent": ([0, 2], [0.75, 0.75]), "toy": ([0, 2], [0.25, 0.75])}
    assert png_size(plot_metrics(tmp_path))[0] == FIGURE_SIZE_IN[0] * DPI
    write_run(tmp_path / "one")
    assert harness_eval_curves(read_metrics(tmp_path / "one")) == {}
