"""Room for the weights a run writes for vLLM to read, checked before the run spends anything: torch-free.

Two pushes go through a folder on this host, both made under :func:`weights_parent` (``weight_sync_dir``,
else ``/dev/shm`` when writable, else the temp dir):

- the ``file`` weight sync (:class:`~harness_trainer.engines.weight_sync.FileWeightSync`): each version is
  one safetensors file holding every name of the trainer's state dict in the trainer's dtype, a tied
  ``lm_head.weight`` as its own copy; the version vLLM serves stays on disk (the rollback point) while the
  next is written, so each vLLM pushed to by file holds two versions at once;
- the LoRA adapter sync (:class:`~harness_trainer.trainer.adapter_sync.AdapterFolders`): one folder per
  version, the newest ``keep`` kept while the next is saved; peft keeps the adapter in float32.

A small ``/dev/shm`` (Docker's default is 64 MiB) otherwise fails the first or second push deep in a run
(``ENOSPC``); :func:`check_room` fails at start instead, naming the folder, its free space, the need and
how it was computed. The sizes come from the model's safetensors headers
(:func:`~harness_trainer.engines.weight_sync.checkpoint_shapes`, the names a push is checked against):
no weight is read.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

SHARED_MEMORY = Path("/dev/shm")
MIB = 1 << 20
VERSION_ALLOWANCE = MIB
"""Added per version or folder for what is not tensor data: the safetensors header, an adapter's
``adapter_config.json`` and ``README.md``."""
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
ADAPTER_VALUE_BYTES = 4
"""peft's ``get_peft_model`` keeps LoRA weights in float32 (``autocast_adapter_dtype``), whatever the base."""


class NoRoomForWeights(ValueError):
    """The folder a run's weight pushes go through has less free space than they need (one line: the
    folder, its free space, the need and how it was computed, what to do)."""


def weights_parent(directory: str | Path | None) -> Path:
    """The folder a run's weight or adapter folders are made in: ``directory``, else ``/dev/shm`` when it is
    a writable folder, else the system temp dir (what ``tempfile.mkdtemp`` uses for ``dir=None``)."""
    if directory is not None:
        return Path(directory)
    if SHARED_MEMORY.is_dir() and os.access(SHARED_MEMORY, os.W_OK):
        return SHARED_MEMORY
    return Path(tempfile.gettempdir())


def local_model_folder(model: str | Path) -> Path | None:
    """``model``'s folder of safetensors on this machine: ``model`` itself when it is a folder, else its
    snapshot in the Hugging Face cache; None when neither holds every shard. Never reaches the network."""
    folder = Path(model).expanduser()
    if not folder.is_dir():
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(str(model), "config.json")
        except ValueError:  # not a repo id (HFValidationError)
            return None
        if not isinstance(cached, str):
            return None
        folder = Path(cached).parent
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set((json.loads(index.read_text()).get("weight_map") or {}).values())
        except (OSError, ValueError):
            return None
        if not shards or not all((folder / shard).is_file() for shard in shards):
            return None  # a partial download: its headers would undercount
    return folder if any(folder.glob("*.safetensors")) else None


def served_model_root(base_url: str, timeout_s: float = 10.0) -> str | None:
    """What vLLM at ``base_url`` loaded at start (``root`` of its first ``GET /v1/models`` card, as
    :meth:`~harness_trainer.engines.vllm.VLLMEngine._served_model_root` reads it); None when it does not
    say."""
    url = base_url.rstrip("/").removesuffix("/v1") + "/v1/models"
    try:
        cards = httpx.get(url, timeout=timeout_s).json().get("data") or []
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    root = cards[0].get("root") if cards and isinstance(cards[0], dict) else None
    return str(root) if root else None


def pushed_dtype(dtype: str, model_folder: Path) -> str:
    """The dtype pushed tensors have (a key of :data:`DTYPE_BYTES`): ``dtype``, or for ``"auto"`` the model
    config's own (``dtype``, else ``torch_dtype``, as transformers loads it); float32, the widest a policy is
    trained in, when neither names one this module knows."""
    name = str(dtype).removeprefix("torch.")
    if name == "auto":
        try:
            config = json.loads((model_folder / "config.json").read_text())
        except (OSError, ValueError):
            config = {}
        name = str(config.get("dtype") or config.get("torch_dtype")) if isinstance(config, dict) else ""
    return name if name in DTYPE_BYTES else "float32"


