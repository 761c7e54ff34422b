"""The GPU check script imports and explains itself on a CPU-only machine; its helpers are exact."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from harness_trainer.engines import gpu_check


def test_help_works_without_cuda_vllm_or_transformers_loaded() -> None:
    probe = (
        "import sys, runpy, harness_trainer.engines.gpu_check; "
        "print(sorted(m for m in ('vllm', 'transformers', 'peft') if m in sys.modules)); "
        "runpy.run_module('harness_trainer.engines.gpu_check', run_name='__main__')"
    )
    reply = subprocess.run(
        [sys.executable, "-c", probe, "--help"], capture_output=True, text=True, timeout=60
    )
    assert reply.returncode == 0, reply.stderr
    loaded, _, usage = reply.stdout.partition("\n")
    assert loaded == "[]"
    assert "--vllm-url" in usage and "--lora" in usage


def test_the_noise_comes_off_again_and_logprobs_are_the_tempered_softmax(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    original = {name: p.detach().clone() for name, p in model.named_parameters()}

    gpu_check.add_noise(model, std=0.1, seed=3)
    assert any(not torch.equal(p, original[n]) for n, p in model.named_parameters())
    gpu_check.add_noise(model, std=0.1, seed=3, sign=-1.0)
    assert all(torch.allclose(p, original[n], atol=1e-6) for n, p in model.named_parameters())

    prompt, completion = [5, 6, 7], [8, 9]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0]
    expected = [torch.log_softmax(logits[2 + i] / 0.5, -1)[token] for i, token in enumerate(completion)]
    assert torch.allclose(
        gpu_check.logprobs_of(model, prompt, completion, 0.5), torch.stack(expected), atol=1e-6
    )
