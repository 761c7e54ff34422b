"""Weight updates on a running dev engine: versions, draining, pause/resume, refusals that change nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from harness_trainer.engines import DevEngine, EngineUnavailable, InferenceEngine
from tests.conftest import EngineProcess, start_engine

BODY = {
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": 8,
    "temperature": 1.0,
    "seed": 7,
    "logprobs": True,
    "top_logprobs": 0,
    "return_token_ids": True,
}


@pytest.fixture
def updatable(tiny_model_dir: Path) -> Iterator[EngineProcess]:
    running = start_engine(tiny_model_dir)
    yield running
    running.stop()


def ask(engine: EngineProcess, **extra) -> dict:
    reply = httpx.post(
        f"{engine.url}/v1/chat/completions", json={"model": engine.model, **BODY, **extra}, timeout=120
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


def perturbed_state(model_dir: Path, scale: float = 3.0) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(1)
    return {
        name: (t * scale + torch.randn_like(t) * 0.05)
        for name, t in model.state_dict().items()
        if name.startswith("model.")
    }


def logprobs_under(state: dict[str, torch.Tensor], model_dir: Path, reply: dict) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.load_state_dict(state, strict=False)
    prompt, sampled = reply["prompt_token_ids"], reply["choices"][0]["token_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + sampled])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(sampled)[:, None])[:, 0]


def served_logprobs(reply: dict) -> torch.Tensor:
    return torch.tensor([e["logprob"] for e in reply["choices"][0]["logprobs"]["content"]])


def test_dev_engine_client_satisfies_the_engine_protocol() -> None:
    assert isinstance(DevEngine("http://127.0.0.1:1"), InferenceEngine)


@pytest.mark.slow
def test_pushed_weights_are_served_under_the_new_version(
    updatable: EngineProcess, tiny_model_dir: Path
) -> None:
    before = ask(updatable)
    assert before["weight_version"] == 0
    state = perturbed_state(tiny_model_dir)
    engine = DevEngine(updatable.url)
    assert asyncio.run(engine.push_weights(state, version=1)) == 1
    after = ask(updatable)
    assert after["weight_version"] == 1
    assert torch.max(torch.abs(served_logprobs(after) - logprobs_under(state, tiny_model_dir, after))) <= 1e-4
    assert httpx.get(f"{updatable.url}/weight_version").json() == {"weight_version": 1}


@pytest.mark.slow
def test_weights_load_from_a_safetensors_file(
    updatable: EngineProcess, tiny_model_dir: Path, tmp_path: Path
) -> None:
    state = perturbed_state(tiny_model_dir, scale=2.0)
    save_file(state, tmp_path / "w.safetensors")
    assert asyncio.run(DevEngine(updatable.url).push_weights_file(tmp_path / "w.safetensors", version=4)) == 4
    reply = ask(updatable)
    assert reply["weight_version"] == 4
    assert torch.max(torch.abs(served_logprobs(reply) - logprobs_under(state, tiny_model_dir, reply))) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize(
    ("tensors", "version", "status", "words"),
    [
        ({"model.no_such.weight": torch.zeros(2)}, 1, 400, "unknown tensor"),
        ({"model.norm.weight": torch.zeros(3)}, 1, 400, "shape"),
        ({}, 1, 400, "no tensors"),
        ({"model.norm.weight": torch.zeros(256)}, 0, 409, "does not advance"),
    ],
)
def test_a_bad_update_is_refused_and_changes_nothing(
    updatable: EngineProcess, tensors: dict, version: int, status: int, words: str
) -> None:
    before = ask(updatable)
    from safetensors.torch import save

    reply = httpx.post(
        f"{updatable.url}/update_weights",
        params={"version": version},
        content=save(tensors),
        headers={"content-type": "application/octet-stream"},
        timeout=60,
    )
    assert reply.status_code == status
    assert words in reply.json()["error"]["message"]
    after = ask(updatable)
    assert after["weight_version"] == 0
    assert after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]
    assert served_logprobs(after).tolist() == served_logprobs(before).tolist()


@pytest.mark.slow
def test_garbage_update_bodies_get_a_400(updatable: EngineProcess) -> None:
    for kwargs in (
        {"content": b"not safetensors", "params": {"version": 1}},
        {"content": b"x", "params": {"version": "one"}},
        {"json": {"path": "/nonexistent.safetensors", "version": 1}},
    ):
        reply = httpx.post(f"{updatable.url}/update_weights", timeout=30, **kwargs)
        assert reply.status_code == 400, reply.text
    assert ask(updatable)["weight_version"] == 0


@pytest.mark.slow
def test_pause_holds_new_generations_until_resume_and_updates_run_while_paused(
    updatable: EngineProcess, tiny_model_dir: Path
) -> None:
    async def scenario() -> None:
        engine = DevEngine(updatable.url)
        async with httpx.AsyncClient(base_url=updatable.url, timeout=120) as http:
            in_flight = asyncio.create_task(
                http.post(
                    "/v1/chat/completions",
                    json={"model": updatable.model, **BODY, "max_tokens": 300, "stop_token_ids": []},
                )
            )
            await asyncio.sleep(0.3)
            await engine.pause()  # returns once the generation in flight has finished
            assert in_flight.done(), "pause drains the generation in flight"
            assert (await in_flight).json()["weight_version"] == 0
            assert (await http.get("/is_paused")).json() == {"is_paused": True}
            held = asyncio.create_task(
                http.post("/v1/chat/completions", json={"model": updatable.model, **BODY})
            )
            await asyncio.sleep(0.5)
            assert not held.done(), "no generation starts while paused"
            assert await engine.push_weights(perturbed_state(tiny_model_dir), version=2) == 2
            await engine.resume()
            reply = await held
            assert reply.status_code == 200 and reply.json()["weight_version"] == 2

    asyncio.run(scenario())


def test_an_unreachable_engine_is_reported_not_hung() -> None:
    engine = DevEngine("http://127.0.0.1:9", timeout=5)
    assert asyncio.run(engine.health()) is False
    with pytest.raises(EngineUnavailable):
        asyncio.run(engine.pause())
