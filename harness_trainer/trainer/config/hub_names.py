"""The Hub repository a run pushes to, as TRL / transformers name it, and why a name cannot be one.

Pure naming rules, here so the config can refuse a bad name at construction; the push itself is
:mod:`harness_trainer.trainer.export`'s.
"""

from __future__ import annotations

from pathlib import Path


def repo_name(hub_model_id: str | None, output_dir: str) -> str:
    """The repository a push goes to, as TRL / transformers name it: ``hub_model_id``, else the name of
    ``output_dir``'s folder (in the token's namespace)."""
    return hub_model_id if hub_model_id is not None else Path(output_dir).absolute().name


def repo_name_problem(hub_model_id: str | None, output_dir: str) -> str | None:
    """Why :func:`repo_name` is no valid Hub repository id, or None."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    name = repo_name(hub_model_id, output_dir)
    try:
        validate_repo_id(name)
    except HFValidationError as exc:
        source = "hub_model_id" if hub_model_id is not None else f"output_dir's folder name ({output_dir!r})"
        return f"the Hub repository {name!r} ({source}) is not a valid repository id: {exc}; set hub_model_id"
    return None
