"""The trainer over several engine replicas (``vllm_replica_urls``): every step's weights reach every real
dev engine on loopback, and adaptive concurrency reads each one's load; a replica killed mid-run is taken
out (drained at a real ``capture_proxy --replicas``, whose admin key the trainer reads from the environment)
while the run goes on; the config's refusals; and a factory over several rollout servers, whose state each
step logs."""

from __future__ import annotations

import asyncio
import http.server
import threading
import time

import httpx
import pytest

from capture_proxy.config import ADMIN_KEY_ENV
from harness_trainer import HarnessAsyncGRPOTrainer
from harness_trainer.engines import EngineReplicas
from harness_trainer.trainer.config.async_grpo import AsyncGRPOConfig
from harness_trainer.trainer.config.problems import ConfigProblems
from tests.engines.test_engine_replicas import replica_proxy, two_engines, weight_version  # noqa: F401
from tests.trainer.handmade import HandmadeFactory
from tests.trainer.test_trainer import builder, config, metrics_lines


def greedy_logprobs(url: str) -> list[float]:
    """The logprobs of a greedy reply: they move with any change of the weights."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Count to five."}], "temperature": 0.0}
    body.update(max_tokens=6, logprobs=True)
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    reply.raise_for_status()
    return [round(entry["logprob"], 4) for entry in reply.json()["choices"][0]["logprobs"]["content"]]


@pytest.mark.slow
def test_every_step_reaches_every_replica(two_engines, tiny_model_dir, tmp_path) -> None:  # noqa: F811
    first, second = two_engines
    before = greedy_logprobs(second.url)
    factory = HandmadeFactory()
    args = config(
        tmp_path, engine="auto", vllm_server_base_url=first.url, vllm_replica_urls=f"{second.url}/v1",
        max_steps=2, learning_rate=0.05, adaptive_concurrency=True, concurrency_poll_interval=1.0,
    )  # fmt: skip
    trainer = HarnessAsyncGRPOTrainer(str(tiny_model_dir), builder(factory), args)
    trainer.train()
    assert args.vllm_replica_urls == [f"{second.url}/v1"]  # the comma-separated form, split
    assert [weight_version(engine.url) for engine in two_engines] == [2, 2]
    after = greedy_logprobs(second.url)
    assert after == greedy_logprobs(first.url) and after != before  # both serve the trained weights
    lines = metrics_lines(tmp_path / "out")
    assert [line["engine/replicas_out"] for line in lines] == [0.0, 0.0]
    # adaptive concurrency reads both replicas' /metrics (a poll that overlapped a push may read fewer)
    assert max(line["engine/replicas_read"] for line in lines) == 2.0
    assert not factory.live and factory.factory_closed


@pytest.mark.slow
def test_a_replica_killed_mid_run_is_drained_and_the_run_goes_on(
    two_engines,  # noqa: F811
    tiny_model_dir,
    tmp_path,
    monkeypatch,
) -> None:
    first, second = two_engines
    proxy, client = replica_proxy(first.url, second.url, tmp_path / "proxy")
    loop = asyncio.new_event_loop()  # the proxy's child process is watched from the loop that started it
    loop.run_until_complete(proxy.start(client))
    monkeypatch.setenv(ADMIN_KEY_ENV, "key")

    def kill_after_first_push() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and weight_version(first.url) < 1:
            time.sleep(0.05)
        second.process.kill()

    killer = threading.Thread(target=kill_after_first_push, daemon=True)
    try:
        factory = HandmadeFactory()
        args = config(
            tmp_path, engine="dev", vllm_server_base_url=first.url, vllm_replica_urls=[second.url],
            replica_proxy_url=proxy.url, max_steps=3,
        )  # fmt: skip
        trainer = HarnessAsyncGRPOTrainer(str(tiny_model_dir), builder(factory), args)
        killer.start()
        trainer.train()
        killer.join(60)
        assert isinstance(trainer.engine, EngineReplicas) and trainer.engine.out_of_rotation == [1]
        lines = metrics_lines(tmp_path / "out")
        assert [line["step"] for line in lines] == [1, 2, 3]
        assert lines[-1]["engine/replicas_out"] == 1.0 and lines[-1]["policy_version"] == 3.0
        assert weight_version(first.url) == 3
        assert [r["drained"] for r in loop.run_until_complete(client.replicas())] == [False, True]
    finally:
        loop.run_until_complete(proxy.stop())
        loop.run_until_complete(client.aclose())
        loop.close()


@pytest.mark.slow
def test_a_replica_of_another_kind_is_refused_naming_it(two_engines, tiny_model_dir, tmp_path) -> None:  # noqa: F811
    # It answers, but not GET /weight_version (a route only the dev engine has): taken for a vLLM.
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    not_dev = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        args = config(
            tmp_path, engine="dev", vllm_server_base_url=two_engines[0].url, vllm_replica_urls=[not_dev]
        )
        trainer = HarnessAsyncGRPOTrainer(str(tiny_model_dir), builder(HandmadeFactory()), args)
        with pytest.raises(ValueError, match=f"every replica must be a dev engine.*{not_dev}"):
            trainer.train()
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"vllm_replica_urls": ["http://a:8000/v1"]}, "name an engine twice"),
        ({"replica_proxy_url": "http://proxy:8300"}, "vllm_replica_urls names none"),
        ({"vllm_replica_urls": ["http://b:8000"], "engine": "none"}, "engine='none'"),
        (
            {"vllm_replica_urls": ["http://b:8000"], "engine": "vllm", "use_peft": True},
            "lora_sync='adapter' publishes each adapter on one engine",
        ),
    ],
)
def test_bad_replica_settings_are_refused(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigProblems, match=message):
        AsyncGRPOConfig(vllm_server_base_url="http://a:8000", **overrides)


def test_without_replicas_the_engine_is_one_client(tmp_path) -> None:
    assert AsyncGRPOConfig(output_dir=str(tmp_path)).vllm_replica_urls == []


class TwoServerFactory(HandmadeFactory):
    """Hand-made sessions from a factory that reports two rollout servers, the second gone with 3 rollouts."""

    def servers_report(self) -> list[dict]:
        return [
            {"url": "http://a", "up": True, "open": 1, "capacity": 4, "placed": 9, "lost": 0},
            {"url": "http://b", "up": False, "open": 0, "capacity": 4, "placed": 5, "lost": 3},
        ]


def test_a_factory_over_several_rollout_servers_has_their_state_logged_each_step(
    tiny_model_dir, tmp_path
) -> None:
    trainer = HarnessAsyncGRPOTrainer(str(tiny_model_dir), builder(TwoServerFactory()), config(tmp_path))
    trainer.train()
    lines = metrics_lines(tmp_path / "out")
    logged = [(line["rollout/servers_down"], line["rollout/server_lost_total"]) for line in lines]
    assert logged == [(1, 3)] * 3
    one = tmp_path / "one"
    HarnessAsyncGRPOTrainer(str(tiny_model_dir), builder(HandmadeFactory()), config(one)).train()
    assert all("rollout/servers_down" not in line for line in metrics_lines(one / "out"))
