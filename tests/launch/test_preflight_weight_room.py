"""The weight-room check: the folder the ``file`` weight sync (or the LoRA adapter sync) writes to has room
for what a run writes there, checked at preflight and when the trainer builds its engine client.

Every folder here is a real tmpfs of a chosen size (``mount -t tmpfs``, root only: skipped elsewhere), and
the sizing is held against what :class:`FileWeightSync` and :class:`AdapterFolders` really write into it:
where the check passes the writes fit, and where the writes do not fit the check fails.
"""

from __future__ import annotations

import contextlib
import logging
import math
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from harness_trainer.engines.weight_room import (
    NoRoomForWeights,
    adapter_need,
    check_room,
    full_weights_need,
    weights_parent,
)
from harness_trainer.engines.weight_sync import FileWeightSync
from harness_trainer.launch.preflight import PreflightError, PreflightOptions, run_preflight
from harness_trainer.trainer.adapter_sync import AdapterFolders
from harness_trainer.trainer.config.async_grpo import AsyncGRPOConfig
from harness_trainer.trainer.engine_link import check_weight_room, engine_client
from tests.engines.fake_vllm_control import FakeVLLM
from tests.launch.fakes import FakeEngine, FakeRolloutServer, serving

PAGE = 4096
MIB = 1 << 20
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


@contextlib.contextmanager
def tmpfs(where: Path, size: int) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes (rounded up to a page) mounted at ``where``; unmounted on exit."""
    where.mkdir(parents=True, exist_ok=True)
    size = math.ceil(size / PAGE) * PAGE
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (root only): {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def policy_weights(model_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What the trainer pushes for the model at ``model_dir`` loaded in ``dtype``."""
    from transformers import AutoModelForCausalLM

    from harness_trainer.trainer.policy import engine_weights

    return engine_weights(AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype))


def write_two_versions(folder: Path, weights: dict[str, torch.Tensor]) -> list[int]:
    """Push twice by file as a run does (the first version served, kept while the second is written);
    the sizes of the files written."""
    sync = FileWeightSync(folder)
    try:
        first = sync.write(weights, 1)
        sync.committed(first)
        second = sync.write(weights, 2)
        return [(version / "model.safetensors").stat().st_size for version in (first, second)]
    finally:
        sync.close()


@pytest.mark.parametrize(("dtype", "item"), [("float32", 4), ("bfloat16", 2)])
def test_the_file_sync_need_holds_what_two_pushes_write_and_no_less(
    dtype: str, item: int, tiny_model_dir: Path, tmp_path: Path
) -> None:
    weights = policy_weights(tiny_model_dir, getattr(torch, dtype))
    values = sum(t.numel() for t in weights.values())
    need = full_weights_need(tiny_model_dir, dtype, versions=2, folder=tmp_path / "shm")
    assert need.bytes == 2 * (values * item + MIB)  # the tied lm_head counted: the state dict names it
    assert f"{values:,} values × {item} bytes ({dtype})" in need.how

    with tmpfs(tmp_path / "shm", need.bytes):
        assert check_room(need).startswith(f"the file weight sync writes to {tmp_path / 'shm'}: ")
        sizes = write_two_versions(tmp_path / "shm", weights)  # fits: no error
    assert all(values * item < size < values * item + MIB for size in sizes)

    # A folder one MiB short of two files: the check refuses it, and the second push would not fit.
    with tmpfs(tmp_path / "shm", 2 * sizes[0] - MIB):
        with pytest.raises(NoRoomForWeights):
            check_room(need)
        with pytest.raises(Exception, match="No space left on device"):
            write_two_versions(tmp_path / "shm", weights)


