"""The Docker preparation benchmark: its arithmetic, and its quick configuration end to end against the real
daemon (three cold builds at once against the slowest alone), rendered as its section."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmark_scripts import BENCHMARKS, load_benchmark, run_quick

docker_prepare = load_benchmark("docker_prepare")

pytestmark = pytest.mark.docker


def test_build_times_spread_evenly_from_the_fastest_to_the_slowest() -> None:
    assert docker_prepare.build_seconds(3, 2.0, 4.0) == [2.0, 3.0, 4.0]
    assert docker_prepare.build_seconds(1, 2.0, 4.0) == [2.0]


@pytest.mark.slow
def test_quick_docker_prepare_builds_every_environment_cold_and_removes_the_images(tmp_path: Path) -> None:
    out = tmp_path / "result.json"

    run = run_quick(BENCHMARKS / "docker_prepare.py", out, 300, "the quick benchmark")

    assert run.returncode == 0, run.stdout[-4000:]
    result = json.loads(out.read_text())
    (repeat,) = result["runs"]
    assert result["config"]["environments"] == 3 and result["config"]["at_once"] == 4
    assert repeat["alone_s"] >= 4.0 and repeat["all_s"] >= 4.0  # the slowest RUN step waits 4 s: it ran
    assert repeat["ratio"] == pytest.approx(repeat["all_s"] / repeat["alone_s"])
    assert [v["target"] for v in result["verdicts"]] == list(docker_prepare.TARGETS)
    assert result["leftover_images"] == 0  # the benchmark removed what it built
