"""The ``file`` weight-sync path (vLLM's in-place reload from a safetensors folder) and the ``auto`` choice.

VLLMEngine drives the fake control plane (``fake_vllm_control.py``, whose ``/collective_rpc``,
``/update_weight_version`` and ``/is_paused`` answers ``test_vllm_cpu_control.py`` replays against a real
vLLM); ``test_vllm_cpu_weight_sync.py`` runs the same path on a real vLLM.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness_trainer.engines import (
    EngineUnavailable,
    FileWeightSync,
    PushRefused,
    RetryPolicy,
    VLLMEngine,
    choose_weight_sync,
)
from harness_trainer.engines.weight_sync import (
    checkpoint_shapes,
    is_local_host,
    reload_request,
    shareable_tensors,
)
from harness_trainer.trainer.config.async_grpo import AsyncGRPOConfig
from tests.engines.conftest import Served

FAST_RETRY = RetryPolicy(attempts=2, backoff_s=0.01)


def weights(scale: float = 1.0) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    embed = torch.randn(16, 8) * scale
    return {
        "model.embed_tokens.weight": embed,
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, dtype=torch.bfloat16) * scale,
        "lm_head.weight": embed,  # tied, as in the tiny model: same storage
    }


SHAPES = {name: list(t.shape) for name, t in weights().items()}


# -- the auto choice --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("requested", "url", "expected"),
    [
        ("auto", "http://127.0.0.1:8000", "file"),
        ("auto", "http://localhost:8000/v1", "file"),
        ("auto", "http://[::1]:8000", "file"),
        ("auto", "http://192.0.2.10:8000", "nccl"),  # TEST-NET-1: never this host; nothing is sent
        ("nccl", "http://127.0.0.1:8000", "nccl"),
        ("file", "http://192.0.2.10:8000", "file"),
    ],
)
def test_auto_picks_the_file_path_for_a_vllm_on_this_host_and_nccl_elsewhere(
    requested: str, url: str, expected: str
) -> None:
    assert choose_weight_sync(requested, url) == expected


def test_an_unknown_weight_sync_is_refused_by_the_chooser_and_the_config() -> None:
    with pytest.raises(ValueError, match="weight_sync 'ipc' is not one of"):
        choose_weight_sync("ipc", "http://127.0.0.1:8000")
    with pytest.raises(ValueError, match="weight_sync 'shm' is not one of"):
        AsyncGRPOConfig(weight_sync="shm")


def test_a_name_that_does_not_resolve_is_not_this_host() -> None:
    assert not is_local_host("no-such-host.invalid")
    assert is_local_host("localhost")


# -- the file itself --------------------------------------------------------------------------------------


def test_tied_weights_are_written_as_their_own_copies_with_every_name(tmp_path: Path) -> None:
    original = weights()
    shared = shareable_tensors(original)
    assert list(shared) == list(original)
    assert (
        shared["lm_head.weight"].untyped_storage().data_ptr()
        != shared["model.embed_tokens.weight"].untyped_storage().data_ptr()
    )
    sync = FileWeightSync(tmp_path)
    folder = sync.write(original, version=3)
    assert folder.name == "v3" and folder.parent.parent == tmp_path
    loaded = load_file(folder / "model.safetensors")
    assert set(loaded) == set(original)
    for name, tensor in original.items():
        assert torch.equal(loaded[name], tensor) and loaded[name].dtype == tensor.dtype
    sync.close()
    assert not any(tmp_path.iterdir())


def test_the_default_folder_is_shared_memory_when_there_is_one() -> None:
    sync = FileWeightSync()
    try:
        expected = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(sync.run_dir).parent
        assert sync.run_dir.parent == expected
    finally:
        sync.close()


def test_committing_keeps_only_the_served_version(tmp_path: Path) -> None:
    sync = FileWeightSync(tmp_path)
    first = sync.write(weights(), 1)
    sync.committed(first)
    second = sync.write(weights(2.0), 2)
    sync.discard(first)  # never the rollback point
    assert first.exists()
    sync.committed(second)
    assert not first.exists() and second.exists() and sync.last_good == second
    sync.close()


def test_the_reload_request_is_vllms_collective_rpc_body() -> None:
    assert reload_request("/dev/shm/x/v1") == {
        "method": "reload_weights",
        "kwargs": {"weights_path": "/dev/shm/x/v1", "is_checkpoint_format": True},
    }


# -- VLLMEngine over the file path ------------------------------------------------------------------------


async def test_a_file_push_reloads_stamps_the_version_and_resets_the_cache(
    serve_fake, tmp_path: Path
) -> None:
    served: Served = await serve_fake(expected_shapes=SHAPES)
    sync = FileWeightSync(tmp_path)
    engine = VLLMEngine(served.url, weight_sync=sync, retry=FAST_RETRY)

    assert await engine.push_weights(weights(), version=4) == 4

    fake = served.fake
    assert fake.routes() == [
        "GET /v1/models",  # the served checkpoint, to check the push against (once per engine client)
        "POST /pause", "POST /collective_rpc", "POST /update_weight_version", "POST /reset_prefix_cache",
        "POST /resume",
    ]  # fmt: skip
    assert fake.weight_version == "4" and not fake.paused
    assert fake.reloads == [str(sync.last_good)]
    assert torch.equal(fake.loaded["lm_head.weight"], weights()["lm_head.weight"])
    engine.close()
    assert not any(tmp_path.iterdir())


async def test_a_push_inside_the_callers_pause_leaves_the_resume_to_the_caller(serve_fake, tmp_path) -> None:
    served: Served = await serve_fake(expected_shapes=SHAPES)
    engine = VLLMEngine(served.url, weight_sync=FileWeightSync(tmp_path), retry=FAST_RETRY)
    await engine.pause()
    await engine.push_weights(weights(), version=1)
    assert served.fake.paused
    await engine.resume()
    assert not served.fake.paused
    engine.close()


async def test_a_refused_push_rolls_back_to_the_last_good_version_and_resumes(serve_fake, tmp_path) -> None:
    served: Served = await serve_fake(expected_shapes=SHAPES)
    sync = FileWeightSync(tmp_path)
    engine = VLLMEngine(served.url, weight_sync=sync, retry=FAST_RETRY)
    await engine.push_weights(weights(), version=1)
    good = sync.last_good
    bad = {**weights(2.0), "model.layers.0.self_attn.q_proj.weight": torch.zeros(3, 3)}

    with pytest.raises(PushRefused, match=r"cannot load model.layers.0.self_attn.q_proj.weight"):
        await engine.push_weights(bad, version=2)

    fake = served.fake
    assert fake.reloads[-1] == str(good)  # the old weights, whole, reloaded while still paused
    assert torch.equal(fake.loaded["model.embed_tokens.weight"], weights()["model.embed_tokens.weight"])
    assert fake.weight_version == "1" and not fake.paused
    assert [p.name for p in sync.run_dir.iterdir()] == ["v1"]  # the refused folder is gone
    engine.close()


async def test_a_refused_first_push_rolls_back_to_the_served_models_own_folder(serve_fake, tmp_path) -> None:
    served: Served = await serve_fake(expected_shapes=SHAPES, root="/models/tiny")
    engine = VLLMEngine(served.url, weight_sync=FileWeightSync(tmp_path), retry=FAST_RETRY)
    with pytest.raises(PushRefused):
        await engine.push_weights({"model.bogus.weight": torch.zeros(2)}, version=1)
    assert served.fake.reloads[-1] == "/models/tiny"
    assert not served.fake.paused and served.fake.weight_version == "default"
    engine.close()


async def test_a_push_the_served_checkpoint_cannot_take_is_refused_before_vllm_sees_it(
    serve_fake, tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    checkpoint = tmp_path / "served"
    checkpoint.mkdir()
    save_file(shareable_tensors(weights()), str(checkpoint / "model.safetensors"))
    served: Served = await serve_fake(root=str(checkpoint))
    engine = VLLMEngine(served.url, weight_sync=FileWeightSync(tmp_path / "sync"), retry=FAST_RETRY)
    bad = {
        **weights(),
        "model.layers.0.self_attn.q_proj.weight": torch.zeros(3, 3),
        "model.bogus": torch.ones(1),
    }

    with pytest.raises(PushRefused) as caught:
        await engine.push_weights(bad, version=1)

    message = str(caught.value)
    assert "q_proj.weight: shape [3, 3], the served model's is [8, 8]" in message
    assert "model.bogus: not a weight of the served model" in message
    assert served.fake.routes() == ["GET /v1/models"]  # never paused, nothing reloaded
    assert await engine.push_weights(weights(), version=2) == 2  # a good push goes through
    assert served.fake.weight_version == "2"
    engine.close()


def test_checkpoint_shapes_adds_the_tied_head_and_ignores_a_hub_id(tiny_model_dir: Path) -> None:
    shapes = checkpoint_shapes(tiny_model_dir)
    assert shapes is not None
    assert shapes["lm_head.weight"] == shapes["model.embed_tokens.weight"]
    assert checkpoint_shapes("Qwen/Qwen2.5-0.5B-Instruct") is None


async def test_when_the_rollback_fails_too_the_engine_stays_paused(serve_fake, tmp_path) -> None:
    served: Served = await serve_fake(expected_shapes=SHAPES)
    engine = VLLMEngine(served.url, weight_sync=FileWeightSync(tmp_path), retry=FAST_RETRY)
    served.fake.fail["/collective_rpc"] = 500
    with pytest.raises(EngineUnavailable, match="rolling back to the previous weights failed too") as caught:
        await engine.push_weights(weights(), version=1)
    assert not isinstance(caught.value, PushRefused)
    assert served.fake.paused  # never resumed on weights nobody can vouch for
    engine.close()


def test_the_trainer_logs_the_weight_sync_it_chose(caplog: pytest.LogCaptureFixture, tmp_path) -> None:
    from harness_trainer.trainer.engine_link import weight_sync

    config = AsyncGRPOConfig(
        output_dir=str(tmp_path), vllm_server_base_url="http://127.0.0.1:9", weight_sync_dir=str(tmp_path)
    )
    with caplog.at_level(logging.WARNING):
        sync = weight_sync(config, config.vllm_server_base_url, "cpu")
    assert isinstance(sync, FileWeightSync)
    assert "weight sync to vLLM at http://127.0.0.1:9: file (auto: vLLM is on this host)" in caplog.text


async def test_a_staged_write_happens_before_the_pause_and_the_push_only_reloads_it(
    serve_fake, tmp_path
) -> None:
    served: Served = await serve_fake(expected_shapes=SHAPES)
    sync = FileWeightSync(tmp_path)
    engine = VLLMEngine(served.url, weight_sync=sync, retry=FAST_RETRY)

    await engine.stage_weights(weights(), version=5)
    staged = sync.run_dir / "v5"
    assert (staged / "model.safetensors").is_file()
    assert served.fake.routes() == ["GET /v1/models"]  # written while the engine still samples

    await engine.pause()
    await engine.push_weights(weights(), version=5)
    await engine.resume()
    assert served.fake.reloads == [str(staged)] and served.fake.weight_version == "5"

    await engine.stage_weights(weights(2.0), version=6)
    await engine.push_weights(weights(3.0), version=7)  # not the staged version: that file is dropped
    assert [p.name for p in sync.run_dir.iterdir()] == ["v7"]
    assert served.fake.weight_version == "7"
    engine.close()
