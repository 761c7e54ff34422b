"""Where a task's verifier runs, as Harbor reads ``[verifier] environment_mode``: in the agent's sandbox
(``shared``, the default) or in one of its own (``separate``), for the task and for each step of a
multi-step task (``[steps.verifier]``; a step without its own mode takes the task's).

Harbor's rules, kept here: a ``[verifier.environment]`` table implies ``separate``; ``shared`` with such a
table is refused; ``separate`` without one runs the verifier in a fresh sandbox of the task's own
environment, with the tests copied in; a tests folder holding a Dockerfile (a step's ``tests/`` first,
then the task's) defines the verifier's image instead, and that image holds ``/tests`` itself. A separate
verifier sees of the agent's work only its artifacts: ``/logs/artifacts``, the task's top-level
``artifacts`` and a step's own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from harness_trainer.tasks.task import ARTIFACTS_DIR, EnvironmentSpec, SeparateVerifier, TaskError

ParseEnvironment = Callable[[dict[str, Any], str], EnvironmentSpec]


def artifacts_of(table: dict[str, Any], where: str) -> list[str]:
    """A table's ``artifacts``: absolute paths.

    Raises:
        TaskError: anything else.
    """
    artifacts = table.get("artifacts", [])
    if not isinstance(artifacts, list) or not all(isinstance(a, str) and a[:1] == "/" for a in artifacts):
        raise TaskError(f"{where} artifacts: expected a list of absolute paths, got {artifacts!r}")
    return artifacts


def image_folder(folder: Path, *candidates: str) -> str | None:
    """The first of ``candidates`` (folders of the task) that holds a Dockerfile."""
    return next((c for c in candidates if (folder / c / "Dockerfile").is_file()), None)


def separate_verifier(
    verifier: dict[str, Any],
    where: str,
    *,
    environment: EnvironmentSpec,
    artifacts: Sequence[str],
    image: str | None,
    parse_environment: ParseEnvironment,
    inherited: SeparateVerifier | None = None,
    section: str = "verifier",
) -> SeparateVerifier | None:
    """The separate verifier that ``verifier`` (a ``[verifier]`` or ``[steps.verifier]`` table) asks for,
    or None for a shared one; a step's table without a mode takes ``inherited`` (the task's).

    Raises:
        TaskError: a mode Harbor does not know, ``shared`` with an environment table, a table that is not one.
    """
    mode, table = verifier.get("environment_mode"), verifier.get("environment")
    if mode not in (None, "shared", "separate"):
        raise TaskError(f"{where} [{section}] environment_mode: expected shared or separate, got {mode!r}")
    if mode == "shared" and table is not None:
        raise TaskError(
            f'{where} [{section}]: environment_mode = "shared" with a [{section}.environment] (a shared '
            "verifier runs in the agent's sandbox: drop one of them)"
        )
    if table is not None and not isinstance(table, dict):
        raise TaskError(f"{where} [{section}.environment]: expected a table, got {table!r}")
    if mode == "shared" or (mode is None and table is None and inherited is None):
        return None
    if table is not None:
        environment = parse_environment(table, f"{where} [{section}.environment]")
    elif inherited is not None:
        environment = inherited.environment
    return SeparateVerifier(
        environment=environment,
        artifacts=tuple(dict.fromkeys([ARTIFACTS_DIR, *artifacts])),
        image_folder=image if image is not None or inherited is None else inherited.image_folder,
    )
