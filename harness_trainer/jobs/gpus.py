"""How a machine's GPUs are shared between vLLM and the trainer. Pure, but for :func:`attention_heads`.

The contract (:func:`split_gpus`): vLLM gets ``k`` GPUs, used by one server either tensor parallel
(``--tensor-parallel-size k``) or data parallel (``--data-parallel-size k``, vLLM's own flags); the trainer
gets its own GPUs, one rank each. Both sets are non-empty, disjoint and on the machine; a tensor-parallel
size must divide the model's attention heads when its config can be read without the network. With one
trainer GPU the trainer is one plain process; with several it runs under ``accelerate launch``, sharded
with FSDP2 (:data:`FSDP2_LAUNCH_FLAGS`), or replicated with DDP when it trains LoRA, which the trainer
refuses under accelerate's FSDP on GPUs (:func:`harness_trainer.trainer.distributed.prepare`; the
trainer's own FSDP2 on CPU supports it, :mod:`harness_trainer.trainer.fsdp2`).

The launch examples in ``examples/launch/`` (torchrun, which has no FSDP flags of its own) set
:data:`FSDP2_ENV`, the environment that ``accelerate launch`` sets for those flags and that
``Accelerator()`` reads.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from harness_trainer.jobs.process_supervisor import LaunchError

VllmParallel = Literal["tensor", "data"]
VLLM_PARALLEL_FLAGS: dict[str, str] = {"tensor": "--tensor-parallel-size", "data": "--data-parallel-size"}
"""vLLM's flag for each way of using several GPUs."""
TRAINER_MODULE = "harness_trainer.jobs.trainer_entry"
"""The trainer launcher as a runnable module: what ``accelerate launch -m`` and ``torchrun -m`` run."""
FSDP2_LAUNCH_FLAGS = (
    "--use_fsdp",
    "--fsdp_version",
    "2",
    "--fsdp_auto_wrap_policy",
    "TRANSFORMER_BASED_WRAP",
)
"""``accelerate launch``'s flags for FSDP2, one shard unit per transformer layer (the model's
``_no_split_modules``)."""
FSDP2_ENV = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
}
"""What :data:`FSDP2_LAUNCH_FLAGS` put in each rank's environment, for launchers without them (torchrun)."""
DDP_LAUNCH_FLAGS = ("--multi_gpu",)
_GPU_SUFFIX = re.compile(r"x(\d+)$")


class GpuSplitError(LaunchError):
    """A GPU split that cannot work; the message names the option and the GPUs."""


class GpuSplit(BaseModel):
    """Which GPUs (CUDA ids on the machine) vLLM and the trainer get, and how each uses them."""

    model_config = ConfigDict(extra="forbid")

    total: int
    """GPUs on the machine."""
    vllm: list[int]
    vllm_parallel: VllmParallel
    trainer: list[int]
    trainer_sharding: Literal["none", "fsdp2", "ddp"]
    """``none``: one process; otherwise one rank per trainer GPU under ``accelerate launch``."""
    idle: list[int]
    heads_check: str
    """Whether the tensor-parallel size was checked against the model's attention heads, and how."""
    summary: str
    """The split in one line, as the dry run shows it."""

    def vllm_args(self) -> list[str]:
        """vLLM's parallelism flags: none for one GPU."""
        return [VLLM_PARALLEL_FLAGS[self.vllm_parallel], str(len(self.vllm))] if len(self.vllm) > 1 else []

    def launch_args(self) -> list[str]:
        """``accelerate launch``'s flags for the trainer's ranks (empty for one process)."""
        if self.trainer_sharding == "none":
            return []
        flags = FSDP2_LAUNCH_FLAGS if self.trainer_sharding == "fsdp2" else DDP_LAUNCH_FLAGS
        return ["--num_processes", str(len(self.trainer)), "--num_machines", "1", *flags]


def flavor_gpus(flavor: str) -> int:
    """GPUs of a Hugging Face Jobs flavor, read from its name as the Hub spells them (``JobHardware``):
    ``cpu-*`` none, ``…xN`` N (``h200x8``, ``a10g-largex2``, ``l4x1``), any other GPU flavor one
    (``h200``, ``a100-large``, ``t4-small``)."""
    if flavor.startswith("cpu-"):
        return 0
    suffix = _GPU_SUFFIX.search(flavor)
    return int(suffix.group(1)) if suffix else 1


def parse_gpu_list(text: str, option: str) -> list[int]:
    """``"0,1,2"`` as CUDA ids, in order; raises GpuSplitError for a non-number or a repeated id."""
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise GpuSplitError(f"{option} {text!r}: expected comma-separated GPU numbers, e.g. 0,1") from None
    repeated = sorted({gpu for gpu in ids if ids.count(gpu) > 1})
    if repeated or any(gpu < 0 for gpu in ids):
        raise GpuSplitError(f"{option} {text!r}: each GPU once, numbered from 0")
    return ids


