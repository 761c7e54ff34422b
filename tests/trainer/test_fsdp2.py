"""The trainer's own FSDP2 on CPU: when it shards, the LoRA merge from a gathered state, glibc's mmap
threshold, and two real gloo processes (``torchrun``) sharding for real, training, resuming and pushing like
one process (with gradient checkpointing, and with a sharded KL reference too), and stopping when a rank is
killed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from accelerate.utils import DistributedType
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from harness_trainer import HarnessAsyncGRPOTrainer
from harness_trainer.jobs.gpus import FSDP2_ENV
from harness_trainer.trainer import fsdp2
from harness_trainer.trainer.fsdp2 import (
    M_MMAP_THRESHOLD,
    MMAP_THRESHOLD,
    autocast_forward,
    map_large_allocations,
    merged_weights,
    shard_units,
    shards_itself,
    wants_fsdp2,
)
from harness_trainer.trainer.policy import engine_weights
from tests.trainer.distributed_run import FIRST_STEPS, TOTAL_STEPS, run_config, trained_alone
from tests.trainer.fsdp2_run import KILL_STEPS, KILLED_AT, KL, PROBE, handmade, held_bytes, reference_logprobs
from tests.trainer.handmade import HandmadeFactory

REPO = Path(__file__).resolve().parents[2]
gloo = pytest.mark.skipif(
    not torch.distributed.is_gloo_available(), reason="needs torch.distributed with gloo"
)


class Accelerator:
    def __init__(self, distributed_type: DistributedType, num_processes: int) -> None:
        self.distributed_type = distributed_type
        self.num_processes = num_processes


def test_the_trainer_shards_itself_only_for_fsdp2_asked_on_several_cpu_processes(monkeypatch):
    for name in FSDP2_ENV:
        monkeypatch.delenv(name, raising=False)
    multi_cpu = Accelerator(DistributedType.MULTI_CPU, 2)
    assert not wants_fsdp2() and not shards_itself(multi_cpu)
    for name, value in FSDP2_ENV.items():
        monkeypatch.setenv(name, value)
    assert wants_fsdp2() and shards_itself(multi_cpu)
    assert not shards_itself(Accelerator(DistributedType.MULTI_CPU, 1))
    assert not shards_itself(Accelerator(DistributedType.FSDP, 2))  # accelerate shards on its own
    monkeypatch.setenv("FSDP_VERSION", "1")
    assert not shards_itself(multi_cpu)


def test_the_merge_from_a_gathered_state_equals_the_engine_weights_of_the_module(tiny_model_dir):
    peft = pytest.importorskip("peft")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert shard_units(model) == list(model.model.layers)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    lora = peft.get_peft_model(model, config)
    assert shard_units(lora) == list(model.model.layers)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_()  # B starts at zero: give the deltas something to add
    state = {name: tensor.detach().clone() for name, tensor in lora.state_dict().items()}
    merged, expected = merged_weights(lora, state), engine_weights(lora)
    assert merged.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(merged[name], tensor, msg=name)
    assert not torch.equal(
        merged["model.layers.0.self_attn.q_proj.weight"],
        model.model.layers[0].self_attn.q_proj.base_layer.weight,
    )


class Recording(torch.nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
        return super().forward(x)


class MixedAccelerator:
    def __init__(self, native_amp: bool) -> None:
        self.native_amp = native_amp

    def autocast(self):
        return torch.autocast("cpu", dtype=torch.bfloat16)


def test_the_self_sharded_forward_runs_under_the_accelerators_mixed_precision_with_float32_outputs():
    model = Recording(4, 4)
    autocast_forward(MixedAccelerator(native_amp=True), model)
    out = model(torch.ones(1, 4))
    assert model.seen == (True, torch.bfloat16) and out.dtype == torch.float32
    plain = Recording(4, 4)
    forward = plain.forward
    autocast_forward(MixedAccelerator(native_amp=False), plain)
    assert plain.forward == forward  # no mixed precision: left alone
    plain(torch.ones(1, 4))
    assert plain.seen[0] is False


class Libc:
    def __init__(self, answer: int = 1) -> None:
        self.answer = answer
        self.calls: list[tuple[int, int]] = []

    def mallopt(self, parameter: int, value: int) -> int:
        self.calls.append((parameter, value))
        return self.answer


def test_large_allocations_are_mapped_once_and_logged_once(monkeypatch, caplog):
    libc = Libc()
    monkeypatch.setattr(fsdp2, "_glibc", lambda: libc)
    monkeypatch.setattr(fsdp2, "_mapped", None)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    with caplog.at_level("INFO", logger=fsdp2.__name__):
        assert map_large_allocations() and map_large_allocations()
    assert libc.calls == [(M_MMAP_THRESHOLD, MMAP_THRESHOLD)] == [(-3, 65536)]
    assert len([r for r in caplog.records if "mapped on their own" in r.getMessage()]) == 1


def test_a_threshold_the_user_set_is_left_alone_and_other_allocators_are_not_touched(monkeypatch):
    libc = Libc()
    monkeypatch.setattr(fsdp2, "_glibc", lambda: libc)
    monkeypatch.setattr(fsdp2, "_mapped", None)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert not map_large_allocations() and not map_large_allocations()
    assert libc.calls == []
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setattr(fsdp2, "_mapped", None)
    monkeypatch.setattr(fsdp2, "_glibc", lambda: None)  # not Linux, or not glibc
    assert not map_large_allocations()
    monkeypatch.setattr(fsdp2, "_mapped", None)
    monkeypatch.setattr(fsdp2, "_glibc", lambda: Libc(answer=0))  # glibc refused
    assert not map_large_allocations()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux's")
def test_glibc_is_found_where_it_runs():
    glibc = os.confstr("CS_GNU_LIBC_VERSION") if "CS_GNU_LIBC_VERSION" in os.confstr_names else None
    assert (fsdp2._glibc() is not None) == bool(glibc and glibc.startswith("glibc"))


# -- two real processes ---------------------------------------------------------------------------------


def torchrun(*args: str, timeout: float, monitor_s: float = 0.1) -> tuple[int, str]:
    """``torchrun`` of :mod:`tests.trainer.fsdp2_run` on two gloo ranks with the FSDP2 environment: its exit
    code and output. ``monitor_s``: how often torchrun checks its ranks (when one fails it terminates the
    others). Every process it started is killed on the way out, whatever happened."""
    env = {**os.environ, **FSDP2_ENV, "ACCELERATE_USE_CPU": "true", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "--monitor-interval", str(monitor_s), "-m", "tests.trainer.fsdp2_run", *args]  # fmt: skip
    process = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = process.communicate(timeout=timeout)
        return process.returncode, output
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # the ranks, torchrun's children, included
        except ProcessLookupError:
            pass
        process.wait()


def metrics_lines(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def assert_weights_close(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str
) -> None:
    assert actual.keys() == expected.keys(), what
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor.detach(), rtol=0, atol=1e-5, msg=f"{what}: {name}")


@pytest.mark.slow
@gloo
def test_two_fsdp2_gloo_processes_shard_train_resume_and_push_like_one_process(tmp_path, tiny_model_dir):
    out = tmp_path / "two"
    started = time.monotonic()
    code, output = torchrun("train", str(tiny_model_dir), str(out), timeout=240)
    assert code == 0, output[-8000:]
    print(f"two FSDP2 processes: {time.monotonic() - started:.1f} s")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for summary in ranks:  # really sharded: each rank holds half of a layer's rows
        assert summary["sharded"] and summary["local_rows"] * 2 == summary["full_rows"]
        assert summary["steps"] == [FIRST_STEPS, TOTAL_STEPS, FIRST_STEPS]
    assert ranks[0]["pushed"] == [1, 2, 2, 3, 1, 2] and ranks[1]["pushed"] == []

    alone = tmp_path / "one"
    single = trained_alone(tiny_model_dir, alone)
    # Trained 2 steps, resumed from the sharded checkpoint, trained 1: as one uninterrupted process.
    assert_weights_close(load_file(out / "full-final.safetensors"), single.model.state_dict(), "gathered")
    assert_weights_close(load_file(out / "full-pushed.safetensors"), engine_weights(single.model), "pushed")
    for part in ("model/model.safetensors",):
        written = load_file(out / "full" / f"checkpoint-{FIRST_STEPS}" / part)
        assert_weights_close(written, load_file(alone / f"checkpoint-{FIRST_STEPS}" / part), "checkpoint")
    optimizer = torch.load(out / "full" / f"checkpoint-{FIRST_STEPS}" / "optimizer.pt", weights_only=True)
    expected = torch.load(alone / f"checkpoint-{FIRST_STEPS}" / "optimizer.pt", weights_only=True)
    assert optimizer["param_groups"] == expected["param_groups"]
    for index, values in expected["state"].items():
        for field, value in values.items():
            torch.testing.assert_close(optimizer["state"][index][field], value, rtol=1e-4, atol=1e-7)

    lines, reference = metrics_lines(out / "full"), metrics_lines(alone)
    assert [line["step"] for line in lines] == list(range(1, TOTAL_STEPS + 1))
    for line, ref in zip(lines, reference, strict=True):
        for key in ("loss", "entropy", "num_tokens", "reward", "grad_norm"):
            assert line[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-7), key

    # Parameters, gradients and optimizer state held per rank: about half the unsharded ones.
    unsharded = held_bytes(single.model, single.optimizer)
    for summary in ranks:
        assert sum(summary["held"].values()) < 0.6 * sum(unsharded.values()), (summary["held"], unsharded)

    lora_alone = tmp_path / "lora-one"
    lora = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir), lambda sampling: HandmadeFactory(sampling=sampling),
        run_config(lora_alone, max_steps=FIRST_STEPS, use_peft=True, learning_rate=1e-3),
    )  # fmt: skip
    lora.train()
    merged = engine_weights(lora.model)
    assert_weights_close(load_file(out / "lora-pushed.safetensors"), merged, "LoRA pushed")
    adapter = f"checkpoint-{FIRST_STEPS}/model/adapter_model.safetensors"
    assert_weights_close(load_file(out / "lora" / adapter), load_file(lora_alone / adapter), "adapter")
    lora_lines, lora_reference = metrics_lines(out / "lora"), metrics_lines(lora_alone)
    for line, ref in zip(lora_lines, lora_reference, strict=True):
        assert line["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4, abs=1e-7)


@pytest.fixture(scope="module")
def variants(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``variants`` runs of :mod:`tests.trainer.fsdp2_run` on two ranks (gradient checkpointing, then a
    KL reference), run once for the tests that compare them with one process; their output folder."""
    out = tmp_path_factory.mktemp("variants")
    started = time.monotonic()
    code, output = torchrun("variants", str(tiny_model_dir), str(out), timeout=240)
    assert code == 0, output[-8000:]
    print(f"two FSDP2 processes, two variants: {time.monotonic() - started:.1f} s")
    return out


