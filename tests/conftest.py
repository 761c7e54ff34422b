"""Shared fixtures: the tiny model, and dev engines running as real processes on loopback."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness_trainer.dev_engine.process import EngineProcess, start_engine
from harness_trainer.engines.vllm_process import serve_env, serve_flags
from harness_trainer.models.tiny import ensure_tiny_model
from tests.vllm_cpu_server import serve_vllm_cpu, vllm_cpu_missing

os.environ["HF_HUB_OFFLINE"] = "1"
# No test may use a login stored on this machine (`hf auth login`): it would stand in for HF_TOKEN in the
# credential checks. Tests that need a stored login write their own token file and point here at it.
os.environ["HF_TOKEN_PATH"] = str(Path(__file__).resolve().parent / ".no-stored-hf-token")
try:
    from huggingface_hub import constants as _hub_constants

    _hub_constants.HF_TOKEN_PATH = os.environ["HF_TOKEN_PATH"]  # read at import; set in case it came first
except ImportError:
    pass
collect_ignore = ["harbor_shaped"]  # task folders: their verifiers' test_*.py run inside sandboxes, not here


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


VLLM_CPU_FILES = "vllm_cpu"
"""Every ``vllm_cpu`` test lives in a file whose name holds this (checked at collection): under ``pytest -n
N`` (the README's test command) they all run in one worker, one after the other, sharing one vLLM server
(the session fixture below, started once per worker); two vLLMs at once would starve a small machine."""


SLOW_BY_NATURE = ("vllm_cpu", "docker")
"""Marks whose tests start a real vLLM or containers: slow as well, so ``-m "not slow"`` (the fast tier)
leaves them out without each file saying so twice."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if any(item.get_closest_marker(name) is not None for name in SLOW_BY_NATURE):
            item.add_marker(pytest.mark.slow)
    misplaced = [
        item.nodeid
        for item in items
        if item.get_closest_marker("vllm_cpu") is not None and VLLM_CPU_FILES not in item.path.name
    ]
    if misplaced:
        raise pytest.UsageError(f"vllm_cpu tests outside a *{VLLM_CPU_FILES}* file: {misplaced}")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's load scheduling, except that the ``*vllm_cpu*`` files are one unit of work (one
    worker). By file name, because the scheduler sees node ids only, and pytest-xdist's own ``xdist_group``
    mark does not reach them under pytest 9.2 (it renames ``item._nodeid``, which pytest no longer reads)."""
    if config.getvalue("dist") != "load":  # another --dist asked for: pytest-xdist's own
        return None
    from xdist.scheduler import LoadScopeScheduling

    class VllmInOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return VLLM_CPU_FILES if VLLM_CPU_FILES in nodeid.partition("::")[0] else nodeid

    return VllmInOneWorker(config, log)


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