def split_gpus(
    total: int,
    *,
    vllm_gpus: str | None = None,
    trainer_gpus: str | None = None,
    vllm_gpu_count: int | None = None,
    parallel: VllmParallel = "tensor",
    lora: bool = False,
    heads: int | None = None,
    model: str = "the model",
) -> GpuSplit:
    """The split of ``total`` GPUs. vLLM gets ``vllm_gpus`` (a CUDA id list), else the first
    ``vllm_gpu_count`` (default 1); the trainer gets ``trainer_gpus``, else every GPU vLLM does not.
    ``heads``: the model's attention heads, None when unknown (the split then says it was not checked).

    Raises:
        GpuSplitError: fewer than 2 GPUs; an empty side; a count of 0 or one leaving the trainer none; an
            id off the machine or on both sides; a tensor-parallel size that does not divide ``heads``.
    """
    if total < 2:
        raise GpuSplitError(f"vLLM and the trainer need a GPU each: this machine has {total} (at least 2)")
    if vllm_gpus is not None and vllm_gpu_count is not None:
        raise GpuSplitError("give --vllm-gpus or --vllm-gpu-count, not both")
    if vllm_gpus is not None:
        vllm = parse_gpu_list(vllm_gpus, "--vllm-gpus")
    else:
        count = 1 if vllm_gpu_count is None else vllm_gpu_count
        if not 0 < count < total:
            raise GpuSplitError(
                f"--vllm-gpu-count {count}: vLLM needs at least 1 of the {total} GPUs and the trainer the "
                f"rest, so 1 to {total - 1}"
            )
        vllm = list(range(count))
    if trainer_gpus is not None:
        trainer = parse_gpu_list(trainer_gpus, "--trainer-gpus")
    else:
        trainer = [gpu for gpu in range(total) if gpu not in vllm]
    for option, gpus in (("--vllm-gpus", vllm), ("--trainer-gpus", trainer)):
        if not gpus:
            raise GpuSplitError(f"{option}: empty; vLLM and the trainer need at least one GPU each")
        off = [gpu for gpu in gpus if gpu >= total]
        if off:
            raise GpuSplitError(
                f"{option}: GPU {off[0]} is not on this machine, which has {total} (0 to {total - 1})"
            )
    shared = [gpu for gpu in vllm if gpu in trainer]
    if shared:
        raise GpuSplitError(f"--vllm-gpus and --trainer-gpus share GPU {', '.join(map(str, shared))}")
    heads_check = _check_heads(len(vllm), parallel, heads, model)
    sharding = "none" if len(trainer) == 1 else "ddp" if lora else "fsdp2"
    idle = [gpu for gpu in range(total) if gpu not in vllm and gpu not in trainer]
    return GpuSplit(
        total=total,
        vllm=vllm,
        vllm_parallel=parallel,
        trainer=trainer,
        trainer_sharding=sharding,
        idle=idle,
        heads_check=heads_check,
        summary=_summary(total, vllm, parallel, trainer, sharding, idle),
    )


def _check_heads(size: int, parallel: VllmParallel, heads: int | None, model: str) -> str:
    if size == 1 or parallel == "data":
        return "no tensor parallelism: nothing to check"
    if heads is None:
        return (
            f"not checked: {model}'s config.json is not a local folder's nor in the Hugging Face cache "
            f"(vLLM refuses a tensor-parallel size {size} that does not divide its attention heads)"
        )
    if heads % size:
        raise GpuSplitError(
            f"--vllm-gpus: tensor-parallel size {size} does not divide {model}'s {heads} attention heads; "
            f"use a divisor of {heads}, or --vllm-data-parallel"
        )
    return f"tensor-parallel size {size} divides {model}'s {heads} attention heads"


def _summary(
    total: int, vllm: list[int], parallel: str, trainer: list[int], sharding: str, idle: list[int]
) -> str:
    how = f", {parallel} parallel {len(vllm)}" if len(vllm) > 1 else ""
    ranks = "1 process" if sharding == "none" else f"{len(trainer)} ranks, {sharding.upper()}"
    text = f"{total} GPUs: vLLM on {_ids(vllm)}{how}; trainer on {_ids(trainer)} ({ranks})"
    return text + (f"; idle {_ids(idle)}" if idle else "")


def _ids(gpus: list[int]) -> str:
    return ("GPU " if len(gpus) == 1 else "GPUs ") + ",".join(map(str, gpus))


def attention_heads(model: str, cache_dir: str | Path | None = None) -> int | None:
    """``num_attention_heads`` of ``model`` (its ``text_config``'s for a multimodal config), read from
    ``model/config.json`` when ``model`` is a local folder, else from the Hugging Face cache (``cache_dir``,
    default the hub's); None when neither has a readable one. Never reaches the network."""
    path = Path(model).expanduser() / "config.json"
    if not path.is_file():
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(model, "config.json", cache_dir=cache_dir)
        except ValueError:  # not a repo id (HFValidationError): nothing cached under it
            return None
        if not isinstance(cached, str):  # None, or the cache's record that the file does not exist
            return None
        path = Path(cached)
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    for section in (config, config.get("text_config") or {}):
        heads = section.get("num_attention_heads")
        if isinstance(heads, int) and heads > 0:
            return heads
    return None