def test_a_small_dev_shm_is_refused_with_the_folder_the_sizes_and_the_remedies(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No weight_sync_dir: the default folder, resolved by the rule the syncs make their folders by.
    shm = tmp_path / "shm"
    monkeypatch.setattr("harness_trainer.engines.weight_room.SHARED_MEMORY", shm)
    config = AsyncGRPOConfig(output_dir=str(tmp_path / "out"), vllm_server_base_url="http://127.0.0.1:9")
    with tmpfs(shm, 8 * MIB):
        assert FileWeightSync(None).run_dir.parent == shm
        assert AdapterFolders(None).run_dir.parent == shm
        with pytest.raises(NoRoomForWeights) as refused:
            check_weight_room(config, "vllm", adapter_sync=False, model=str(tiny_model_dir))
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"the file weight sync writes to {shm}, which has 8.0 MiB free, but this run ")
    assert "needs 42.0 MiB there: 2 versions at once" in message
    assert "× 21.0 MiB each (5,247,232 values × 4 bytes (float32), lm_head.weight written apart" in message
    assert "--weight-sync-dir (weight_sync_dir) on a tmpfs or disk with more room" in message
    assert "docker run --shm-size=2g, or --ipc=host" in message
    assert "--weight-sync nccl with the trainer and vLLM on different GPUs" in message


def test_each_vllm_pushed_to_by_file_keeps_its_own_two_versions(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"), vllm_server_base_url="http://127.0.0.1:9",
        vllm_replica_urls=["http://127.0.0.1:10"], weight_sync_dir=str(tmp_path / "shm"),
        use_peft=True, lora_sync="merged", dtype="bfloat16",
    )  # fmt: skip
    with tmpfs(tmp_path / "shm", 30 * MIB), pytest.raises(NoRoomForWeights) as refused:
        check_weight_room(config, "vllm", adapter_sync=False, model=str(tiny_model_dir))
    assert "needs 44.0 MiB there: 4 versions at once" in str(refused.value)  # 4 × (10.0 + 1) MiB
    assert "--lora-sync adapter, which writes the LoRA adapter alone" in str(refused.value)
    assert "docker" not in str(refused.value)  # not /dev/shm


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_adapter_sync_needs_the_kept_adapters_only(
    dtype: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"), vllm_server_base_url="http://127.0.0.1:9", use_peft=True,
        lora_r=16, lora_target_modules=TARGETS, max_staleness=1, weight_sync_dir=str(tmp_path / "shm"),
        dtype=dtype,
    )  # fmt: skip
    need = adapter_need(tiny_model_dir, 16, TARGETS, folders=3, folder=tmp_path / "shm")
    full = full_weights_need(tiny_model_dir, dtype, versions=2, folder=tmp_path / "shm")
    assert need.bytes < full.bytes / 4
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=getattr(torch, dtype))
    model = get_peft_model(
        base, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, task_type="CAUSAL_LM")
    )
    values = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert f"{values:,} values of rank 16 × 4 bytes (float32)" in need.how

    with tmpfs(tmp_path / "shm", need.bytes):
        line = check_weight_room(config, "vllm", adapter_sync=True, model=str(tiny_model_dir))
        assert line is not None and line.startswith("the LoRA adapter sync writes to ")
        folders = AdapterFolders(config.weight_sync_dir, keep=config.max_staleness + 1)
        for version in (1, 2, 3):  # the third is saved while the two kept are still there
            folder = folders.save(model, version)
            adapter = folder / "adapter_model.safetensors"
            assert values * 4 < adapter.stat().st_size < values * 4 + MIB  # float32 whatever the base
            folders.served(folder)
        folders.close()

    with tmpfs(tmp_path / "shm", 2 * MIB), pytest.raises(NoRoomForWeights) as refused:
        check_weight_room(config, "vllm", adapter_sync=True, model=str(tiny_model_dir))
    assert "the LoRA adapter sync writes to" in str(refused.value)
    assert "3 adapter folders at once" in str(refused.value) and "nccl" not in str(refused.value)


