"""The weight-transport seam under :class:`~harness_trainer.engines.vllm.VLLMEngine`, and its NCCL backend.

vLLM receives weights out of band: its HTTP routes carry only the rendezvous (``init_info``) and the
metadata of a push (``update_info``), while the tensors themselves travel over a transport the trainer
drives. :class:`WeightTransport` is that trainer side, in four blocking calls:

1. ``init_info(engine_world_size)`` -> the JSON ``init_info`` for ``POST /init_weight_transfer_engine``;
2. ``connect()`` -> join the group as rank 0; blocks until the engine's workers join, so the caller runs it
   *concurrently* with the HTTP call that makes them join;
3. ``update_info(named_tensors)`` -> the JSON ``update_info`` for ``POST /update_weights``, describing
   exactly what ``send`` streams, in the same order;
4. ``send(named_tensors)`` -> stream the tensors; blocks until every receiver has them, and again runs
   concurrently with the HTTP call (vLLM's ``/update_weights`` returns only once the receive is done).

``close()`` drops the group. :class:`NcclTransport` is the real backend: vLLM's
``StatelessProcessGroup`` + ``PyNcclCommunicator`` rendezvous opened by vLLM's own ``trainer_init``
helper, then one NCCL broadcast per tensor from rank 0 (or vLLM's packed producer). It imports vLLM and
CUDA only when connected, so this module imports anywhere; without them ``connect`` raises
:class:`WeightTransportError` saying what is missing. Tests substitute a fake with the same five methods.

Payload shapes follow vLLM's ``NCCLWeightTransferInitInfo`` / ``NCCLWeightTransferUpdateInfo``
(``vllm/distributed/weight_transfer/nccl_engine.py`` and ``nccl_common.py``, 0.22 - 0.32) and
TRL 1.16's ``trl/experimental/async_grpo/weight_transfer.py``: ``init_info = {master_address,
master_port, rank_offset: 1, world_size: engine world size + 1}`` (the trainer is rank 0, the engine's
workers follow), ``update_info = {names, dtype_names, shapes}`` with dtypes spelled as torch attribute
names (``"bfloat16"``), which is how vLLM reads them back (``getattr(torch, dtype_name)``).
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch


class WeightTransportError(RuntimeError):
    """The weight transport cannot be used here (no vLLM, no CUDA) or was used out of order."""


@runtime_checkable
class WeightTransport(Protocol):
    """The trainer's end of an out-of-band weight channel to vLLM's workers (blocking calls)."""

    def init_info(self, engine_world_size: int) -> dict[str, Any]:
        """The ``init_info`` for ``/init_weight_transfer_engine``, for an engine of that many workers."""

    def connect(self) -> None:
        """Join the group announced by the last ``init_info``; returns once every worker has joined."""

    def update_info(self, named_tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """The ``update_info`` for ``/update_weights`` that describes ``send(named_tensors)``."""

    def send(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        """Stream ``named_tensors`` in order; returns once every receiver has them."""

    def close(self) -> None:
        """Drop the group (idempotent); a later ``init_info`` + ``connect`` opens a new one."""


def torch_dtype_name(dtype: torch.dtype) -> str:
    """A dtype as vLLM spells it in ``dtype_names``: the ``torch`` attribute name (``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def nccl_update_info(named_tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """vLLM's NCCL ``update_info``: parallel lists of names, dtype names and shapes, in iteration order."""
    return {
        "names": list(named_tensors),
        "dtype_names": [torch_dtype_name(t.dtype) for t in named_tensors.values()],
        "shapes": [list(t.shape) for t in named_tensors.values()],
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _outbound_address() -> str:
    """This host's address on the default route, which is what a remote engine can reach us at."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            # A UDP connect sends nothing; it only makes the kernel pick the outgoing interface.
            sock.connect(("10.255.255.255", 1))
            return sock.getsockname()[0]
        except OSError:
            return "127.0.0.1"


class NcclTransport:
    """Weights to vLLM by NCCL broadcast from this process (rank 0) on ``device``.

    Args:
        device: CUDA device the trainer's tensors are sent from (tensors elsewhere are copied there first).
            Must not be a GPU the engine uses: NCCL refuses two ranks on one device.
        master_address: where the engine's workers reach this process's rendezvous store; defaults to the
            address of the interface on the default route (``127.0.0.1`` when there is none).
        master_port: rendezvous port; 0 picks a free one at each ``init_info``.
        packed: batch tensors into fixed-size buffers with vLLM's packed producer (fewer, larger
            broadcasts). The flag travels in ``init_info``, where vLLM reads it since 0.28; leave it off
            for older servers, which expect it per update.
    """

    def __init__(
        self,
        device: torch.device | str | int = "cuda",
        *,
        master_address: str | None = None,
        master_port: int = 0,
        packed: bool = False,
    ) -> None:
        self._device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        self._master_address = master_address
        self._master_port = master_port
        self._packed = packed
        self._pending: dict[str, Any] | None = None
        self._group: Any = None

    def init_info(self, engine_world_size: int) -> dict[str, Any]:
        info: dict[str, Any] = {
            "master_address": self._master_address or _outbound_address(),
            "master_port": self._master_port or _free_port(),
            "rank_offset": 1,
            "world_size": engine_world_size + 1,
        }
        if self._packed:
            info["packed"] = True
        self._pending = info
        return info

    def connect(self) -> None:
        if self._pending is None:
            raise WeightTransportError("NcclTransport.connect() before init_info(): no group to join")
        if not torch.cuda.is_available():
            raise WeightTransportError(
                "NCCL weight transfer needs a CUDA device in the trainer process; none is visible "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda})"
            )
        trainer_init = _vllm_trainer_init()
        if self._device.index is None:
            self._device = torch.device("cuda", torch.cuda.current_device())
        # vLLM's helper opens the communicator on the *current* device.
        with torch.cuda.device(self._device):
            self._group = trainer_init(self._pending)

    def update_info(self, named_tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        return nccl_update_info(named_tensors)

    def send(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        if self._group is None:
            raise WeightTransportError("NcclTransport.send() before connect(): no group to send on")
        # The current device is per thread, and send() runs on a helper thread: pin it, or the
        # broadcasts would go out on device 0's stream.
        with torch.cuda.device(self._device):
            tensors = ((name, self._on_device(t)) for name, t in named_tensors.items())
            if self._packed:
                from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

                packed_nccl_broadcast_producer(
                    iterator=tensors, group=self._group, src=0, post_iter_func=lambda item: item[1]
                )
            else:
                stream = torch.cuda.current_stream()
                for _name, tensor in tensors:
                    self._group.broadcast(tensor, src=0, stream=stream)
            # Broadcasts are only queued on the stream; "sent" means the receivers have the bytes.
            torch.cuda.synchronize(self._device)

    def close(self) -> None:
        self._group = None
        self._pending = None

    def _on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        # NCCL reads numel() elements from data_ptr(): the tensor must be dense and on our device.
        return tensor.detach().to(self._device).contiguous()


def _vllm_trainer_init() -> Any:
    """vLLM's trainer-side rendezvous helper (rank 0), from wherever this vLLM version keeps it."""
    try:
        # vLLM >= 0.28 (vllm-project/vllm#50902) moved it out of the engine class.
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        return trainer_init
    except ImportError:
        pass
    try:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
    except ImportError as exc:
        raise WeightTransportError(
            "NCCL weight transfer needs vllm (>= 0.22) installed in the trainer process: "
            "pip install 'harness-trainer[vllm]'"
        ) from exc
    return NCCLWeightTransferEngine.trainer_init