def trained_once(model_dir: Path, output_dir: Path, **overrides: object) -> HarnessAsyncGRPOTrainer:
    trainer = HarnessAsyncGRPOTrainer(str(model_dir), handmade, run_config(output_dir, **overrides))
    trainer.train()
    return trainer


def assert_metrics_close(actual: list[dict], expected: list[dict], keys: tuple[str, ...]) -> None:
    assert [line["step"] for line in actual] == [line["step"] for line in expected] == [1, 2, TOTAL_STEPS]
    for line, ref in zip(actual, expected, strict=True):
        for key in keys:
            assert line[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-7), (line["step"], key)


@pytest.mark.slow
@gloo
def test_two_fsdp2_processes_with_gradient_checkpointing_train_like_one_process(
    variants, tmp_path, tiny_model_dir
):
    ranks = [json.loads((variants / f"variants-rank{r}.json").read_text()) for r in range(2)]
    assert all(summary["checkpointing"] and summary["steps"][0] == TOTAL_STEPS for summary in ranks)
    single = trained_once(tiny_model_dir, tmp_path, gradient_checkpointing=True)
    assert single.model is not None and single.model.is_gradient_checkpointing
    final = load_file(variants / "checkpointing-final.safetensors")
    assert_weights_close(final, single.model.state_dict(), "gathered")
    keys = ("loss", "entropy", "num_tokens", "grad_norm")
    assert_metrics_close(metrics_lines(variants / "checkpointing"), metrics_lines(tmp_path), keys)


