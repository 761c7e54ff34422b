"""Loading one task folder: the shipped toy tasks, defaults, unknown keys, and each broken folder."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from harness_trainer.tasks import HarborTask, TaskError, load_task, loader
from harness_trainer.tasks.loader import DEFAULT_AGENT_TIMEOUT_SEC, DEFAULT_VERIFIER_TIMEOUT_SEC

from .conftest import EXAMPLES, TaskWriter

SHIPPED_TASKS = sorted(p.parent for p in EXAMPLES.glob("*/*/task.toml"))
ALLOWED_DOCKERFILE_INSTRUCTIONS = {"FROM", "WORKDIR", "ENV", "COPY", "RUN"}


def test_there_are_shipped_toy_tasks_in_two_splits() -> None:
    assert len(SHIPPED_TASKS) >= 5
    assert {p.parent.name for p in SHIPPED_TASKS} == {"train", "test"}


@pytest.mark.parametrize("folder", SHIPPED_TASKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_shipped_toy_task_loads_with_a_solution_and_a_simple_dockerfile(folder: Path) -> None:
    task = load_task(folder)
    assert task.name == folder.name
    assert task.instruction.strip()
    assert task.solution is not None and task.dockerfile is not None
    assert (task.tests_dir / "test.sh").is_file()
    assert task.verifier_timeout_sec == 30.0 and task.agent_timeout_sec == 300.0
    lines = task.dockerfile.read_text().replace("\\\n", " ").splitlines()
    keywords = [line.split()[0] for line in lines if line.strip() and not line.startswith("#")]
    assert keywords[0] == "FROM" and set(keywords) <= ALLOWED_DOCKERFILE_INSTRUCTIONS
    assert "WORKDIR /app" in lines


def test_a_minimal_task_gets_the_default_timeouts_and_environment(task_writer: TaskWriter) -> None:
    task = load_task(task_writer("plain"), split="train", index=3)
    assert isinstance(task, HarborTask)
    assert task.name == "plain" and task.split == "train" and task.index == 3
    assert task.agent_timeout_sec == DEFAULT_AGENT_TIMEOUT_SEC == 600.0
    assert task.verifier_timeout_sec == DEFAULT_VERIFIER_TIMEOUT_SEC == 120.0
    assert task.environment.docker_image is None and task.environment.allow_internet is True
    assert task.verifier_env == {} and task.solution is None and task.dockerfile is None
    assert task.path.is_absolute()


def test_the_instruction_is_kept_verbatim(task_writer: TaskWriter) -> None:
    text = "  Fix the bug.\n\nThen stop.\n\n"
    assert load_task(task_writer("t", instruction=text)).instruction == text


def test_known_keys_are_read_and_unknown_keys_are_kept(task_writer: TaskWriter) -> None:
    toml = """
