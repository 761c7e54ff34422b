"""The trained policy as others load it: ``save_model``'s folder, and its upload to the Hugging Face Hub.

The folder (``trainer.save_model(output_dir)``; by default ``args.output_dir``, as in TRL) holds one model
that ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load, and vLLM serves:

- a full model: ``config.json``, ``generation_config.json`` (where the model has one) and
  ``model.safetensors`` (or shards and ``model.safetensors.index.json``), under the original checkpoint's
  names (``save_pretrained``'s default; the checkpoints' ``model/`` keep the in-memory names instead);
- a LoRA policy, ``lora_save="adapter"`` (the default, as PEFT and TRL): peft's ``adapter_config.json``
  (naming the base model) and ``adapter_model.safetensors``, and peft's ``README.md``: load it with
  ``PeftModel.from_pretrained(base, folder)`` (or ``AutoModelForCausalLM.from_pretrained(folder)`` with peft
  installed), serve it with ``vllm serve BASE --enable-lora --lora-modules NAME=folder``;
  ``lora_save="merged"``: the full model with the adapter merged in (the weights the engine gets with
  ``lora_sync="merged"``), written as a full model above: ``vllm serve folder``, no LoRA flags;
- the tokenizer and its chat template (``tokenizer.json``, ``tokenizer_config.json``,
  ``chat_template.jinja``, …), whatever its ``save_pretrained`` writes.

The files are written into a hidden staging folder inside it, then moved into place; the model files of an
earlier save that this one did not write (another shard count, an adapter where a full model is now) are
removed, so the folder never holds two models. Nothing else in it is touched (checkpoints, metrics.jsonl,
rollouts.jsonl).

The Hub, through ``huggingface_hub.HfApi`` (:func:`hf_api`; tests put a fake there) and on rank 0 only:
``create_repo(exist_ok=True)`` (and ``create_branch`` for a revision), then ``upload_folder`` of exactly
the files the save wrote: not the run's checkpoints, metrics or rollouts (transformers uploads the whole
``output_dir`` but its checkpoints). huggingface_hub's errors become :class:`HubError` here, once.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MODEL_FILES = (
    "*.safetensors",
    "*.safetensors.index.json",
    "*.bin",
    "config.json",
    "generation_config.json",
    "adapter_config.json",
)
"""The files of a model (not its tokenizer) that a save removes when it did not write them itself."""
_STAGING_PREFIX = ".save-model-tmp-"


class HubError(RuntimeError):
    """The model cannot be pushed to the Hub (no token, a refused repository) or its upload failed."""


def write_model_folder(model: Any, tokenizer: Any, folder: str | os.PathLike[str]) -> list[str]:
    """Save ``model`` and ``tokenizer`` (each with ``save_pretrained``) into ``folder``; the files written,
    relative to it, sorted. See the module docstring for what they are."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for leftover in folder.glob(f"{_STAGING_PREFIX}*"):  # a save killed midway
        shutil.rmtree(leftover, ignore_errors=True)
    staging = folder / f"{_STAGING_PREFIX}{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        written = sorted(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file())
        for old in folder.iterdir():
            if old.is_file() and old.name not in written and _is_model_file(old.name):
                old.unlink()
        for name in written:
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / name, folder / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return written


def _is_model_file(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in MODEL_FILES)


def tokenizer_source(model: Any) -> str | None:
    """Where the tokenizer of ``model`` (a path / Hub id, or a transformers model) is: the path or id, or
    the folder the module was loaded from; None when it names none."""
    if isinstance(model, str | os.PathLike):
        return str(model)
    return getattr(model, "name_or_path", None) or None


def resolve_token(token: str | None) -> str:
    """``token``, else huggingface_hub's (``HF_TOKEN``, then the one ``hf auth login`` stored).

    Raises:
        HubError: there is none.
    """
    from huggingface_hub import get_token

    found = token or get_token()
    if not found:
        raise HubError(
            "pushing to the Hub needs a token with write access, and none was found: set HF_TOKEN, run "
            "`hf auth login`, or set hub_token"
        )
    return found


def hf_api() -> Any:
    """The ``HfApi`` every Hub call goes through."""
    from huggingface_hub import HfApi

    return HfApi()


def create_repo(name: str, *, token: str, private: bool | None, revision: str | None) -> str:
    """Create the model repository ``name`` unless it exists (and branch ``revision`` from main unless it
    exists); its full id (``namespace/name``).

    Raises:
        HubError: the Hub refused or could not be reached.
    """
    api = hf_api()
    try:
        repo_id = api.create_repo(name, token=token, private=private, exist_ok=True).repo_id
        if revision is not None:
            api.create_branch(repo_id, branch=revision, token=token, exist_ok=True)
    except _hub_errors() as exc:
        raise HubError(f"could not create or open the Hub repository {name!r}: {exc}") from exc
    return repo_id


def upload(
    repo_id: str,
    folder: Path,
    files: list[str],
    *,
    token: str,
    revision: str | None,
    commit_message: str | None,
    blocking: bool = True,
) -> Any:
    """Upload ``files`` of ``folder`` to ``repo_id`` in one commit: huggingface_hub's ``CommitInfo``, or
    with ``blocking=False`` a ``Future`` of it.

    Raises:
        HubError: the upload failed (the model stays in ``folder``).
    """
    try:
        return hf_api().upload_folder(
            repo_id=repo_id, folder_path=folder, allow_patterns=files, commit_message=commit_message,
            token=token, revision=revision, run_as_future=not blocking,
        )  # fmt: skip
    except _hub_errors() as exc:
        raise HubError(
            f"uploading {folder} to the Hub repository {repo_id} failed: {exc}; the model stays there: push "
            f"it again with trainer.push_to_hub(), or `hf upload {repo_id} {folder}`"
        ) from exc


def _hub_errors() -> tuple[type[BaseException], ...]:
    # HfHubHTTPError and OfflineModeIsEnabled are OSErrors; HTTPError is the HTTP client's own (a connection
    # that failed), HFValidationError a repository id or revision the Hub's rules refuse.
    from huggingface_hub.errors import HFValidationError, HTTPError

    return (OSError, HTTPError, HFValidationError)
