"""Parse one Harbor task folder into a :class:`HarborTask`, without importing ``harbor``.

Contract:

- ``task.toml`` is read with :mod:`tomllib` (schema 1.x). Known keys are type-checked: ``[agent]
  timeout_sec`` (default 600 s) and ``[verifier] timeout_sec`` (default 120 s) are positive numbers,
  ``[verifier] env`` a table of strings, ``[environment]`` holds ``docker_image`` (string), ``cpus``,
  ``build_timeout_sec`` (numbers), ``memory_mb``, ``storage_mb`` (integers; or the older ``memory =
  "2G"``, ``storage = "10G"``, read in megabytes), ``allow_internet`` (bool), ``workdir`` (an absolute
  path). The whole file stays in ``HarborTask.config`` and other ``[environment]`` keys in
  ``EnvironmentSpec.extra``.
- What no backend here can run (multi-step tasks, a separate verifier sandbox, docker-compose, GPUs…) is a
  :class:`TaskError` naming the field; what a rollout ignores is logged once per field with the reason
  (:mod:`.fields`): nothing is dropped silently.
- The name is ``[task].name``, else ``[metadata].name``, else the folder's name.
- ``instruction.md`` is kept verbatim (the prompt is exactly its text) and must not be blank.
- ``tests/test.sh`` must exist; ``solution/solve.sh`` is optional.
- A multi-step task (``[[steps]]``, :mod:`.steps`): each step's ``name`` is a folder ``steps/<name>`` with
  an ``instruction.md`` and a ``test.sh`` in its ``tests/`` or the task's; ``[steps.agent]`` and
  ``[steps.verifier]`` are checked as the task's and fall back to them; ``min_reward`` is a number or a
  table of numbers, ``contributes_to_mean`` a bool (not false for every step);
  ``multi_step_reward_strategy`` is ``mean`` (the default) or ``final``. The task's own instruction.md and
  tests/ are then optional.
- Anything else raises :class:`TaskError` naming the file and what is wrong with it.
"""

from __future__ import annotations

import logging
import re
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any

from harness_trainer.tasks.compose import ComposeError, ComposeSpec, compose_file, read_compose
from harness_trainer.tasks.fields import ignored, refusals
from harness_trainer.tasks.steps import REWARD_STRATEGIES, RewardStrategy, TaskStep
from harness_trainer.tasks.task import EnvironmentSpec, HarborTask, SeparateVerifier, TaskError
from harness_trainer.tasks.verifier_mode import artifacts_of, image_folder, separate_verifier

log = logging.getLogger(__name__)
_logged: set[str] = set()  # the ignored fields already logged by this process

DEFAULT_AGENT_TIMEOUT_SEC = 600.0
DEFAULT_VERIFIER_TIMEOUT_SEC = 120.0

_ENVIRONMENT_KEYS = {
    "workdir",
    "docker_image",
    "cpus",
    "memory_mb",
    "storage_mb",
    "memory",
    "storage",
    "allow_internet",
    "build_timeout_sec",
}
_STEP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_SIZE_UNITS_MB = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}
"""Docker's size suffixes (powers of 1024, as ``docker run --memory 2g``), in megabytes."""


def load_task(path: str | Path, *, split: str = "", index: int = 0) -> HarborTask:
    """Load the task in folder ``path``; ``split`` and ``index`` say where a source found it.

    Raises:
        TaskError: the folder, ``task.toml``, ``instruction.md`` or ``tests/test.sh`` is missing or
            unusable; the message names the file and the problem.
    """
    folder = Path(path).expanduser().resolve()
    if not folder.is_dir():
        raise TaskError(f"{folder}: no such task folder")
    toml_path = folder / "task.toml"
    config = _read_toml(toml_path)
    agent = _table(config, "agent", toml_path)
    verifier = _table(config, "verifier", toml_path)
    where = str(toml_path)
    refused = refusals(config, folder)
    if refused:
        raise TaskError(f"{toml_path}: cannot be run here: " + "; ".join(refused))
    agent_timeout = _positive(agent, "timeout_sec", f"{where} [agent]", DEFAULT_AGENT_TIMEOUT_SEC)
    verifier_timeout = _positive(verifier, "timeout_sec", f"{where} [verifier]", DEFAULT_VERIFIER_TIMEOUT_SEC)
    verifier_env = _string_table(verifier, "env", f"{where} [verifier]")
    environment = _environment(_table(config, "environment", toml_path), f"{where} [environment]")
    compose, environment = _compose(folder, environment)
    task_artifacts = artifacts_of(config, where)
    separate = separate_verifier(
        verifier, where, environment=environment, artifacts=task_artifacts, parse_environment=_environment,
        image=image_folder(folder, "tests"),
    )  # fmt: skip
    steps = _steps(config, folder, agent_timeout, verifier_timeout, verifier_env, environment, separate)
    if steps and not (folder / "instruction.md").is_file():
        instruction = steps[0].instruction
    else:
        instruction = _read_instruction(folder / "instruction.md")
    if not steps and not (folder / "tests" / "test.sh").is_file():
        raise TaskError(f"{folder / 'tests' / 'test.sh'}: missing (every task needs a verifier script)")
    for name, reason in ignored(config, frozenset(_ENVIRONMENT_KEYS)).items():
        if name not in _logged:
            _logged.add(name)
            log.warning("%s: %s is ignored: %s (not logged again for other tasks)", folder.name, name, reason)
    return HarborTask(
        name=_task_name(config, folder, toml_path),
        path=folder,
        instruction=instruction,
        config=config,
        agent_timeout_sec=agent_timeout,
        verifier_timeout_sec=verifier_timeout,
        environment=environment,
        split=split,
        index=index,
        verifier_env=verifier_env,
        steps=steps,
        reward_strategy=_strategy(config, where) if steps else "mean",
        separate_verifier=separate,
        compose=compose,
    )


