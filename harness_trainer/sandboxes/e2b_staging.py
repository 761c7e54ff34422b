"""The build context of an E2B template that carries agents: E2B's SDK copies files into a template only
from the template's context folder, so a template with agent bundles is built from a staging folder holding
the environment's files and the bundles (:mod:`.e2b_templates`)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harness_trainer.sandboxes.e2b_templates import TemplateSpec

AGENTS_IN_CONTEXT = ".harness-trainer-agents"
"""Where a staging context holds the bundles (beside the environment's files)."""


def staging_context(spec: TemplateSpec, folder: Path) -> Path:
    """``folder`` made the build context of a template with agents: the environment's files and each
    bundle under :data:`AGENTS_IN_CONTEXT` (hard links where the filesystem allows, else copies; a pip
    bundle's host-made venvs left out). Made anew each time."""
    shutil.rmtree(folder, ignore_errors=True)
    if spec.context.is_dir():
        shutil.copytree(spec.context, folder, symlinks=True, copy_function=_link_or_copy)
    for agent in spec.agents:
        shutil.copytree(
            agent.host_dir, folder / AGENTS_IN_CONTEXT / agent.name, symlinks=True,
            copy_function=_link_or_copy, ignore=shutil.ignore_patterns("venvs", "*.lock"),
        )  # fmt: skip
    return folder


def _link_or_copy(source: str, dest: str) -> None:
    try:
        os.link(source, dest)
    except OSError:  # another filesystem
        shutil.copy2(source, dest)
