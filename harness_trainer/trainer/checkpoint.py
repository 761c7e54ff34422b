"""Checkpoints of a training run: everything the loop needs to continue exactly where it stopped.

Layout of ``output_dir/checkpoint-{step}/``::

    model/              save_pretrained (safetensors): the full model, or only the adapter of a PeftModel
    optimizer.pt        optimizer.state_dict()
    scheduler.pt        scheduler.state_dict()
    rng_state.pt        python, numpy, torch CPU (and CUDA, where there is one) RNG states
    trainer_state.json  step, data position, policy version, extra (human readable)

A checkpoint is written into a hidden temporary sibling, fsynced, then renamed into place, and deleted by
renaming it away before removing it, so a crash at any moment never leaves a ``checkpoint-{step}`` folder
that looks complete but is not; :func:`latest_checkpoint` also skips any folder that misses a part.
Loading restores the weights in place (the model is already built, and the optimizer holds its
parameters) after checking that every tensor of the checkpoint fits the model, so a mismatch changes
nothing. One process writes to an ``output_dir`` at a time.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from torch import nn

logger = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "checkpoint-"
FORMAT_VERSION = 1
MODEL_DIR = "model"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng_state.pt"
STATE_FILE = "trainer_state.json"
REQUIRED_FILES = (OPTIMIZER_FILE, SCHEDULER_FILE, RNG_FILE, STATE_FILE)
# Hidden siblings: a save in progress, and a checkpoint on its way out. Never mistaken for checkpoints.
_TMP_PREFIX = ".checkpoint-tmp-"
_TRASH_PREFIX = ".checkpoint-trash-"
_CHECKPOINT_RE = re.compile(rf"^{re.escape(CHECKPOINT_PREFIX)}(\d+)$")


@dataclass
class TrainerState:
    """What the loop needs, besides weights and optimizer, to continue where it stopped."""

    step: int
    """Optimizer steps done."""
    groups_consumed: int
    """Dataset position: rollout groups trained or dropped so far, in admission order."""
    policy_version: int
    """Weight version served by the engine."""
    rng: dict[str, Any] = field(default_factory=dict)
    """RNG states: captured by :func:`save_checkpoint` (what the caller puts here is not saved), filled
    by :func:`load_checkpoint` with the states it restored."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form and JSON-serialisable (config snapshot, counters)."""


