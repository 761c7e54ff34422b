"""Checkpoints on the tiny model: round trips, LoRA adapters, rotation, atomicity, and resume equivalence."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from harness_trainer.trainer.checkpoint import (
    TrainerState,
    latest_checkpoint,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)

peft = pytest.importorskip("peft")

TOTAL_STEPS = 10


def make_training(model_dir: Path, *, lora: bool = False):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if lora:
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        model = peft.get_peft_model(model, config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / TOTAL_STEPS)
    return model, optimizer, scheduler


def train(model: nn.Module, optimizer, scheduler, steps: int) -> None:
    """Real optimizer steps; the batches come from the global torch RNG, so resume must restore it."""
    model.train()
    for _ in range(steps):
        input_ids = torch.randint(0, 4000, (2, 12))
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_tensors(a: dict, b: dict, atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=0, msg=key)


def state(step: int) -> TrainerState:
    return TrainerState(step=step, groups_consumed=3 * step, policy_version=step, extra={"seed": 7})


def test_round_trip_restores_weights_optimizer_scheduler_and_rng(tiny_model_dir, tmp_path):
    model, optimizer, scheduler = make_training(tiny_model_dir)
    torch.manual_seed(0)
    train(model, optimizer, scheduler, 2)
    path = save_checkpoint(tmp_path, state(2), model, optimizer, scheduler)
    after_save = draws()

    fresh, fresh_optimizer, fresh_scheduler = make_training(tiny_model_dir)
    restored = load_checkpoint(path, fresh, fresh_optimizer, fresh_scheduler)

    assert draws() == after_save
    assert (restored.step, restored.groups_consumed, restored.policy_version) == (2, 6, 2)
    assert restored.extra == {"seed": 7}
    assert set(restored.rng) >= {"python", "numpy", "torch"}
    assert_same_tensors(params(fresh), params(model))
    saved_opt, loaded_opt = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert saved_opt["param_groups"] == loaded_opt["param_groups"]
    for index, slots in saved_opt["state"].items():
        assert_same_tensors(slots, loaded_opt["state"][index])
    assert fresh_scheduler.state_dict() == scheduler.state_dict()
    assert fresh_scheduler.get_last_lr() == scheduler.get_last_lr()


def test_layout_is_model_folder_optimizer_scheduler_rng_and_readable_state(tiny_model_dir, tmp_path):
    model, optimizer, scheduler = make_training(tiny_model_dir)
    path = save_checkpoint(tmp_path, state(5), model, optimizer, scheduler)

    assert path == tmp_path / "checkpoint-5"
    assert {p.name for p in path.iterdir()} == {
        "model",
        "optimizer.pt",
        "scheduler.pt",
        "rng_state.pt",
        "trainer_state.json",
    }
    assert (path / "model" / "model.safetensors").is_file()
    written = json.loads((path / "trainer_state.json").read_text())
    assert written["step"] == 5 and written["groups_consumed"] == 15 and written["adapter_only"] is False
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-5"]  # no temporary folder left behind


def test_lora_checkpoint_holds_only_the_adapter_and_round_trips(tiny_model_dir, tmp_path):
    model, optimizer, scheduler = make_training(tiny_model_dir, lora=True)
    torch.manual_seed(0)
    train(model, optimizer, scheduler, 2)
    path = save_checkpoint(tmp_path, state(2), model, optimizer, scheduler)

    files = {p.name for p in (path / "model").iterdir()}
    assert files == {"adapter_model.safetensors", "adapter_config.json", "README.md"}
    from safetensors import safe_open

    with safe_open(path / "model" / "adapter_model.safetensors", framework="pt") as saved:
        keys = list(saved.keys())
    assert keys and all("lora_A" in k or "lora_B" in k for k in keys)

    fresh, fresh_optimizer, fresh_scheduler = make_training(tiny_model_dir, lora=True)
    assert not torch.equal(params(fresh)[_lora_b_key(fresh)], params(model)[_lora_b_key(model)])
    load_checkpoint(path, fresh, fresh_optimizer, fresh_scheduler)

    assert_same_tensors(params(fresh), params(model))
    assert fresh_scheduler.state_dict() == scheduler.state_dict()


def _lora_b_key(model: nn.Module) -> str:
    return next(k for k in model.state_dict() if "lora_B" in k)


def test_full_checkpoint_into_a_peft_model_is_refused(tiny_model_dir, tmp_path):
    model, optimizer, scheduler = make_training(tiny_model_dir)
    path = save_checkpoint(tmp_path, state(1), model, optimizer, scheduler)
    lora_model, lora_optimizer, lora_scheduler = make_training(tiny_model_dir, lora=True)

    with pytest.raises(ValueError, match="holds a full model but the model to restore is a PeftModel"):
        load_checkpoint(path, lora_model, lora_optimizer, lora_scheduler)


def test_checkpoint_of_another_architecture_is_refused_and_changes_nothing(tiny_model_dir, tmp_path):
    small_config = AutoConfig.from_pretrained(
        tiny_model_dir, num_hidden_layers=2, layer_types=["full_attention"] * 2, intermediate_size=512
    )
    small = AutoModelForCausalLM.from_config(small_config)
    small_optimizer = torch.optim.AdamW(small.parameters())
    small_scheduler = torch.optim.lr_scheduler.LambdaLR(small_optimizer, lambda step: 1.0)
    path = save_checkpoint(tmp_path, state(1), small, small_optimizer, small_scheduler)
    model, optimizer, scheduler = make_training(tiny_model_dir)
    before = params(model)

    with pytest.raises(ValueError, match="do not match the model") as raised:
        load_checkpoint(path, model, optimizer, scheduler)

    message = str(raised.value)
    assert "missing keys" in message and "model.layers.2." in message
    assert "shape mismatches" in message and "mlp.gate_proj.weight: (512, 256) vs (768, 256)" in message
    assert_same_tensors(params(model), before)


def test_save_total_limit_deletes_the_oldest(tiny_model_dir, tmp_path):
    model, optimizer, scheduler = make_training(tiny_model_dir)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, state(step), model, optimizer, scheduler, save_total_limit=2)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-3"]
    with pytest.raises(ValueError, match="at least 1"):
        save_checkpoint(tmp_path, state(4), model, optimizer, scheduler, save_total_limit=0)


def test_saving_a_step_again_replaces_its_checkpoint(tiny_model_dir, tmp_path):
    model, optimizer, scheduler = make_training(tiny_model_dir)
    save_checkpoint(tmp_path, state(4), model, optimizer, scheduler)
    again = TrainerState(step=4, groups_consumed=99, policy_version=4)
    path = save_checkpoint(tmp_path, again, model, optimizer, scheduler)

    assert json.loads((path / "trainer_state.json").read_text())["groups_consumed"] == 99
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-4"]


def test_a_save_that_fails_midway_leaves_no_checkpoint(tiny_model_dir, tmp_path):
    class BrokenScheduler:
        def state_dict(self):
            raise OSError("disk full")

    model, optimizer, _ = make_training(tiny_model_dir)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, state(1), model, optimizer, BrokenScheduler())

    assert latest_checkpoint(tmp_path) is None
    assert list(tmp_path.iterdir()) == []


def test_latest_checkpoint_takes_the_highest_complete_step(tiny_model_dir, tmp_path):
    model, optimizer, scheduler = make_training(tiny_model_dir)
    for step in (9, 10):
        save_checkpoint(tmp_path, state(step), model, optimizer, scheduler)
    incomplete = tmp_path / "checkpoint-11"
    incomplete.mkdir()
    (incomplete / "trainer_state.json").write_text("{}")
    (tmp_path / ".checkpoint-tmp-12-abc").mkdir()  # a save killed midway

    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-10"
    assert latest_checkpoint(tmp_path / "nothing-here") is None
    with pytest.raises(ValueError, match=r"incomplete: missing optimizer\.pt"):
        load_checkpoint(incomplete, model, optimizer, scheduler)


def test_the_next_save_removes_what_a_killed_save_left(tiny_model_dir, tmp_path):
    leftover = tmp_path / ".checkpoint-tmp-3-xyz"
    leftover.mkdir(parents=True)
    model, optimizer, scheduler = make_training(tiny_model_dir)
    save_checkpoint(tmp_path, state(4), model, optimizer, scheduler)

    assert not leftover.exists()


def test_resolve_resume(tiny_model_dir, tmp_path):
    assert resolve_resume(None, tmp_path) is None
    assert resolve_resume(False, tmp_path) is None
    with pytest.raises(FileNotFoundError, match="holds no complete checkpoint-N"):
        resolve_resume(True, tmp_path)
    with pytest.raises(FileNotFoundError, match="no checkpoint folder"):
        resolve_resume(str(tmp_path / "checkpoint-3"), tmp_path)

    model, optimizer, scheduler = make_training(tiny_model_dir)
    path = save_checkpoint(tmp_path, state(3), model, optimizer, scheduler)
    assert resolve_resume(True, tmp_path) == path
    assert resolve_resume("latest", tmp_path) == path
    assert resolve_resume(str(path), tmp_path) == path

    (path / "optimizer.pt").unlink()
    with pytest.raises(ValueError, match=r"incomplete: missing optimizer\.pt"):
        resolve_resume(str(path), tmp_path)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_train_save_load_train_equals_training_straight_through(tiny_model_dir, tmp_path, lora):
    torch.manual_seed(0)
    straight, optimizer, scheduler = make_training(tiny_model_dir, lora=lora)
    train(straight, optimizer, scheduler, 4)

    torch.manual_seed(0)
    first, optimizer, scheduler = make_training(tiny_model_dir, lora=lora)
    train(first, optimizer, scheduler, 2)
    path = save_checkpoint(tmp_path, state(2), first, optimizer, scheduler)
    del first, optimizer, scheduler
    torch.manual_seed(1234)  # a new process starts from other RNG states; load must restore them
    resumed, optimizer, scheduler = make_training(tiny_model_dir, lora=lora)
    assert load_checkpoint(path, resumed, optimizer, scheduler).step == 2
    train(resumed, optimizer, scheduler, 2)

    assert_same_tensors(params(resumed), params(straight), atol=1e-6)
