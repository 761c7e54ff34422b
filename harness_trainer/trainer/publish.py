"""Each new policy version pushed to the engine, and the rollouts told which one it serves.

Every rank takes part in a push (under FSDP the weights are gathered first); rank 0 alone talks to the
engine and to the session factories, and the other ranks learn its outcome. With ``lora_sync="adapter"``
each version is an adapter folder the engine loads under a served name of its own, and the factories send
the rollouts' later model calls there; otherwise the weights are replaced in place and the capture proxy
stamps each later call with the version it was sent at.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from harness_trainer.trainer.adapter_sync import AdapterFolders
from harness_trainer.trainer.config.async_grpo import AsyncGRPOConfig
from harness_trainer.trainer.distributed import Collective, engine_state
from harness_trainer.trainer.engine_link import push_with_retries


class WeightSyncError(RuntimeError):
    """The engine could not take the new weights after every retry; a checkpoint was written first."""


class PolicyPublisher:
    """Pushes the policy to the engine as a version, and tells the rollouts' factories what it serves.

    Args:
        engine: the engine client (rank 0; None on the other ranks).
        accelerator: accelerate's ``Accelerator`` the model was prepared with.
        collective: the ranks' control messages.
        adapter_folders: with ``lora_sync="adapter"`` (rank 0), where each version's adapter is written.
        retries: the attempts of each push (``weight_sync_retries``).
        output_dir: where ``checkpoint`` writes.
        checkpoint: writes the run's checkpoint (every rank), before a failed push is raised.
    """

    def __init__(
        self,
        engine: Any,
        accelerator: Any,
        collective: Collective,
        adapter_folders: AdapterFolders | None,
        *,
        retries: int,
        output_dir: Path,
        checkpoint: Callable[[], Any],
    ) -> None:
        self.engine = engine
        self.accelerator = accelerator
        self.collective = collective
        self.adapter_folders = adapter_folders
        self.retries = retries
        self.output_dir = output_dir
        self.checkpoint = checkpoint
        self.policy: tuple[str, int] | None = None
        """With ``lora_sync="adapter"``, rank 0: the served model and version of the newest adapter."""
        self.factory: Any = None  # rank 0: the factories attached, told of each version pushed
        self.eval_factory: Any = None

    def push(self, trained: nn.Module, model: nn.Module, version: int, step: int) -> int:
        """Pause the engine, push the weights of ``model`` (``trained`` as trained) as ``version``, resume,
        and tell the factories attached; the version served, on every rank. Retries, then stops.

        Raises:
            WeightSyncError: the engine did not take them after every retry (the run's checkpoint of
                ``step`` is written first).
        """
        if self.adapter_folders is not None:
            payload: Any = self.adapter_folders.save(model, version)
        else:
            payload = engine_state(self.accelerator, trained, model)
        served, error = (
            push_with_retries(self.engine, payload, version, self.retries)
            if payload is not None
            else (None, None)
        )
        if self.adapter_folders is not None:
            if served is None:
                self.adapter_folders.discard(payload)
            else:
                self.adapter_folders.served(payload)
                self.policy = (self.engine.adapter_name(served), served)
                publish_policy(self.factory, self.eval_factory, *self.policy)
        elif served is not None:
            publish_version(self.factory, served)
        served = self.collective.broadcast(served)
        if served is None:
            self.checkpoint()
            raise WeightSyncError(
                f"the engine did not take weights version {version} after {self.retries} attempts "
                f"({error or 'see rank 0'}); a checkpoint of step {step} is in {self.output_dir}"
            ) from error
        return served

    def attach(self, factory: Any, version: int) -> None:
        """Rank 0: tell the rollouts' factory, just made, what the engine serves now (an adapter pushed on
        resume, or ``version``), so its first rollouts' calls go there, stamped; and each later version."""
        self.factory = factory
        if self.policy is not None:
            publish_policy(factory, None, *self.policy)
        else:
            publish_version(factory, version)

    def attach_eval(self, eval_factory: Any) -> None:
        """Rank 0: send the eval factory, just made, to the adapter the engine serves (resumed on one), and
        to each later one."""
        self.eval_factory = eval_factory
        if self.policy is not None and hasattr(eval_factory, "set_policy"):
            eval_factory.set_policy(*self.policy)

    def close(self) -> None:
        """Forget the factories (closed) and remove the adapter folders written (the engine holds what it
        loaded)."""
        self.factory = self.eval_factory = None
        if self.adapter_folders is not None:
            self.adapter_folders.close()


def make_publisher(
    engine: Any,
    args: AsyncGRPOConfig,
    accelerator: Any,
    collective: Collective,
    *,
    adapter_sync: bool,
    output_dir: Path,
    checkpoint: Callable[[], Any],
) -> PolicyPublisher | None:
    """Every rank: the publisher of rank 0's ``engine`` (None when rank 0 has none, so nothing is pushed);
    with ``adapter_sync``, the engine's LoRA rank checked and the adapter folders made.

    Raises:
        ValueError: ``adapter_sync`` with several processes, or an engine that cannot load the adapter (no
            LoRA, or a ``--max-lora-rank`` below ``lora_r``).
    """
    pushes = collective.broadcast(engine is not None)
    adapter_folders = None
    if adapter_sync and engine is not None:
        if accelerator.num_processes > 1:
            raise ValueError("lora_sync='adapter' runs on one process; use lora_sync='merged' with FSDP")
        asyncio.run(engine.check_lora_rank(args.lora_r))
        adapter_folders = AdapterFolders(args.weight_sync_dir, keep=args.max_staleness + 1)
    if not pushes:
        return None
    return PolicyPublisher(
        engine, accelerator, collective, adapter_folders, retries=args.weight_sync_retries,
        output_dir=output_dir, checkpoint=checkpoint,
    )  # fmt: skip


def publish_policy(factory: Any, eval_factory: Any, model: str, version: int) -> None:
    """Send the rollouts' later model calls to served model ``model`` (``version``'s adapter).

    Raises:
        ValueError: ``factory`` has no ``set_policy``.
    """
    if factory is not None:
        if not hasattr(factory, "set_policy"):
            raise ValueError(
                f"lora_sync='adapter' needs a session factory with set_policy(model, version) to move "
                f"the rollouts to each new adapter; {type(factory).__name__} has none: use "
                "lora_sync='merged'"
            )
        factory.set_policy(model, version)
    # Evaluation samples the current policy too: its own factory (a white-box wrapper, an in-process
    # proxy) is told as well; on a shared rollout server the second call changes nothing.
    if eval_factory is not None and hasattr(eval_factory, "set_policy"):
        eval_factory.set_policy(model, version)


def publish_version(factory: Any, version: int) -> None:
    """Tell the rollouts' capture proxy that the engine now serves ``version`` (weights pushed in place,
    the served model unchanged), so it stamps each later model call with the version it was sent at. A
    factory without ``set_policy_version`` leaves the calls unstamped: staleness then counts from each
    rollout's start."""
    if factory is not None and hasattr(factory, "set_policy_version"):
        factory.set_policy_version(version)