@pytest.mark.slow
@gloo
def test_two_fsdp2_processes_shard_the_kl_reference_and_train_and_resume_like_one_process(
    variants, tmp_path, tiny_model_dir
):
    ranks = [json.loads((variants / f"variants-rank{r}.json").read_text()) for r in range(2)]
    for summary in ranks:
        assert summary["steps"][1:] == [FIRST_STEPS, TOTAL_STEPS]  # trained, then resumed to the end
        assert summary["mapped"]  # glibc here: large blocks mapped
        reference = summary["reference"]
        # Sharded, frozen, and resharded after every forward (the root's weights included).
        assert reference["sharded_after_training"] and reference["sharded_after_forward"]
        assert not reference["requires_grad"]
        assert reference["local_rows"] * 2 == reference["full_rows"]
    single = trained_once(tiny_model_dir, tmp_path, **KL)
    assert single.model is not None
    lines, expected = metrics_lines(variants / "kl"), metrics_lines(tmp_path)
    assert expected[-1]["kl"] > 1e-5  # the policy moved from its reference: the KL term is measured
    assert_metrics_close(lines, expected, ("loss", "kl", "entropy", "num_tokens", "grad_norm"))
    assert_weights_close(load_file(variants / "kl-final.safetensors"), single.model.state_dict(), "gathered")
    logprobs = load_file(variants / "kl-reference-logprobs.safetensors")["logprobs"]
    assert logprobs.shape[:2] == torch.Size([1, len(PROBE[0])])
    torch.testing.assert_close(logprobs, reference_logprobs(single), rtol=0, atol=1e-5)