version = "1.1"
future_top_level = "kept"
[metadata]
difficulty = "hard"
[agent]
timeout_sec = 90
[verifier]
timeout_sec = 12.5
env = { MODE = "strict" }
[environment]
docker_image = "ghcr.io/org/img:1"
cpus = 2
memory_mb = 4096
storage_mb = 10240
allow_internet = false
build_timeout_sec = 300
workdir = "/srv/app"
gpus = 0
mounts = ["a", "b"]
"""
    task = load_task(task_writer("t", toml=toml))
    assert task.agent_timeout_sec == 90.0 and task.verifier_timeout_sec == 12.5
    assert task.verifier_env == {"MODE": "strict"}
    env = task.environment
    assert (env.docker_image, env.cpus, env.memory_mb, env.storage_mb) == (
        "ghcr.io/org/img:1",
        2.0,
        4096,
        10240,
    )
    assert env.allow_internet is False and env.build_timeout_sec == 300.0 and env.workdir == "/srv/app"
    assert env.extra == {"gpus": 0, "mounts": ["a", "b"]}
    assert task.config["future_top_level"] == "kept" and task.config["metadata"]["difficulty"] == "hard"


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ('[task]\nname = "org/from-task"\n[metadata]\nname = "from-metadata"\n', "org/from-task"),
        ('[metadata]\nname = "from-metadata"\n', "from-metadata"),
        ("[metadata]\nauthor_name = 'x'\n", "folder-name"),
    ],
)
def test_the_name_comes_from_task_then_metadata_then_the_folder(
    task_writer: TaskWriter, toml: str, expected: str
) -> None:
    assert load_task(task_writer("folder-name", toml=toml)).name == expected


def test_a_missing_folder_is_a_task_error(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match="no such task folder"):
        load_task(tmp_path / "nope")


def test_a_missing_instruction_names_the_file(task_writer: TaskWriter) -> None:
    with pytest.raises(TaskError, match=r"instruction\.md: missing"):
        load_task(task_writer("t", instruction=None))


@pytest.mark.parametrize("text", ["", "  \n\t\n"])
def test_a_blank_instruction_is_a_task_error(task_writer: TaskWriter, text: str) -> None:
    with pytest.raises(TaskError, match=r"instruction\.md: empty"):
        load_task(task_writer("t", instruction=text))


def test_a_missing_task_toml_names_the_file(task_writer: TaskWriter) -> None:
    with pytest.raises(TaskError, match=r"task\.toml: missing"):
        load_task(task_writer("t", toml=None))


def test_a_broken_toml_reports_the_parser_message_and_line(task_writer: TaskWriter) -> None:
    folder = task_writer("t", toml='version = "1.0"\n[agent]\ntimeout_sec = = 3\n')
    with pytest.raises(TaskError, match=r"task\.toml: not valid TOML: .*line 3") as info:
        load_task(folder)
    assert str(folder / "task.toml") in str(info.value)


def test_a_missing_verifier_script_is_a_task_error(task_writer: TaskWriter) -> None:
    with pytest.raises(TaskError, match=r"tests/test\.sh: missing"):
        load_task(task_writer("t", test_sh=None))


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('[agent]\ntimeout_sec = "600"\n', r"\[agent\] timeout_sec: expected a number, got str '600'"),
        ("[verifier]\ntimeout_sec = true\n", r"\[verifier\] timeout_sec: expected a number, got bool"),
        ("[verifier]\ntimeout_sec = -1\n", r"\[verifier\] timeout_sec: expected a positive"),
        ("[agent]\ntimeout_sec = nan\n", r"\[agent\] timeout_sec: expected a positive"),
        ("agent = 5\n", r"\[agent\] must be a table, got int"),
        ("[environment]\nmemory_mb = 1.5\n", r"memory_mb: expected an integer, got float"),
        ("[environment]\ncpus = '2'\n", r"cpus: expected a number"),
        ("[environment]\nallow_internet = 'yes'\n", r"allow_internet: expected true or false"),
        ("[environment]\ndocker_image = 3\n", r"docker_image: expected a string"),
        ("[verifier]\nenv = { N = 1 }\n", r"\[verifier\] env: expected a table of strings"),
        ("[task]\nname = 7\n", r"\[task\] name: expected a non-empty string"),
        ("[environment]\nmemory = 'lots'\n", r"memory: expected a size such as \"2G\""),
        ("[environment]\nmemory = '2X'\n", r"memory: expected a size"),
        ("[environment]\nstorage = '-1G'\n", r"storage: expected a size"),
        ("[environment]\nmemory = true\n", r"memory: expected a size"),
        ("[environment]\nmemory = '2G'\nmemory_mb = 2048\n", r"memory and memory_mb: give one of them"),
    ],
)
def test_a_value_of_the_wrong_type_is_a_task_error_naming_the_key(
    task_writer: TaskWriter, toml: str, message: str
) -> None:
    with pytest.raises(TaskError, match=message):
        load_task(task_writer("t", toml=toml))


@pytest.mark.parametrize(
    ("toml", "memory_mb", "storage_mb"),
    [
        ("memory = '2G'\nstorage = '10G'\n", 2048, 10240),
        ("memory = '512M'\nstorage = '1.5GiB'\n", 512, 1536),
        ("memory = '4gb'\n", 4096, None),
        ("memory = 1073741824\n", 1024, None),  # a bare number is bytes, as Docker reads it
        ("memory_mb = 3000\nstorage_mb = 20000\n", 3000, 20000),
    ],
)
def test_the_older_size_form_reads_as_megabytes(
    task_writer: TaskWriter, toml: str, memory_mb: int, storage_mb: int | None
) -> None:
    environment = load_task(task_writer("t", toml="[environment]\n" + toml)).environment
    assert (environment.memory_mb, environment.storage_mb) == (memory_mb, storage_mb)
    assert "memory" not in environment.extra and "storage" not in environment.extra


@pytest.mark.parametrize(
    ("toml", "files", "field"),
    [
        ('[environment]\nos = "windows"\n', {}, "os = 'windows': only Linux sandboxes"),
        ("[environment]\ngpus = 1\n", {}, "[environment] gpus / tpu: sandboxes here have no accelerator"),
        ('[environment.tpu]\ntype = "v6e"\n', {}, "[environment] gpus / tpu"),
        ('[environment]\nmcp_servers = [{name = "x"}]\n', {}, "[environment] mcp_servers"),
    ],
)
def test_what_no_backend_here_can_run_is_refused_naming_the_field(
    task_writer: TaskWriter, toml: str, files: dict[str, str], field: str
) -> None:
    folder = task_writer("t", toml='version = "2.0"\n' + toml)
    for name, text in files.items():
        (folder / "environment").mkdir(exist_ok=True)
        (folder / "environment" / name).write_text(text)
    with pytest.raises(TaskError, match="cannot be run here: ") as refused:
        load_task(folder)
    assert field in str(refused.value) and str(folder / "task.toml") in str(refused.value)


def test_a_compose_file_beside_a_dockerfile_runs_the_dockerfile_as_main(task_writer: TaskWriter) -> None:
    folder = task_writer("t")
    (folder / "environment").mkdir()
    (folder / "environment" / "docker-compose.yaml").write_text("services:\n  main: {build: .}\n")
    (folder / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\n")
    task = load_task(folder)
    assert task.dockerfile is not None and task.compose is not None and task.compose.sidecars == ()


def test_what_a_rollout_ignores_is_logged_once_per_field_with_its_reason(
    task_writer: TaskWriter, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loader, "_logged", set())
    toml = (
        'version = "2.0"\n[agent]\nuser = "agent"\n[solution]\nenv = { K = "v" }\n'
        '[environment]\nos = "linux"\ngpu_types = ["H100"]\nshiny = true\n'
    )
    with caplog.at_level(logging.WARNING, logger="harness_trainer.tasks.loader"):
        load_task(task_writer("first", toml=toml))
        load_task(task_writer("second", toml=toml))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4, lines  # once each, for the first task only; os = "linux" is honoured
    assert "first: [agent] user is ignored: the agent runs as the sandbox image's user" in lines[0]
    assert any("[solution] is ignored: reference solutions are not run in rollouts" in m for m in lines)
    assert any("[environment] gpu_types is ignored" in m for m in lines)
    assert any("[environment] shiny is ignored: not a key this project knows" in m for m in lines)


def test_a_relative_workdir_is_a_task_error(task_writer: TaskWriter) -> None:
    with pytest.raises(TaskError, match="workdir: expected an absolute path, got 'app'"):
        load_task(task_writer("t", toml='[environment]\nworkdir = "app"\n'))
