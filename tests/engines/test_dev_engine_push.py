"""DevEngine.push_weights on a real dev engine process: the engine then samples from exactly the pushed model.

Parity is the property the trainer relies on: for the prompt ids and sampled ids the engine returns, its
logprobs equal ``log_softmax(logits / temperature)`` of the trainer's own copy of the pushed model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from aiohttp import web
from transformers import AutoModelForCausalLM

from harness_trainer.engines import DevEngine, EngineUnavailable, MalformedReply, RetryPolicy
from tests.conftest import EngineProcess, start_engine
from tests.engines.conftest import bound_socket, serve

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def dev_engine(tiny_model_dir: Path) -> Iterator[EngineProcess]:
    running = start_engine(tiny_model_dir)
    yield running
    running.stop()


def perturbed_model(model_dir: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    noise = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=noise) * 0.05)
    return model


def trainer_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
    logprobs = torch.log_softmax(logits / TEMPERATURE, dim=-1)
    return logprobs.gather(-1, torch.tensor(completion)[:, None])[:, 0]


@pytest.mark.slow
async def test_after_a_push_the_engine_samples_from_the_pushed_weights(
    dev_engine: EngineProcess, tiny_model_dir: Path
) -> None:
    model = perturbed_model(tiny_model_dir)

    assert await DevEngine(dev_engine.url).push_weights(model.state_dict(), version=1) == 1

    async with httpx.AsyncClient(base_url=dev_engine.url, timeout=120) as http:
        reply = (
            await http.post(
                "/v1/chat/completions",
                json={
                    "model": dev_engine.model,
                    "messages": [{"role": "user", "content": "Write a haiku about gradients."}],
                    "max_tokens": 16,
                    "temperature": TEMPERATURE,
                    "seed": 11,
                    "logprobs": True,
                    "top_logprobs": 0,
                    "return_token_ids": True,
                },
            )
        ).json()
        assert (await http.get("/weight_version")).json() == {"weight_version": 1}
    assert reply["weight_version"] == 1
    prompt, sampled = reply["prompt_token_ids"], reply["choices"][0]["token_ids"]
    served = torch.tensor([entry["logprob"] for entry in reply["choices"][0]["logprobs"]["content"]])
    assert len(sampled) == len(served) > 0

    expected = trainer_logprobs(model, prompt, sampled)
    assert torch.max(torch.abs(served - expected)) <= 1e-4
    # The push mattered: the weights the engine started with give other logprobs.
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert torch.max(torch.abs(served - trainer_logprobs(original, prompt, sampled))) > 1e-3


@pytest.mark.slow
async def test_a_push_to_a_stopped_engine_is_retried_then_reported(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stopped = start_engine(tiny_model_dir)
    stopped.stop()
    engine = DevEngine(stopped.url, retry=RetryPolicy(attempts=3, backoff_s=0.05))
    weights = {"model.norm.weight": torch.ones(1)}
    with (
        caplog.at_level(logging.WARNING),
        pytest.raises(EngineUnavailable, match="unreachable after 3 attempt"),
    ):
        await engine.push_weights(weights, version=1)
    assert len([r for r in caplog.records if "/update_weights" in r.getMessage()]) == 2


@pytest.mark.slow
async def test_served_version_is_none_on_the_start_up_weights_then_the_version_pushed(
    tiny_model_dir: Path,
) -> None:
    running = start_engine(tiny_model_dir)
    try:
        engine = DevEngine(running.url)
        assert await engine.served_version() is None
        norm = perturbed_model(tiny_model_dir).state_dict()["model.norm.weight"]
        await engine.push_weights({"model.norm.weight": norm}, version=4)
        assert await engine.served_version() == 4
    finally:
        running.stop()
    with pytest.raises(EngineUnavailable, match="unreachable after 1 attempt"):
        await DevEngine(running.url, retry=RetryPolicy(attempts=1)).served_version()


@pytest.mark.parametrize("answer", [{"weight_version": "3"}, {"weight_version": None}, {}, [1]])
async def test_a_weight_version_answer_without_a_version_is_a_malformed_reply(answer: object) -> None:
    async def weight_version(request: web.Request) -> web.Response:
        return web.json_response(answer)

    app = web.Application()
    app.router.add_get("/weight_version", weight_version)
    sock = bound_socket()
    runner = await serve(app, sock)
    try:
        with pytest.raises(MalformedReply, match="no version"):
            await DevEngine(f"http://127.0.0.1:{sock.getsockname()[1]}").served_version()
    finally:
        await runner.cleanup()
