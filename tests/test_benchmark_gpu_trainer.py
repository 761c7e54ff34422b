"""The trainer-side GPU check runs end to end in its quick configuration on CPU and reports every variant and
gather, and its FLOPs count matches hand-computed numbers (whether the target passes is the benchmark's
business, not this test's)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.model_flops import Shape
from tests.benchmark_scripts import BENCHMARKS, load_benchmark, run_to_end

benchmark_gpu_trainer = load_benchmark("gpu_trainer")


def test_train_flops_and_mfu_match_hand_computed_numbers() -> None:
    toy = Shape(parameters=0, body=10, head=3, layers=2, attention_width=4)
    # Rows of 2 and 3 tokens, 4 projected: 6·10·(2+3) + 6·2·4·(2²+3²) + 6·3·4 = 300 + 624 + 72.
    assert benchmark_gpu_trainer.train_flops(toy, [2, 3], 4) == 996

    # Half the peak: 494.5 TFLOPs in one second against 989 TFLOP/s.
    assert benchmark_gpu_trainer.mfu(494.5e12, 1.0, 989.0) == pytest.approx(0.5)
    assert benchmark_gpu_trainer.mfu(494.5e12, 2.0, 989.0) == pytest.approx(0.25)


def test_a_trees_flops_count_each_node_once_on_its_context() -> None:
    toy = Shape(parameters=0, body=10, head=3, layers=2, attention_width=4)
    # One row of 5 as a single node equals train_flops; split 3 + 2 (context 3) it is the same work.
    assert benchmark_gpu_trainer.tree_train_flops(toy, [(0, 5)], 4) == benchmark_gpu_trainer.train_flops(
        toy, [5], 4
    )
    assert benchmark_gpu_trainer.tree_train_flops(toy, [(0, 3), (3, 2)], 4) == pytest.approx(
        benchmark_gpu_trainer.train_flops(toy, [5], 4)
    )
    # Two rows of 5 sharing 3 ids: the prompt once, each rest on its context.
    shared = benchmark_gpu_trainer.tree_train_flops(toy, [(0, 3), (3, 2), (3, 2)], 4)
    assert shared < benchmark_gpu_trainer.train_flops(toy, [5, 5], 4)


def test_grouped_rows_share_their_groups_prompt_untrained() -> None:
    raw = benchmark_gpu_trainer.agent_rows(6, 6, 0)
    rows = benchmark_gpu_trainer.grouped(raw, 3)
    for start in (0, 3):
        prompt = raw[start].input_ids[: len(raw[start].input_ids) // 3]
        for row, source in zip(rows[start : start + 3], raw[start : start + 3], strict=True):
            cut = len(source.input_ids) // 3
            assert row.input_ids == prompt + source.input_ids[cut:] and row.rollout == source.rollout
            assert row.targets == [0] * len(prompt) + source.targets[cut:]


def test_qwen3_1_7b_shape_counts_its_parameters() -> None:
    config = {"shape": benchmark_gpu_trainer.QWEN3_1_7B, "seed": 0, "dtype": "bfloat16"}

    shape = benchmark_gpu_trainer.shape_of(benchmark_gpu_trainer.build_model(config, "meta"))

    # Per layer: q and o 2048², k and v 2048·1024, MLP 3·2048·6144, two norms of 2048, q/k norms of 128;
    # then the final norm. The tied embedding (151,936 × 2048) is counted once, outside the body.
    body = 28 * (2 * 2048**2 + 2 * 2048 * 1024 + 3 * 2048 * 6144 + 2 * 2048 + 2 * 128) + 2048
    assert shape.body == body == 1_409_410_048
    assert shape.parameters == body + 151936 * 2048 == 1_720_574_976
    assert (shape.head, shape.layers, shape.attention_width) == (151936 * 2048, 28, 16 * 128)
    # One 1000-token row with 500 targets: weights + causal attention + head, worked out by hand.
    flops = benchmark_gpu_trainer.train_flops(shape, [1000], 500)
    assert flops == 8_456_460_288_000 + 344_064_000_000 + 933_494_784_000


@pytest.mark.slow
def test_a_variant_out_of_memory_or_not_runnable_leaves_the_others_and_the_report(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    def measure(setup: Any, *_: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        if setup.name == benchmark_gpu_trainer.BASELINE:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        if setup.fsdp:
            raise benchmark_gpu_trainer.NotRun("no torch.distributed")
        tps = {"median": 100.0, "min": 90.0, "max": 110.0}
        variant = {"status": "ok", "batches": 2, "tensor_tokens": 10, "tps": tps, "row_tps": 300.0}
        variant |= {"mfu": 0.4, "peak_memory_gb": None}
        gather = {"status": "ok", "seconds": {"median": 0.5}, "tensors": 3, "gb": 1.0, "lands_on": "cpu"}
        return variant, gather | {"engine_names": True}

    monkeypatch.setattr(benchmark_gpu_trainer, "measure", measure)
    config = {"seed": 0, "steps": 1, "device": "cpu", "dtype": "float32", "token_budget": 8, "peak_tflops": 1}
    rows = benchmark_gpu_trainer.agent_rows(2, 1, 0)

    variants, gathers, failed = benchmark_gpu_trainer.run_variants(config, rows, 1.0)

    assert not failed
    assert variants["padded"] == {"status": "out of memory"}
    assert variants["packed, FSDP2"] == {"status": "not run: no torch.distributed"}
    assert variants["packed"]["status"] == "ok" and "vs_padded" not in variants["packed"]
    assert gathers["engine_weights"]["status"] == "ok"
    assert gathers["FSDP2 full state dict"]["status"].startswith("not measured: packed, FSDP2 not run")
    verdict, prefix = benchmark_gpu_trainer.verdicts(variants)
    assert not verdict["pass"] and "padded out of memory" in verdict["measured"]
    assert prefix["pass"] and prefix["target"] == benchmark_gpu_trainer.PREFIX_TARGET  # MFU 40 % >= 18 %
    model = {"name": "test", "parameters": 1e6, "body": 1e6}
    workload = {"rows": 2, "tokens": 10, "trained_tokens": 5, "length_median": 5, "length_max": 6}
    result = {"config": config, "model": model, "workload": workload | {"tflops_per_step": 1e-9}}
    result |= {"variants": variants, "gathers": gathers, "verdicts": [verdict, prefix], "elapsed_s": 1.0}
    benchmark_gpu_trainer.print_report(result)
    printed = capsys.readouterr().out
    assert any(line.startswith("padded ") and "out of memory" in line for line in printed.splitlines())
    assert "MISS" in printed


@pytest.mark.slow
def test_quick_gpu_trainer_benchmark_on_cpu_reports_every_variant_and_gather(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    command = [sys.executable, str(BENCHMARKS / "gpu_trainer.py"), "--quick", "--device", "cpu"]
    command += ["--dtype", "float32", "--json", str(out)]

    run = run_to_end(command, 240, "the quick GPU trainer benchmark on CPU", stop_s=30)

    assert run.returncode == 0, run.stdout[-4000:]
    lines = run.stdout.splitlines()
    for name in (*benchmark_gpu_trainer.VARIANTS, *benchmark_gpu_trainer.GATHERS):
        assert any(line.startswith(f"{name} ") for line in lines), name
    assert any("MFU against a peak of 989 TFLOP/s" in line for line in lines)
    target = benchmark_gpu_trainer.TARGET_NAME
    assert any(line.split()[:1] in (["PASS"], ["MISS"]) and target in line for line in lines)

    result = json.loads(out.read_text())
    variants = result["variants"]
    assert list(variants) == list(benchmark_gpu_trainer.VARIANTS)
    for name, variant in variants.items():
        assert variant["status"] == "ok", (name, variant)
        assert variant["tps"]["median"] > 0 and variant["row_tps"] > 0
        assert math.isfinite(variant["mfu"]) and variant["mfu"] > 0
    # Every variant trains the same rows; packing forwards no padding, padding forwards more.
    assert len({variant["trained_tokens"] for variant in variants.values()}) == 1
    assert variants["packed"]["tensor_tokens"] == result["workload"]["tokens"]
    assert variants["padded"]["tensor_tokens"] > variants["packed"]["tensor_tokens"]
    assert variants["padded"]["vs_padded"] == pytest.approx(1.0)
    gathers = result["gathers"]
    assert list(gathers) == list(benchmark_gpu_trainer.GATHERS)
    for name, gather in gathers.items():
        assert gather["status"] == "ok", (name, gather)
        assert gather["seconds"]["median"] > 0 and gather["gb"] > 0 and gather["engine_names"], name
    assert gathers["engine_weights"]["tensors"] == gathers["FSDP2 full state dict"]["tensors"]
    assert [v["target"] for v in result["verdicts"]] == [target, benchmark_gpu_trainer.PREFIX_TARGET]
    # By prefix: each group's prompt forwarded once, and its model FLOPs its trees'.
    by_prefix = variants[benchmark_gpu_trainer.PREFIX]
    assert by_prefix["tensor_tokens"] == result["workload"]["prefix_forwarded"] < result["workload"]["tokens"]
    assert result["workload"]["prefix_tflops_per_step"] < result["workload"]["tflops_per_step"]
    assert isinstance(result["all_pass"], bool)