def save_checkpoint(
    output_dir: str | os.PathLike[str],
    state: TrainerState,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    *,
    save_total_limit: int | None = None,
) -> Path:
    """Write ``output_dir/checkpoint-{state.step}`` atomically and return its path.

    A checkpoint of the same step already there is replaced. With ``save_total_limit``, the oldest
    checkpoints (by step) beyond that many are deleted; the one just written is always kept.

    Raises:
        ValueError: ``save_total_limit`` is below 1.
        TypeError: ``state.extra`` is not JSON-serialisable (raised before anything is written).
    """
    if save_total_limit is not None and save_total_limit < 1:
        raise ValueError(f"save_total_limit must be at least 1, got {save_total_limit}")
    output_dir = Path(output_dir)
    payload = {
        "format_version": FORMAT_VERSION,
        "step": state.step,
        "groups_consumed": state.groups_consumed,
        "policy_version": state.policy_version,
        "adapter_only": _is_peft(model),
        "extra": state.extra,
    }
    state_json = json.dumps(payload, indent=2) + "\n"
    rng = _capture_rng()
    output_dir.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(output_dir)

    final = output_dir / f"{CHECKPOINT_PREFIX}{state.step}"
    # mkdir rather than mkdtemp: the checkpoint keeps the umask's permissions, not mkdtemp's 0700.
    staging = output_dir / f"{_TMP_PREFIX}{state.step}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        _save_model(model, staging / MODEL_DIR)
        torch.save(optimizer.state_dict(), staging / OPTIMIZER_FILE)
        torch.save(scheduler.state_dict(), staging / SCHEDULER_FILE)
        torch.save(rng, staging / RNG_FILE)
        (staging / STATE_FILE).write_text(state_json)
        _fsync_tree(staging)
        if final.exists():
            _delete(final)
        staging.rename(final)
        _fsync_dir(output_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if save_total_limit is not None:
        older = sorted((p for p in _checkpoint_dirs(output_dir) if p != final), key=_step_of)
        for path in older[: max(0, len(older) + 1 - save_total_limit)]:
            _delete(path)
    return final


def latest_checkpoint(output_dir: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint of the highest step in ``output_dir``, or None if there is none."""
    complete = [p for p in _checkpoint_dirs(Path(output_dir)) if not missing_parts(p)]
    return max(complete, key=_step_of, default=None)


def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> TrainerState:
    """Restore weights (in place), optimizer, scheduler and RNG states from ``path``; return its state.

    Raises:
        ValueError: the checkpoint is incomplete, holds a full model where the model is a PeftModel (or
            the other way round), its tensors do not match the model (missing or unexpected keys, other
            shapes), or its optimizer state does not fit the optimizer.
    """
    path = Path(path)
    missing = missing_parts(path)
    if missing:
        raise ValueError(f"checkpoint {path} is incomplete: missing {', '.join(missing)}")
    payload = json.loads((path / STATE_FILE).read_text())
    if payload["adapter_only"] != _is_peft(model):
        held = "a LoRA adapter" if payload["adapter_only"] else "a full model"
        given = "a PeftModel" if _is_peft(model) else "not a PeftModel"
        raise ValueError(f"checkpoint {path} holds {held} but the model to restore is {given}")

    if payload["adapter_only"]:
        _load_adapters(path / MODEL_DIR, model)
    else:
        _load_full_model(path / MODEL_DIR, model)
    try:
        optimizer.load_state_dict(torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True))
    except ValueError as exc:
        raise ValueError(f"{path / OPTIMIZER_FILE} does not fit the optimizer: {exc}") from exc
    scheduler.load_state_dict(torch.load(path / SCHEDULER_FILE, weights_only=True))
    rng = torch.load(path / RNG_FILE, weights_only=True)
    _restore_rng(rng)
    return TrainerState(
        step=payload["step"],
        groups_consumed=payload["groups_consumed"],
        policy_version=payload["policy_version"],
        rng=rng,
        extra=payload["extra"],
    )


def resolve_resume(
    resume_from_checkpoint: bool | str | os.PathLike[str] | None, output_dir: str | os.PathLike[str]
) -> Path | None:
    """The checkpoint to resume from: None for a fresh start.

    ``True`` or ``"latest"`` mean the newest complete checkpoint in ``output_dir``; a path means that
    checkpoint folder; ``None`` or ``False`` mean none.

    Raises:
        FileNotFoundError: ``True``/``"latest"`` and ``output_dir`` holds no complete checkpoint, or the
            path given does not exist.
        ValueError: the path given is an incomplete checkpoint.
    """
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True or resume_from_checkpoint == "latest":
        found = latest_checkpoint(output_dir)
        if found is None:
            raise FileNotFoundError(
                f"resume_from_checkpoint asks for the latest checkpoint, but {output_dir} holds no complete "
                f"{CHECKPOINT_PREFIX}N folder"
            )
        return found
    path = Path(resume_from_checkpoint)
    if not path.is_dir():
        raise FileNotFoundError(f"resume_from_checkpoint: no checkpoint folder at {path}")
    missing = missing_parts(path)
    if missing:
        raise ValueError(f"resume_from_checkpoint: {path} is incomplete: missing {', '.join(missing)}")
    return path


def missing_parts(path: Path) -> list[str]:
    """The parts a complete checkpoint has that ``path`` lacks (empty for a complete one)."""
    missing = [name for name in REQUIRED_FILES if not (path / name).is_file()]
    if not any((path / MODEL_DIR).glob("*.safetensors")):
        missing.append(f"{MODEL_DIR}/*.safetensors")
    return missing


def _save_model(model: nn.Module, model_dir: Path) -> None:
    if _is_peft(model):
        model.save_pretrained(model_dir)
    else:
        # The keys as the model names them in memory (transformers 5 would otherwise revert its weight
        # conversions for some architectures), so loading copies them back one to one.
        model.save_pretrained(model_dir, save_original_format=False)


def _is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # without peft installed, no model can be a PeftModel
        return False
    return isinstance(model, PeftModel)


def _load_full_model(model_dir: Path, model: nn.Module) -> None:
    targets = model.state_dict()
    shapes = _safetensors_shapes(model_dir.glob("*.safetensors"))
    # save_pretrained writes tied weights (lm_head tied to the embeddings) once: a key the file lacks is
    # fine when it shares storage with a key the file has.
    storage = {k: t.untyped_storage().data_ptr() for k, t in targets.items()}
    present = {storage[k] for k in shapes if k in storage}
    missing = [k for k in targets if k not in shapes and storage[k] not in present]
    _check_fit(model_dir, shapes, {k: tuple(t.shape) for k, t in targets.items()}, missing)
    with torch.no_grad():
        for file in model_dir.glob("*.safetensors"):
            with safe_open(file, framework="pt") as tensors:
                for key in tensors.keys():
                    targets[key].copy_(tensors.get_tensor(key))


def _load_adapters(model_dir: Path, model: nn.Module) -> None:
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    for name in model.peft_config:
        # PeftModel.save_pretrained puts the "default" adapter at the top and any other in a subfolder.
        adapter_dir = model_dir if name == "default" else model_dir / name
        files = list(adapter_dir.glob("*.safetensors"))
        expected = get_peft_model_state_dict(model, adapter_name=name)
        shapes = _safetensors_shapes(files)
        _check_fit(adapter_dir, shapes, {k: tuple(t.shape) for k, t in expected.items()})
        tensors = {k: v for file in files for k, v in load_file(file).items()}
        set_peft_model_state_dict(model, tensors, adapter_name=name)


def _safetensors_shapes(files: Any) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(file, framework="pt") as tensors:
            for key in tensors.keys():
                shapes[key] = tuple(tensors.get_slice(key).get_shape())
    return shapes


def _check_fit(
    where: Path,
    found: dict[str, tuple[int, ...]],
    expected: dict[str, tuple[int, ...]],
    missing: list[str] | None = None,
) -> None:
    """Raise one ValueError naming every way the tensors ``found`` in ``where`` do not fit the model."""
    missing = [k for k in expected if k not in found] if missing is None else missing
    unexpected = [k for k in found if k not in expected]
    mismatched = [f"{k}: {found[k]} vs {expected[k]}" for k in found if expected.get(k, found[k]) != found[k]]
    problems = [
        f"{label} ({len(keys)}): {', '.join(keys[:5])}{' …' if len(keys) > 5 else ''}"
        for label, keys in (
            ("missing keys", missing),
            ("unexpected keys", unexpected),
            ("shape mismatches (checkpoint vs model)", mismatched),
        )
        if keys
    ]
    if problems:
        raise ValueError(f"checkpoint weights in {where} do not match the model: " + "; ".join(problems))


def _capture_rng() -> dict[str, Any]:
    np_state = np.random.get_state(legacy=False)
    rng: dict[str, Any] = {
        "python": random.getstate(),
        # Plain ints instead of a numpy array, so the file loads with weights_only=True.
        "numpy": {**np_state, "state": {**np_state["state"], "key": np_state["state"]["key"].tolist()}},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def _restore_rng(rng: dict[str, Any]) -> None:
    random.setstate(rng["python"])
    np_state = rng["numpy"]
    key = np.asarray(np_state["state"]["key"], dtype=np.uint32)
    np.random.set_state({**np_state, "state": {**np_state["state"], "key": key}})
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng:
        if not torch.cuda.is_available():
            logger.warning("checkpoint has CUDA RNG states but there is no CUDA device: not restored")
            return
        if len(rng["cuda"]) != torch.cuda.device_count():
            logger.warning(
                "checkpoint has CUDA RNG states of %d devices, this process sees %d: restoring those it has",
                len(rng["cuda"]),
                torch.cuda.device_count(),
            )
        for device, state in enumerate(rng["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, device)


def _checkpoint_dirs(output_dir: Path) -> list[Path]:
    if not output_dir.is_dir():
        return []
    return [p for p in output_dir.iterdir() if p.is_dir() and _CHECKPOINT_RE.match(p.name)]


def _step_of(path: Path) -> int:
    return int(path.name.removeprefix(CHECKPOINT_PREFIX))


def _delete(path: Path) -> None:
    # Renamed away first: a crash during rmtree then leaves a hidden folder, never a half checkpoint.
    trash = Path(tempfile.mkdtemp(prefix=_TRASH_PREFIX, dir=path.parent))
    path.rename(trash / path.name)
    shutil.rmtree(trash)


def _remove_leftovers(output_dir: Path) -> None:
    """Remove what an earlier process left when it was killed mid-save or mid-delete."""
    for path in output_dir.iterdir():
        if path.is_dir() and path.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
            shutil.rmtree(path, ignore_errors=True)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
