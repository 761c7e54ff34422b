"""docker-compose environments as loaded: ``main`` is the agent's service (the task's own image), the other
services are sidecars in ``depends_on`` order; what a rollout here cannot honour is refused naming the key,
what changes nothing is ignored with a reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness_trainer.sandboxes import LocalSandboxBackend
from harness_trainer.sandboxes.base import SandboxStartError
from harness_trainer.tasks.compose import ComposeError, read_compose
from harness_trainer.tasks.loader import load_task
from harness_trainer.tasks.task import TaskError
from tests.tasks.conftest import TaskWriter

SHIPPED = Path(__file__).resolve().parents[1] / "harbor_shaped" / "compose" / "restock-report"


def compose(folder: Path, text: str, dockerfiles: tuple[str, ...] = (".",)) -> Path:
    environment = folder / "environment"
    for context in dockerfiles:
        (environment / context).mkdir(parents=True, exist_ok=True)
        (environment / context / "Dockerfile").write_text("FROM debian:bookworm-slim\n")
    (environment / "docker-compose.yaml").write_text(text)
    return environment / "docker-compose.yaml"


def test_the_shipped_task_has_main_and_its_sidecar_in_start_order() -> None:
    task = load_task(SHIPPED)
    assert task.compose is not None and task.compose.main.name == "main"
    [api] = task.compose.sidecars
    assert (api.name, api.context, api.command) == (
        "inventory-api",
        SHIPPED / "environment" / "api",
        ("python3", "/srv/api.py"),
    )
    assert api.environment == {"API_PORT": "8080"}
    assert set(task.compose.ignored) == {"inventory-api.expose", "inventory-api.healthcheck"}
    assert task.dockerfile == SHIPPED / "environment" / "Dockerfile"


def test_sidecars_start_after_what_they_depend_on_and_main_may_name_an_image(tmp_path: Path) -> None:
    path = compose(tmp_path, """services:
  main: {image: "python:3.12-slim"}
  web: {image: nginx, depends_on: {cache: {condition: service_healthy}, db: {}}}
  cache: {image: redis:7, environment: [MODE=lru, EMPTY=]}
  db: {build: {context: db}, command: "postgres -c fsync=off"}
""", dockerfiles=("db",))  # fmt: skip
    spec = read_compose(path)
    assert [s.name for s in spec.sidecars] == ["cache", "db", "web"]
    assert spec.sidecars[0].environment == {"MODE": "lru", "EMPTY": ""}
    assert spec.sidecars[1].command == ("/bin/sh", "-c", "postgres -c fsync=off")
    assert spec.main.image == "python:3.12-slim"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("services:\n  app: {image: x}\n", "no `main` service"),
        ("services:\n  main: {build: .}\n  db: {image: x, privileged: true}\n", "`privileged` is not run"),
        ("services:\n  main: {build: .}\n  db: {image: x, volumes: ['/etc:/etc']}\n", "`volumes` is not run"),
        ("services:\n  main: {build: .}\nvolumes: {data: {}}\n", "top-level ['volumes']"),
        ("services:\n  main: {build: ./other}\n", "no " ),
        ("services:\n  main: {build: .}\n  a: {image: x, depends_on: [b]}\n  b: {image: y, depends_on: [a]}",
         "depends_on has a cycle"),
        ("services:\n  main: {build: .}\n  a: {image: x, depends_on: [nope]}\n", "names 'nope', which is no"),
        ("services:\n  main: {build: .}\n  a: {environment: {}}\n", "needs an `image` or a `build`"),
        ("services: [1, 2]\n", "expected a mapping with `services`"),
        ("services: {main: {build: .}\n", "not readable YAML"),
    ],
)  # fmt: skip
def test_what_cannot_run_is_refused_naming_the_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ComposeError) as refused:
        read_compose(compose(tmp_path, text))
    assert message in str(refused.value) and "docker-compose.yaml" in str(refused.value)


def test_a_main_built_from_another_dockerfile_than_the_tasks_is_refused(tmp_path: Path) -> None:
    path = compose(tmp_path, "services:\n  main: {build: ./agent}\n", dockerfiles=(".", "agent"))
    with pytest.raises(ComposeError, match="the agent's image here is the task's own"):
        read_compose(path)


def test_the_loader_refuses_a_bad_compose_file_and_takes_mains_image(task_writer: TaskWriter) -> None:
    folder = task_writer("t")
    compose(folder, "services:\n  app: {image: x}\n")
    with pytest.raises(TaskError, match=r"cannot be run here: .*no `main` service"):
        load_task(folder)
    bare = task_writer("u")
    (bare / "environment").mkdir()
    (bare / "environment" / "compose.yaml").write_text("services:\n  main: {image: 'ubuntu:24.04'}\n")
    assert load_task(bare).environment.docker_image == "ubuntu:24.04"


async def test_the_local_backend_refuses_a_task_with_sidecars_naming_them(tmp_path: Path) -> None:
    backend = LocalSandboxBackend(tmp_path / "sandboxes")
    try:
        with pytest.raises(SandboxStartError) as refused:
            await backend.start(load_task(SHIPPED), lifetime_s=60)
        assert "runs services beside the agent's (inventory-api); the local backend starts none" in str(
            refused.value
        )
        assert backend.live == []
    finally:
        await backend.aclose()
