"""The policy's weights as the engine names them: LoRA merged into copies, the module untouched."""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM

from harness_trainer.trainer.policy import engine_weights


def test_lora_engine_weights_equal_a_merged_copy_and_leave_the_model_as_it_was(tiny_model_dir):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    before = {name: t.detach().clone() for name, t in model.state_dict().items()}
    weights = engine_weights(model)
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    assert set(weights) == set(merged)
    for name, tensor in merged.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=0)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_full_model_engine_weights_are_its_state_dict(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    weights = engine_weights(model)
    assert weights.keys() == model.state_dict().keys()