@dataclass(frozen=True)
class WeightsNeed:
    """What one kind of push writes into one folder at most, and why."""

    path: str
    """Which push: ``"the file weight sync"`` or ``"the LoRA adapter sync"``."""
    folder: Path
    """Where its folders are made (:func:`weights_parent`)."""
    bytes: int
    how: str
    """How :attr:`bytes` was computed, for the message."""
    remedies: tuple[str, ...] = ()
    """What else the run could do, besides a larger folder (the caller knows which apply)."""


def full_weights_need(
    model_folder: Path, dtype: str, *, versions: int, folder: Path, remedies: Sequence[str] = ()
) -> WeightsNeed:
    """The ``file`` weight sync's need: ``versions`` files at once (two per vLLM pushed to by file), each
    every tensor of the checkpoint at ``model_folder`` (a tied head counted apart) × ``dtype``'s size."""
    from harness_trainer.engines.weight_sync import checkpoint_shapes  # loads torch

    shapes = checkpoint_shapes(model_folder) or {}
    values = sum(math.prod(shape) for shape in shapes.values())
    name = pushed_dtype(dtype, model_folder)
    each = values * DTYPE_BYTES[name] + VERSION_ALLOWANCE
    tied = ", lm_head.weight written apart from the tied embeddings" if _tied(model_folder) else ""
    how = (
        f"{versions} versions at once (per vLLM, the one it serves kept for rollback and the next one) × "
        f"{_mib(each)} each ({values:,} values × {DTYPE_BYTES[name]} bytes ({name}){tied}, + 1 MiB header)"
    )
    return WeightsNeed("the file weight sync", folder, versions * each, how, tuple(remedies))


def adapter_need(
    model_folder: Path, rank: int, targets: Sequence[str], *, folders: int, folder: Path
) -> WeightsNeed:
    """The LoRA adapter sync's need: ``folders`` adapter folders at once, each ``rank × (in + out)`` float32
    values per weight of a module ``targets`` names (peft's match: the module's name, or its last parts)."""
    from harness_trainer.engines.weight_sync import checkpoint_shapes  # loads torch

    shapes = checkpoint_shapes(model_folder) or {}
    adapted = [
        shape
        for name, shape in shapes.items()
        if name.endswith(".weight") and len(shape) == 2 and _targeted(name.removesuffix(".weight"), targets)
    ]
    values = sum(rank * (rows + cols) for rows, cols in adapted)
    each = values * ADAPTER_VALUE_BYTES + VERSION_ALLOWANCE
    how = (
        f"{folders} adapter folders at once (the max_staleness + 1 vLLM may still serve and the next one) × "
        f"{_mib(each)} each ({len(adapted)} adapted weights, {values:,} values of rank {rank} × "
        f"{ADAPTER_VALUE_BYTES} bytes (float32), + 1 MiB for the files beside them)"
    )
    return WeightsNeed("the LoRA adapter sync", folder, folders * each, how)


def check_room(need: WeightsNeed) -> str:
    """What was checked, on one line, when ``need.folder`` (or, not made yet, the folder it would be made
    in) has ``need.bytes`` free.

    Raises:
        NoRoomForWeights: it has less; the message names the folder, both sizes, how the need was computed
            and what to do.
    """
    free = shutil.disk_usage(_existing(need.folder)).free
    if free >= need.bytes:
        return f"{need.path} writes to {need.folder}: {_mib(need.bytes)} needed, {_mib(free)} free"
    remedies = [
        "--weight-sync-dir (weight_sync_dir) on a tmpfs or disk with more room, at a path vLLM reads too"
    ]
    if need.folder == SHARED_MEMORY or SHARED_MEMORY in need.folder.parents:
        size = math.ceil(need.bytes / (1 << 30)) + 1
        remedies.append(f"more shared memory in a container (docker run --shm-size={size}g, or --ipc=host)")
    remedies.extend(need.remedies)
    listed = remedies[0] if len(remedies) == 1 else f"{', '.join(remedies[:-1])}, or {remedies[-1]}"
    raise NoRoomForWeights(
        f"{need.path} writes to {need.folder}, which has {_mib(free)} free, but this run needs "
        f"{_mib(need.bytes)} there: {need.how}; use {listed}"
    )


def _existing(folder: Path) -> Path:
    """``folder``, or its nearest ancestor that exists (the run makes the rest)."""
    folder = folder.absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def _targeted(module: str, targets: Sequence[str]) -> bool:
    return any(module == target or module.endswith(f".{target}") for target in targets)


def _tied(model_folder: Path) -> bool:
    try:
        return bool(json.loads((model_folder / "config.json").read_text()).get("tie_word_embeddings"))
    except (OSError, ValueError, AttributeError):
        return False


def _mib(size: int) -> str:
    return f"{size / MIB:,.1f} MiB"
