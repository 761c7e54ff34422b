"""The E2B starts benchmark: its fake cloud's latency hooks, its arithmetic, and its quick configuration end
to end (a real agent install from the npm registry in a fake sandbox against its bundle in the template, 64
starts through the supervisor), rendered as its section."""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import pytest

pytest.importorskip("e2b")

from e2b import AsyncSandbox, RateLimitException

from harness_trainer.sandboxes.e2b import E2BSandboxBackend
from tests.benchmark_scripts import BENCHMARKS, load_benchmark, run_quick
from tests.sandboxes.fake_e2b import FakeE2BCloud, FakeLatency

pytestmark = pytest.mark.docker  # the fake E2B cloud runs images exported from the Docker daemon

e2b_starts = load_benchmark("e2b_starts")

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="fake E2B sandboxes are namespaces: needs root")


def test_build_times_spread_evenly_from_the_fastest_to_the_slowest_scaled() -> None:
    low, high = e2b_starts.REAL["build_s"]
    times = e2b_starts.build_seconds(4, 0.5)
    assert times == pytest.approx(
        [low / 2, (low + (high - low) / 3) / 2, (low + 2 * (high - low) / 3) / 2, high / 2]
    )
    assert e2b_starts.build_seconds(1, 1.0) == [low]


def test_every_backoff_of_the_backend_is_scaled_from_its_default() -> None:
    scaled = e2b_starts.scaled_backoffs(E2BSandboxBackend, 0.1)
    assert scaled["retry_backoff_s"] == pytest.approx(0.2)  # the backend's default 2 s
    assert all(name.endswith("backoff_s") for name in scaled)


@needs_root
async def test_a_create_over_the_fake_accounts_rate_is_a_429_then_the_sdks_rate_limit_exception(
    tmp_path: Path,
) -> None:
    latency = FakeLatency(create_s=(0.05, 0.05), create_rate_per_s=0.01, sdk_retries=2, retry_scale=0.01)
    cloud = FakeE2BCloud(tmp_path / "e2b", latency=latency)

    first = await cloud.create(template="base", timeout=60)
    try:
        with pytest.raises(RateLimitException, match="429"):
            await cloud.create(template="base", timeout=60)
    finally:
        await first.kill()
    assert (cloud.rate_limited, cloud.rate_limit_errors) == (3, 1)  # the first answer and both SDK retries
    for call in cloud.create_calls:  # the hooks change no signature
        inspect.signature(AsyncSandbox.create).bind(**call)


@pytest.mark.slow
@needs_root
def test_quick_e2b_starts_benchmark_installs_the_agent_builds_once_per_environment_and_closes_all(
    tmp_path: Path,
) -> None:
    out = tmp_path / "result.json"

    run = run_quick(BENCHMARKS / "e2b_starts.py", out, 300, "the quick benchmark", stop_s=60)

    assert run.returncode == 0, run.stdout[-4000:]
    result = json.loads(out.read_text())
    config, agent = result["config"], result["agent"]
    assert (config["rollouts"], config["environments"], config["scale"]) == (64, 4, 0.05)
    for arm in ("install", "bundle"):
        assert agent[arm]["installed_mb"] > 10, arm  # the real agent is in the sandbox, either way
        assert len(agent[arm]["overhead_s"]) == config["agent_repeats"] == len(agent["ratios"])
    # the bundle is a layer of a template of its own (build times are reported, not compared: load moves them)
    assert agent["install"]["template"] != agent["bundle"]["template"]
    (burst,) = result["burst"]
    assert burst["builds"] == 4 and burst["started"] + burst["failed"] == 64
    assert burst["max_build_s"] >= max(e2b_starts.build_seconds(4, 0.05))  # the injected build time counts
    assert burst["t_last_s"] > 0 and burst["bound_s"] == pytest.approx(burst["max_build_s"] + 64 / 100)
    assert [v["target"] for v in result["verdicts"]] == list(e2b_starts.TARGETS)
    assert result["leftover_sandboxes"] == 0 and result["elapsed_s"] > 0
    assert any(line.split()[:1] in (["PASS"], ["MISS"]) for line in run.stdout.splitlines())