def test_no_folder_is_checked_when_no_push_goes_through_one(tmp_path: Path) -> None:
    elsewhere = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"), vllm_server_base_url="http://192.0.2.1:8000",  # not this host
        weight_sync_dir=str(tmp_path / "shm"),
    )  # fmt: skip
    forced = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"), vllm_server_base_url="http://127.0.0.1:9", weight_sync="nccl",
        weight_sync_dir=str(tmp_path / "shm"),
    )  # fmt: skip
    with tmpfs(tmp_path / "shm", PAGE):
        # 'auto' resolves to NCCL for a vLLM on another host: nothing sized, nothing asked of vLLM.
        assert check_weight_room(elsewhere, "vllm", adapter_sync=False) is None
        assert check_weight_room(forced, "vllm", adapter_sync=False) is None
        assert check_weight_room(forced, "dev", adapter_sync=False) is None  # weights in the HTTP body
        assert check_weight_room(forced, "none", adapter_sync=True) is None


def preflight(
    model: Path, config_dir: str, tmp_path: Path, engine_url: str, server_url: str
) -> PreflightOptions:
    config = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"), vllm_server_base_url=engine_url, weight_sync_dir=config_dir
    )
    return PreflightOptions(
        engine_url=engine_url, server_url=server_url, model=str(model), harness="toy", sandbox="local",
        output_dir=tmp_path / "out", trainer_config=config, skip_probes=True,  # the fake engine only says
    )  # fmt: skip


def test_preflight_refuses_a_folder_too_small_and_reports_one_big_enough(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    engine, server = FakeEngine(kind="vllm"), FakeRolloutServer()
    shm = tmp_path / "shm"
    with serving(engine.app()) as engine_url, serving(server.app()) as server_url:
        options = preflight(tiny_model_dir, str(shm), tmp_path, engine_url, server_url)
        with tmpfs(shm, 8 * MIB), pytest.raises(PreflightError) as refused:
            run_preflight(options)
        assert server.requests == []  # refused before the rollout server is asked anything
        with tmpfs(shm, 64 * MIB):
            report = run_preflight(options)
    assert str(refused.value).startswith(f"the file weight sync writes to {shm}, which has 8.0 MiB free")
    assert "this run needs 42.0 MiB there" in str(refused.value)
    assert report.summary(options).endswith(
        f"; the file weight sync writes to {shm}: 42.0 MiB needed, 64.0 MiB free"
    )


def test_the_trainer_checks_the_room_for_the_model_vllm_serves_before_any_push(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeVLLM(root=str(tiny_model_dir))
    shm = tmp_path / "shm"
    with serving(fake.app()) as url:
        config = AsyncGRPOConfig(
            output_dir=str(tmp_path / "out"),
            vllm_server_base_url=url,
            engine="vllm",
            weight_sync_dir=str(shm),
        )
        with tmpfs(shm, 8 * MIB), pytest.raises(NoRoomForWeights, match=r"which has 8\.0 MiB free"):
            engine_client(config, adapter_sync=False, device="cpu")
        with tmpfs(shm, 64 * MIB), caplog.at_level(logging.WARNING):
            engine_client(config, adapter_sync=False, device="cpu").close()
    assert f"the file weight sync writes to {shm}: 42.0 MiB needed, 64.0 MiB free" in caplog.text
    assert [call.route for call in fake.calls] == ["GET /v1/models", "GET /v1/models"]


def test_a_served_model_not_on_this_machine_is_said_to_be_not_checked(tmp_path: Path) -> None:
    with serving(FakeVLLM(root="/models/nowhere").app()) as url:
        config = AsyncGRPOConfig(output_dir=str(tmp_path / "out"), vllm_server_base_url=url)
        line = check_weight_room(config, "vllm", adapter_sync=False)
    assert line == (
        f"room in {weights_parent(None)} for the weight pushes not checked: the model vLLM serves is not a "
        "local folder of safetensors or complete in the Hugging Face cache"
    )
