"""What the trainer writes of the policy: its checkpoints, the model folder of ``save_model`` and the Hub
repository ``push_to_hub`` uploads that folder to.

Every rank calls these (under FSDP the weights are gathered); rank 0 alone writes and talks to the Hub.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from harness_trainer.trainer.checkpoint import TrainerState, save_checkpoint
from harness_trainer.trainer.config.async_grpo import AsyncGRPOConfig
from harness_trainer.trainer.config.hub_names import repo_name
from harness_trainer.trainer.distributed import (
    Collective,
    GatheredModel,
    checkpoint_parts,
    engine_state,
    savable_model,
)
from harness_trainer.trainer.export import (
    HubError,
    create_repo,
    resolve_token,
    tokenizer_source,
    write_model_folder,
)
from harness_trainer.trainer.feed.coverage import Coverage
from harness_trainer.trainer.feed.curriculum import PassRateCurriculum
from harness_trainer.trainer.feed.load_poller import ConcurrencyPoller
from harness_trainer.trainer.policy import is_peft


def write_checkpoint(
    accelerator: Any,
    collective: Collective,
    trained: nn.Module,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any,
    *,
    state: TrainerState,
    output_dir: Path,
    args: AsyncGRPOConfig,
    counters: dict[str, int],
    model_source: Any,
    curriculum: PassRateCurriculum | None,
    poller: ConcurrencyPoller | None,
    coverage: Coverage | None = None,
) -> Path | None:
    """Write ``checkpoint-{step}`` on rank 0 (every rank takes part: FSDP gathers); its path there.

    ``state.extra`` takes the config, ``counters``, the model's source (what ``harness-trainer eval`` takes
    a tokenizer from), the curriculum's state, the concurrency limit and the harness coverage.
    """
    path = output_dir / f"checkpoint-{state.step}"
    if collective.broadcast(collective.is_main and path.exists()):
        return path if collective.is_main else None
    state.extra = {"config": args.to_dict(), "counters": dict(counters)}
    if isinstance(model_source, str | Path):
        state.extra["model"] = str(model_source)
    if curriculum is not None:
        state.extra["curriculum"] = curriculum.state_dict(state.groups_consumed)
    if poller is not None:  # rank 0 only, which alone writes the state
        state.extra["concurrency_limit"] = poller.limit
    if coverage is not None and coverage.tasks:
        state.extra["coverage"] = coverage.state_dict()
    model_part, optimizer_part = checkpoint_parts(accelerator, trained, model, optimizer)
    if not collective.is_main:
        return None
    return save_checkpoint(
        output_dir, state, model_part, optimizer_part, lr_scheduler, save_total_limit=args.save_total_limit
    )


def save_model_folder(
    accelerator: Any,
    collective: Collective,
    trained: nn.Module,
    model: nn.Module,
    folder: Path,
    *,
    merged: bool,
    tokenizer: Callable[[], Any],
) -> tuple[Path, list[str]] | None:
    """Save ``model`` (``trained`` as trained) and the ``tokenizer()`` into ``folder`` for
    ``from_pretrained`` and vLLM; a LoRA model as its adapter, or ``merged`` as the engine's merged
    weights. Rank 0: the folder and the files written; None elsewhere."""
    if is_peft(model) and merged:
        weights = engine_state(accelerator, trained, model)  # the engine's merged weights
        saved = GatheredModel(model.get_base_model(), weights) if weights is not None else None
    else:
        saved = savable_model(accelerator, trained, model)
    if not collective.is_main:
        return None
    return folder, write_model_folder(saved, tokenizer(), folder)


def open_hub_repo(
    collective: Collective,
    args: AsyncGRPOConfig,
    *,
    token: str | None,
    private: bool | None,
    revision: str | None,
    tokenizer: Callable[[], Any],
) -> tuple[str, str] | None:
    """Rank 0: the token, the tokenizer, the repository ``hub_model_id`` (default: ``output_dir``'s folder
    name), created if missing: its id and the token; None on the other ranks. A failure on rank 0 is
    raised on every rank (they would wait for it)."""
    found: tuple[str, str] | None = None
    error: Exception | None = None
    if collective.is_main:
        # Any failure here must reach the other ranks, or they wait for rank 0 in the next collective.
        try:
            found_token = resolve_token(token)
            tokenizer()
            name = repo_name(args.hub_model_id, str(args.output_dir))
            found = create_repo(name, token=found_token, private=private, revision=revision), found_token
        except Exception as exc:
            error = exc
    failed = collective.broadcast(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if failed is not None:
        raise HubError(f"rank 0 could not open the Hub repository: {failed}")
    return found


def load_tokenizer(model_source: Any) -> Any:
    """The tokenizer of ``model_source`` (a folder, a Hub id, or a module that names one).

    Raises:
        ValueError: the module names no folder or Hub id.
    """
    source = tokenizer_source(model_source)
    if source is None:
        raise ValueError(
            "save_model writes the tokenizer beside the model, and the model was given as a module "
            "that names no folder or Hub id (name_or_path): pass processing_class= to the trainer"
        )
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)
