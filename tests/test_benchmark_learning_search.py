"""The learning benchmark's search log: every run appended as it ends, other tries and decisions logged by
hand, the whole of it rendered into BENCHMARKS.md (and the committed page holds the committed log's
rendering)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import learning_search
from tests.benchmark_scripts import load_benchmark

benchmark_learning = load_benchmark("learning")


def a_run(seed: int, kind: str, start: float, end: float) -> dict:
    return {
        "mode": "white-box",
        "engine": "dev",
        "seed": seed,
        "kind": kind,
        "start": start,
        "end": end,
        "first": 0.5,
        "last": 0.75,
        "seconds": 90.0,
    }


def configured(tmp_path: Path, *argv: str) -> dict:
    parser = benchmark_learning.build_parser()
    return benchmark_learning.resolve(parser.parse_args(list(argv)), parser)


def test_each_run_of_the_benchmark_is_appended_with_its_configuration_commit_and_result(
    tmp_path: Path,
) -> None:
    log = tmp_path / "search.jsonl"
    config = configured(tmp_path, "--seeds", "0,1", "--search-log", str(log), "--search-note", "why not")
    benchmark_learning.log_run(config, a_run(0, "trained", 0.1, 0.3))
    benchmark_learning.log_run(config, a_run(0, "frozen", 0.1, 0.1))
    entries = learning_search.read(log)
    assert [(e["kind"], e["arm"], e["seed"]) for e in entries] == [
        ("run", "trained", 0),
        ("run", "frozen", 0),
    ]
    first = entries[0]
    assert first["held_out_pass_at_1"] == {"start": 0.1, "end": 0.3} and first["minutes"] == 1.5
    assert first["configuration"]["tasks"] == "toy-skills" and first["configuration"]["mode"] == "white-box"
    assert first["configuration"]["recipe"] == benchmark_learning.RECIPE and first["note"] == "why not"
    assert first["configuration_id"] == entries[1]["configuration_id"]  # the arm is not the configuration
    assert len(first["commit"]) >= 7 and isinstance(first["dirty"], bool)
    other = configured(tmp_path, "--seeds", "0,1", "--max-steps", "20", "--search-log", str(log))
    assert (
        learning_search.configuration_id(learning_search.configuration_of(other, "white-box", "dev"))
        != first["configuration_id"]
    )


def test_the_quick_configuration_logs_nowhere_unless_told_and_no_search_log_wins(tmp_path: Path) -> None:
    assert configured(tmp_path, "--quick")["search_log"] is None
    assert configured(tmp_path)["search_log"] == str(learning_search.SEARCH_LOG)
    assert configured(tmp_path, "--no-search-log")["search_log"] is None
    benchmark_learning.log_run(configured(tmp_path, "--quick"), a_run(0, "trained", 0, 0))  # nothing


def test_the_rendering_counts_configurations_and_shows_runs_decisions_notes_and_history(
    tmp_path: Path,
) -> None:
    log = tmp_path / "search.jsonl"
    config = configured(tmp_path, "--seeds", "0,1", "--search-log", str(log))
    for seed, (trained, frozen) in enumerate([(0.25, 0.125), (0.5, 0.25)]):
        benchmark_learning.log_run(config, a_run(seed, "trained", 0.0, trained))
        benchmark_learning.log_run(config, a_run(seed, "frozen", 0.0, frozen))
    cid = learning_search.read(log)[0]["configuration_id"]
    assert learning_search.main(["--log", str(log), "decide", cid, "dropped", "the frozen arm drifted"]) == 0
    assert learning_search.main(["--log", str(log), "note", "a warm-up probe: held-out 0.03"]) == 0
    learning_search.append(
        [{"kind": "history", "when": "2026-12-01", "commit": "abc1234", "text": "old"}], log
    )
    text = learning_search.render(learning_search.read(log))
    assert "1 configuration(s) run by the benchmark since its log began, 1 dropped; 4 run(s)" in text
    assert "1 other try; 1 earlier try from before the log" in text
    row = next(line for line in text.splitlines() if line.startswith(f"| {cid} "))
    assert "0.000 → 0.375 (2 runs)" in row and "0.000 → 0.188 (2 runs)" in row
    assert "| 0,1 |" in row and "dropped: the frozen arm drifted" in row
    assert "a warm-up probe: held-out 0.03" in text and "2026-12-01 (abc1234): old" in text


def test_bad_entries_and_decisions_are_refused_naming_them(tmp_path: Path) -> None:
    log = tmp_path / "search.jsonl"
    log.write_text('{"kind": "run"}\nnot json\n')
    with pytest.raises(ValueError, match=r"search\.jsonl:2: not JSON"):
        learning_search.read(log)
    log.write_text(json.dumps({"kind": "guess"}) + "\n")
    with pytest.raises(ValueError, match=r"search\.jsonl:1: not a search entry"):
        learning_search.read(log)
    log.write_text("")
    with pytest.raises(SystemExit):  # no run of that configuration: nothing to decide about
        learning_search.main(["--log", str(log), "decide", "deadbeef", "kept", "because"])
    with pytest.raises(ValueError, match="needs its text"):
        learning_search.note_entry("  ", commit="x", when="y")
    assert log.read_text() == ""


def test_the_committed_benchmarks_page_holds_the_committed_logs_rendering() -> None:
    """Whoever adds to the log re-renders the page (``render --into BENCHMARKS.md``): the two never part."""
    page = learning_search.BENCHMARKS_MD.read_text()
    assert learning_search.block(learning_search.read()) in page
    history = [e for e in learning_search.read() if e["kind"] == "history"]
    assert len(history) >= 8  # the searches before the log, as they happened