@pytest.mark.slow
@gloo
def test_a_killed_fsdp2_rank_stops_the_run_with_an_error_and_a_rerun_resumes_from_its_checkpoint(
    tmp_path, tiny_model_dir
):
    started = time.monotonic()
    # Torchrun checks its ranks every 2 s: usually time for the survivor to raise its own error before it
    # is terminated; on a loaded machine torchrun's check can come first and stop it (SIGTERM). Either
    # way the survivor stops: it never waits on a dead peer.
    code, output = torchrun("kill", str(tiny_model_dir), str(tmp_path), timeout=120, monitor_s=2.0)
    assert code != 0
    assert "Signal 9 (SIGKILL) received" in output  # torchrun names the killed rank
    raised = re.search(r"\[rank0\]: RuntimeError: .*(closed|reset) by peer", output)
    stopped = re.search(r"rank\s*: 0 \(local_rank: 0\)\s+exitcode\s*: -15", output)
    assert raised or stopped, output[-8000:]
    checkpoints = sorted(p.name for p in (tmp_path / "kill").glob("checkpoint-*"))
    assert checkpoints == [f"checkpoint-{step}" for step in range(1, KILLED_AT)]
    code, output = torchrun("resume", str(tiny_model_dir), str(tmp_path), timeout=120)
    assert code == 0, output[-8000:]
    assert json.loads((tmp_path / "resumed.json").read_text()) == {"from": KILLED_AT - 1, "steps": KILL_STEPS}
    print(f"killed and resumed: {time.monotonic() - started:.1f} s")


@pytest.mark.slow
@gloo
def test_two_fsdp2_processes_forward_a_groups_shared_prefix_as_the_packed_forward(tmp_path, tiny_model_dir):
    code, output = torchrun("prefix", str(tiny_model_dir), str(tmp_path), timeout=300)

    assert code == 0, output[-4000:]
    result = json.loads((tmp_path / "prefix.json").read_text())
    assert result["logps"] <= 1e-5 and result["same_parameters"] and result["grads"]
    assert max(result["grads"].values()) <= 1e-4, result["grads"]
    assert 0 < result["forwarded"]
