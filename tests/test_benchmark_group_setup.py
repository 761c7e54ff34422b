"""The group-setup benchmark: its quick configuration end to end (real Docker, the fake E2B cloud), every
member set up either way, rendered as its report section."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.report import section
from tests.benchmark_scripts import BENCHMARKS, load_benchmark, run_quick

group_setup = load_benchmark("group_setup")

pytestmark = pytest.mark.docker


def test_backends_are_a_known_comma_separated_list() -> None:
    import argparse

    assert group_setup.backends("docker, e2b") == ["docker", "e2b"]
    with pytest.raises(argparse.ArgumentTypeError):
        group_setup.backends("docker,hf")


@pytest.mark.slow
def test_quick_group_setup_sets_each_group_up_once_and_renders(tmp_path: Path) -> None:
    out = tmp_path / "result.json"

    run = run_quick(BENCHMARKS / "group_setup.py", out, 400, "the quick benchmark")

    assert run.returncode == 0, run.stdout[-4000:]
    result = json.loads(out.read_text())
    assert set(result["runs"]) == {"docker", "e2b"} and result["config"]["members"] == 4
    for runs in result["runs"].values():
        (repeat,) = runs
        assert repeat["cold"]["installs"] == 4 and repeat["one_setup"]["installs"] == 1  # one setup
        assert repeat["cold"]["work_per_member_s"] >= 3.0  # each member slept its own 3 s setup
        assert repeat["ratio"] == pytest.approx(
            repeat["one_setup"]["work_per_member_s"] / repeat["cold"]["work_per_member_s"]
        )
    assert [v["target"] for v in result["verdicts"]] == list(group_setup.TARGETS.values())
    assert "of cold" in section("group_setup", result).headline  # run_quick checked the rest of it
