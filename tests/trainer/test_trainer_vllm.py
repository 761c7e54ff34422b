"""The trainer pushing weights to vLLM: the control sequence of every step, against the loopback fake."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from harness_trainer import AsyncGRPOConfig, HarnessAsyncGRPOTrainer
from harness_trainer.engines import RetryPolicy, VLLMEngine
from tests.engines.conftest import bound_socket, serve
from tests.engines.fake_vllm_control import FakeTransport, FakeVLLM
from tests.trainer.handmade import HandmadeFactory


def serve_in_thread(fake: FakeVLLM) -> tuple[str, asyncio.AbstractEventLoop, threading.Thread]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    sock = bound_socket()
    runner = asyncio.run_coroutine_threadsafe(serve(fake.app(), sock), loop).result(10)
    loop.runner = runner  # type: ignore[attr-defined]
    return f"http://127.0.0.1:{sock.getsockname()[1]}", loop, thread


def test_each_step_pushes_the_full_weights_through_vllms_control_sequence(tmp_path, tiny_model_dir):
    fake = FakeVLLM(generation_s=0.0)
    url, loop, thread = serve_in_thread(fake)
    try:
        transport = FakeTransport(fake)
        engine = VLLMEngine(url, weight_sync=transport, retry=RetryPolicy(attempts=2, backoff_s=0.01))
        config = AsyncGRPOConfig(
            output_dir=str(tmp_path / "out"), engine="vllm", vllm_server_base_url=url, num_generations=2,
            max_concurrent_rollouts=2, max_steps=2, learning_rate=1e-4, disable_tqdm=True, token_budget=64,
        )  # fmt: skip
        factory = VersionFactory()
        trainer = HarnessAsyncGRPOTrainer(
            str(tiny_model_dir), lambda sampling: factory, config, engine=engine
        )
        trainer.train()
    finally:
        asyncio.run_coroutine_threadsafe(loop.runner.cleanup(), loop).result(10)  # type: ignore[attr-defined]
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    updates = [c for c in fake.calls if c.route == "POST /finish_weight_update"]
    assert [c.body["weight_version"] for c in updates] == ["1", "2"]
    assert all(transport.sent_while_update_in_flight) and len(transport.sent) == 2
    final = {name: p.detach() for name, p in trainer.model.state_dict().items()}
    for name, tensor in transport.sent[-1].items():
        torch.testing.assert_close(tensor, final[name])
    assert set(transport.sent[-1]) == set(final)
    assert trainer.state.policy_version == 2
    # The rollouts' capture proxy hears each version the engine serves: at the start, then after each push.
    assert factory.versions == [0, 1, 2]


class VersionFactory(HandmadeFactory):
    """A factory that records the versions the trainer says the engine serves (weights pushed in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.versions: list[int] = []

    def set_policy_version(self, version: int) -> None:
        self.versions.append(version)


class PolicyFactory(HandmadeFactory):
    """A factory that records where the trainer sends the rollouts' model calls."""

    def __init__(self) -> None:
        super().__init__()
        self.policies: list[tuple[str, int]] = []

    def set_policy(self, model: str, version: int) -> None:
        self.policies.append((model, version))


def lora_run(tmp_path, tiny_model_dir, fake: FakeVLLM, factory, **config: object) -> HarnessAsyncGRPOTrainer:
    url, loop, thread = serve_in_thread(fake)
    try:
        config = AsyncGRPOConfig(
            output_dir=str(tmp_path / "out"), engine="vllm", vllm_server_base_url=url, num_generations=2,
            max_concurrent_rollouts=2, learning_rate=1e-3, disable_tqdm=True, token_budget=64,
            use_peft=True, lora_r=4, lora_alpha=8, weight_sync_dir=str(tmp_path / "shm"), **config,
        )  # fmt: skip
        trainer = HarnessAsyncGRPOTrainer(str(tiny_model_dir), lambda sampling: factory, config)
        trainer.train()
        return trainer
    finally:
        asyncio.run_coroutine_threadsafe(loop.runner.cleanup(), loop).result(10)  # type: ignore[attr-defined]
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_with_lora_only_the_adapter_travels_and_the_rollouts_follow_each_version(tmp_path, tiny_model_dir):
    fake, factory = FakeVLLM(generation_s=0.0), PolicyFactory()

    trainer = lora_run(tmp_path, tiny_model_dir, fake, factory, max_steps=3, max_staleness=1)

    loads = [c.body["lora_name"] for c in fake.calls if c.route == "POST /v1/load_lora_adapter"]
    unloads = [c.body["lora_name"] for c in fake.calls if c.route == "POST /v1/unload_lora_adapter"]
    assert loads == ["policy-v1", "policy-v2", "policy-v3"]
    assert unloads == ["policy-v1"]  # max_staleness + 1 = 2 adapters stay loaded
    assert factory.policies == [("policy-v1", 1), ("policy-v2", 2), ("policy-v3", 3)]
    assert not any(c.route in ("POST /collective_rpc", "POST /update_weights") for c in fake.calls)
    assert trainer.state.policy_version == 3 and not fake.paused
    assert list((tmp_path / "shm").iterdir()) == []  # the adapter folders go with the run


def test_an_adapter_rank_above_vllms_limit_stops_the_run_before_any_rollout(tmp_path, tiny_model_dir):
    fake, factory = FakeVLLM(generation_s=0.0, lora_config={"max_lora_rank": 2}), PolicyFactory()
    with pytest.raises(ValueError, match=r"rank 4 is above vLLM's --max-lora-rank 2"):
        lora_run(tmp_path, tiny_model_dir, fake, factory, max_steps=1)
    assert factory.created == [] and not any(c.route.startswith("POST /v1/") for c in fake.calls)
