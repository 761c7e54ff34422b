"""A task's ``environment/docker-compose.yaml``, as Harbor writes them: the agent's service ``main`` and the
sidecar services it talks to (a database, an API), on one network where each service is reached by its
name.

:func:`read_compose` parses the file (pure: a function of its text and the folder it lies in) into a
:class:`ComposeSpec` and refuses, naming the key, what a rollout here cannot honour: a file without a
``main`` service, a ``main`` built from another folder or Dockerfile than the task's ``environment/``
(the agent's image is the task's), host bind mounts, privileged services, networks and volumes of its own.
What changes nothing a rollout measures (``ports``, ``expose``, ``restart``, ``container_name``,
``healthcheck``, ``depends_on``'s conditions) is returned as ``ignored`` for the loader to log. Only the
Docker backend starts sidecars (:mod:`harness_trainer.sandboxes.docker_compose`); a task with sidecars is
refused by the others at start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

COMPOSE_FILES = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")
MAIN = "main"
_SERVICE_KEYS = {"build", "image", "environment", "command", "entrypoint", "depends_on", "working_dir"}
_IGNORED_SERVICE_KEYS = {
    "ports": "services reach each other by name on the task's network; nothing is published",
    "expose": "services reach each other by name on the task's network",
    "restart": "a sandbox lives one rollout",
    "container_name": "containers are named per rollout",
    "healthcheck": "a sidecar is started before the agent's service, not polled",
    "networks": "every service is on the task's one network",
    "platform": "images are this machine's platform",
    "init": "every container here runs with an init",
    "stop_grace_period": "a sandbox's containers are removed at its end",
}
_TOP_KEYS = {"services", "version", "name"}


class ComposeError(ValueError):
    """A compose file this project cannot run; names the file and the key."""


@dataclass(frozen=True)
class ComposeService:
    """One service: its image (``image``) or build (``context`` and ``dockerfile``), and how it runs."""

    name: str
    image: str | None = None
    context: Path | None = None
    dockerfile: str = "Dockerfile"
    environment: dict[str, str] = field(default_factory=dict)
    command: tuple[str, ...] | None = None
    entrypoint: tuple[str, ...] | None = None
    working_dir: str | None = None


@dataclass(frozen=True)
class ComposeSpec:
    """The file's ``main`` (the agent's service: the task's own image) and its sidecars, in start order."""

    path: Path
    main: ComposeService
    sidecars: tuple[ComposeService, ...]
    ignored: dict[str, str] = field(default_factory=dict)
    """``service.key`` → why it changes nothing here (logged by the loader)."""


def compose_file(environment_dir: Path) -> Path | None:
    """The task's compose file, if it has one."""
    return next((environment_dir / n for n in COMPOSE_FILES if (environment_dir / n).is_file()), None)


def read_compose(path: Path) -> ComposeSpec:
    """Parse the compose file at ``path`` (see the module docstring).

    Raises:
        ComposeError: not YAML, not a mapping of services, no ``main``, or a key this project cannot honour.
    """
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ComposeError(f"{path}: not readable YAML: {exc}") from exc
    if not isinstance(document, dict) or not isinstance(document.get("services"), dict):
        raise ComposeError(f"{path}: expected a mapping with `services`")
    if unknown := sorted(k for k in document if k not in _TOP_KEYS and not str(k).startswith("x-")):
        raise ComposeError(f"{path}: top-level {unknown} (networks and volumes of its own) are not run here")
    services, ignored = {}, {}
    for name, body in document["services"].items():
        if not isinstance(body, dict):
            raise ComposeError(f"{path}: service {name!r} must be a mapping")
        services[str(name)] = _service(path, str(name), body, ignored)
    if MAIN not in services:
        raise ComposeError(f"{path}: no `{MAIN}` service (Harbor runs the agent in the service named main)")
    main = services.pop(MAIN)
    if main.context is not None and (main.context != path.parent or main.dockerfile != "Dockerfile"):
        raise ComposeError(
            f"{path}: service main builds {main.context / main.dockerfile}: the agent's image here is the "
            f"task's own, {path.parent / 'Dockerfile'}"
        )
    return ComposeSpec(path, main, tuple(_in_start_order(path, services, document["services"])), ignored)


def _service(path: Path, name: str, body: dict[str, Any], ignored: dict[str, str]) -> ComposeService:
    where = f"{path}: service {name!r}"
    for key in body:
        if key in _IGNORED_SERVICE_KEYS:
            ignored[f"{name}.{key}"] = _IGNORED_SERVICE_KEYS[key]
        elif key not in _SERVICE_KEYS:
            raise ComposeError(f"{where}: `{key}` is not run here")
    if "image" not in body and "build" not in body:
        raise ComposeError(f"{where}: needs an `image` or a `build`")
    context, dockerfile = None, "Dockerfile"
    build = body.get("build")
    if isinstance(build, str):
        context = (path.parent / build).resolve()
    elif isinstance(build, dict):
        context = (path.parent / str(build.get("context", "."))).resolve()
        dockerfile = str(build.get("dockerfile", "Dockerfile"))
        if extra := sorted(set(build) - {"context", "dockerfile"}):
            raise ComposeError(f"{where}: build {extra} are not run here")
    elif build is not None:
        raise ComposeError(f"{where}: `build` must be a folder or a mapping, got {build!r}")
    if context is not None and not (context / dockerfile).is_file():
        raise ComposeError(f"{where}: no {context / dockerfile} to build")
    return ComposeService(
        name=name,
        image=str(body["image"]) if body.get("image") is not None else None,
        context=context,
        dockerfile=dockerfile,
        environment=_environment(where, body.get("environment")),
        command=_words(where, "command", body.get("command")),
        entrypoint=_words(where, "entrypoint", body.get("entrypoint")),
        working_dir=str(body["working_dir"]) if body.get("working_dir") else None,
    )


def _environment(where: str, value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if isinstance(value, dict):
        return {str(k): "" if v is None else str(v) for k, v in value.items()}
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return dict(item.partition("=")[::2] for item in value)
    raise ComposeError(f"{where}: `environment` must be a mapping or a list of KEY=value, got {value!r}")


def _words(where: str, key: str, value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return ("/bin/sh", "-c", value)
    if isinstance(value, list) and all(isinstance(item, str | int | float) for item in value):
        return tuple(str(item) for item in value)
    raise ComposeError(f"{where}: `{key}` must be a string or a list, got {value!r}")


def _in_start_order(
    path: Path, services: dict[str, ComposeService], raw: dict[str, Any]
) -> list[ComposeService]:
    """The sidecars, each after those it ``depends_on`` (a cycle is refused)."""
    ordered: list[ComposeService] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in (s.name for s in ordered) or name == MAIN:
            return
        if name not in services:
            raise ComposeError(f"{path}: depends_on names {name!r}, which is no service")
        if name in visiting:
            raise ComposeError(f"{path}: depends_on has a cycle through {name!r}")
        visiting.add(name)
        for needed in raw[name].get("depends_on") or []:
            visit(str(needed))
        ordered.append(services[name])

    for name in services:
        visit(name)
    return ordered