def _compose(folder: Path, environment: EnvironmentSpec) -> tuple[ComposeSpec | None, EnvironmentSpec]:
    """The environment's compose file, read (its ignored keys logged once), and the environment with
    ``main``'s ``image`` as its ``docker_image`` where the task has no Dockerfile of its own."""
    path = compose_file(folder / "environment")
    if path is None:
        return None, environment
    try:
        spec = read_compose(path)
    except ComposeError as exc:
        raise TaskError(f"cannot be run here: {exc}") from exc
    for key, reason in spec.ignored.items():
        if f"compose {key}" not in _logged:
            _logged.add(f"compose {key}")
            log.warning("%s: %s: %s is ignored: %s (not logged again)", folder.name, path.name, key, reason)
    if not (folder / "environment" / "Dockerfile").is_file() and environment.docker_image is None:
        if spec.main.image is None:
            raise TaskError(
                f"{path}: cannot be run here: service main has no image and the task no Dockerfile"
            )
        environment = replace(environment, docker_image=spec.main.image)
    return spec, environment


def _steps(
    config: dict[str, Any],
    folder: Path,
    agent_timeout: float,
    verifier_timeout: float,
    env: dict[str, str],
    environment: EnvironmentSpec,
    separate: SeparateVerifier | None,
) -> tuple[TaskStep, ...]:
    tables = config.get("steps", [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise TaskError(f"{folder / 'task.toml'} steps: expected [[steps]] tables, got {tables!r}")
    steps: list[TaskStep] = []
    for number, table in enumerate(tables, 1):
        where = f"{folder / 'task.toml'} [[steps]] #{number}"
        name = table.get("name")
        if not isinstance(name, str) or not _STEP_NAME.fullmatch(name):
            raise TaskError(f"{where} name: expected a folder name (letters, digits, . _ -), got {name!r}")
        if name in (step.name for step in steps):
            raise TaskError(f"{where} name: {name!r} is the name of an earlier step too")
        path = folder / "steps" / name
        instruction = _read_instruction(path / "instruction.md")
        if not (path / "tests" / "test.sh").is_file() and not (folder / "tests" / "test.sh").is_file():
            raise TaskError(f"{path / 'tests' / 'test.sh'}: missing, and the task has no tests/test.sh")
        agent, verifier = _table(table, "agent", where), _table(table, "verifier", where)
        contributes = table.get("contributes_to_mean", True)
        if not isinstance(contributes, bool):
            raise TaskError(f"{where} contributes_to_mean: expected true or false, got {contributes!r}")
        own = separate_verifier(
            verifier, where, environment=environment, inherited=separate,
            artifacts=[*artifacts_of(config, where), *artifacts_of(table, where)],
            image=image_folder(folder, f"steps/{name}/tests", "tests"), parse_environment=_environment,
            section="steps.verifier",
        )  # fmt: skip
        steps.append(
            TaskStep(
                name=name,
                path=path,
                instruction=instruction,
                agent_timeout_sec=_positive(agent, "timeout_sec", f"{where} [steps.agent]", agent_timeout),
                verifier_timeout_sec=_positive(
                    verifier, "timeout_sec", f"{where} [steps.verifier]", verifier_timeout
                ),
                verifier_env={**env, **_string_table(verifier, "env", f"{where} [steps.verifier]")},
                min_reward=_min_reward(table.get("min_reward"), where),
                contributes_to_mean=contributes,
                separate_verifier=own,
            )
        )
    if steps and not any(step.contributes_to_mean for step in steps):
        raise TaskError(f"{folder / 'task.toml'}: every step has contributes_to_mean = false (no reward)")
    return tuple(steps)


def _min_reward(value: Any, where: str) -> float | dict[str, float] | None:
    if value is None:
        return None
    if isinstance(value, dict):
        if value and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value.values()):
            return {str(k): float(v) for k, v in value.items()}
    elif isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise TaskError(f"{where} min_reward: expected a number or a table of numbers, got {value!r}")


def _strategy(config: dict[str, Any], where: str) -> RewardStrategy:
    strategy = config.get("multi_step_reward_strategy", "mean")
    if strategy not in REWARD_STRATEGIES:
        raise TaskError(
            f"{where} multi_step_reward_strategy: expected one of {', '.join(REWARD_STRATEGIES)}, got "
            f"{strategy!r}"
        )
    return strategy  # type: ignore[no-any-return]


def _read_toml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise TaskError(f"{path}: missing (every task folder needs a task.toml)")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise TaskError(f"{path}: not valid TOML: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise TaskError(f"{path}: not UTF-8 text: {exc}") from exc


def _read_instruction(path: Path) -> str:
    if not path.is_file():
        raise TaskError(f"{path}: missing (the agent's instruction)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise TaskError(f"{path}: not UTF-8 text: {exc}") from exc
    if not text.strip():
        raise TaskError(f"{path}: empty (the agent would get no instruction)")
    return text


def _task_name(config: dict[str, Any], folder: Path, toml_path: Path) -> str:
    for section in ("task", "metadata"):
        name = _table(config, section, toml_path).get("name")
        if name is None:
            continue
        if not isinstance(name, str) or not name.strip():
            raise TaskError(f"{toml_path} [{section}] name: expected a non-empty string, got {name!r}")
        return name
    return folder.name


def _table(config: dict[str, Any], key: str, toml_path: Path) -> dict[str, Any]:
    value = config.get(key, {})
    if not isinstance(value, dict):
        raise TaskError(f"{toml_path}: [{key}] must be a table, got {type(value).__name__} {value!r}")
    return value


def _number(table: dict[str, Any], key: str, where: str) -> float | None:
    value = table.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TaskError(f"{where} {key}: expected a number, got {type(value).__name__} {value!r}")
    return float(value)


def _positive(table: dict[str, Any], key: str, where: str, default: float) -> float:
    value = _number(table, key, where)
    if value is None:
        return default
    if not value > 0 or value == float("inf"):
        raise TaskError(f"{where} {key}: expected a positive finite number of seconds, got {value!r}")
    return value


def _integer(table: dict[str, Any], key: str, where: str) -> int | None:
    value = table.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TaskError(f"{where} {key}: expected an integer, got {type(value).__name__} {value!r}")
    return value


def _megabytes(table: dict[str, Any], name: str, where: str) -> int | None:
    """``NAME_mb`` (an integer), or the older ``NAME = "2G"`` form (Docker's suffixes: K, M, G, T, with an
    optional ``i`` or ``B``), in megabytes; both at once is refused."""
    given = _integer(table, f"{name}_mb", where)
    text = table.get(name)
    if text is None:
        return given
    if given is not None:
        raise TaskError(f"{where} {name} and {name}_mb: give one of them, not both")
    size = str(text).strip().upper().removesuffix("B").removesuffix("I")
    number, unit = (size[:-1], size[-1]) if size[-1:] in _SIZE_UNITS_MB else (size, "")
    try:
        value = float(number) * _SIZE_UNITS_MB.get(unit, 1 / (1024 * 1024))  # no suffix: bytes
    except ValueError:
        value = float("nan")
    if isinstance(text, bool) or not value > 0 or (not unit and not isinstance(text, int)):
        raise TaskError(f'{where} {name}: expected a size such as "2G" or "512M", got {text!r}')
    return max(1, round(value))


def _string_table(table: dict[str, Any], key: str, where: str) -> dict[str, str]:
    value = table.get(key, {})
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise TaskError(f"{where} {key}: expected a table of strings, got {value!r}")
    return dict(value)


def _environment(table: dict[str, Any], where: str) -> EnvironmentSpec:
    image = table.get("docker_image")
    if image is not None and not isinstance(image, str):
        raise TaskError(f"{where} docker_image: expected a string, got {type(image).__name__} {image!r}")
    workdir = table.get("workdir")
    if workdir is not None and not (isinstance(workdir, str) and workdir.startswith("/")):
        raise TaskError(f"{where} workdir: expected an absolute path, got {workdir!r}")
    allow_internet = table.get("allow_internet", True)
    if not isinstance(allow_internet, bool):
        raise TaskError(f"{where} allow_internet: expected true or false, got {allow_internet!r}")
    return EnvironmentSpec(
        docker_image=image or None,
        cpus=_number(table, "cpus", where),
        memory_mb=_megabytes(table, "memory", where),
        storage_mb=_megabytes(table, "storage", where),
        allow_internet=allow_internet,
        build_timeout_sec=_number(table, "build_timeout_sec", where),
        workdir=workdir,
        extra={k: v for k, v in table.items() if k not in _ENVIRONMENT_KEYS},
    )
