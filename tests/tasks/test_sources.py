"""Task sources: splits, indices, prompt rows, finding a task by its prompt, and the Hub download."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import huggingface_hub
import pytest

from harness_trainer.tasks import (
    HubTaskSource,
    LocalTaskSource,
    TaskError,
    TaskSource,
    open_task_source,
)
from harness_trainer.tasks import sources as sources_module

from .conftest import EXAMPLES, TaskWriter


def test_the_shipped_examples_have_a_train_and_a_test_split() -> None:
    source = LocalTaskSource(EXAMPLES)
    assert source.splits() == ["test", "train"]
    assert [t.name for t in source.tasks("train")] == sorted(p.name for p in (EXAMPLES / "train").iterdir())


def test_tasks_are_sorted_by_folder_name_and_indexed_by_position(task_writer: TaskWriter) -> None:
    for name in ["c-task", "a-task", "b-task"]:
        task_writer(f"train/{name}", instruction=f"Do {name}.\n")
    source = LocalTaskSource(task_writer("train/a-task").parent.parent)
    tasks = source.tasks("train")
    assert [(t.name, t.index, t.split) for t in tasks] == [
        ("a-task", 0, "train"),
        ("b-task", 1, "train"),
        ("c-task", 2, "train"),
    ]
    assert source.task("train", 2).name == "c-task"


def test_an_index_out_of_range_is_an_index_error_that_says_how_many_tasks_there_are(
    task_writer: TaskWriter, tmp_path: Path
) -> None:
    task_writer("train/only")
    source = LocalTaskSource(tmp_path)
    for index in (1, -1):
        with pytest.raises(IndexError, match=r"task index .* out of range: split 'train' has 1 tasks"):
            source.task("train", index)


def test_an_unknown_split_is_a_key_error_listing_the_splits(task_writer: TaskWriter, tmp_path: Path) -> None:
    task_writer("train/a")
    task_writer("eval/b")
    with pytest.raises(KeyError, match=r"no split 'dev'.*\['eval', 'train'\]"):
        LocalTaskSource(tmp_path).tasks("dev")


def test_a_root_that_holds_task_folders_is_one_split_named_train(
    task_writer: TaskWriter, tmp_path: Path
) -> None:
    task_writer("a")
    task_writer("b")
    source = LocalTaskSource(tmp_path)
    assert source.splits() == ["train"]
    assert [t.name for t in source.tasks("train")] == ["a", "b"]


def test_hidden_folders_and_folders_without_tasks_are_not_splits(
    task_writer: TaskWriter, tmp_path: Path
) -> None:
    task_writer("train/a")
    task_writer(".cache/huggingface/x")
    (tmp_path / "docs").mkdir()
    assert LocalTaskSource(tmp_path).splits() == ["train"]


def test_a_broken_task_in_a_split_fails_the_split_loudly(task_writer: TaskWriter, tmp_path: Path) -> None:
    task_writer("train/good")
    task_writer("train/bad", instruction=None)
    with pytest.raises(TaskError, match=r"bad/instruction\.md: missing"):
        LocalTaskSource(tmp_path).tasks("train")


def test_mixing_task_folders_and_split_folders_is_a_task_error(
    task_writer: TaskWriter, tmp_path: Path
) -> None:
    task_writer("loose-task")
    task_writer("train/a")
    with pytest.raises(TaskError, match="holds both task folders"):
        LocalTaskSource(tmp_path).splits()


def test_a_root_without_tasks_or_that_does_not_exist_is_a_task_error(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match="no task folders"):
        LocalTaskSource(tmp_path).splits()
    with pytest.raises(TaskError, match="no such task directory"):
        LocalTaskSource(tmp_path / "missing").splits()


def test_prompt_rows_carry_the_instruction_as_a_user_message(task_writer: TaskWriter, tmp_path: Path) -> None:
    task_writer("train/a", instruction="First.\n")
    task_writer("train/b", instruction="Second.\n")
    assert LocalTaskSource(tmp_path).prompt_rows("train") == [
        {"prompt": [{"role": "user", "content": "First.\n"}], "task_index": 0, "task_name": "a"},
        {"prompt": [{"role": "user", "content": "Second.\n"}], "task_index": 1, "task_name": "b"},
    ]


def test_prompt_rows_make_a_datasets_dataset() -> None:
    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_list(LocalTaskSource(EXAMPLES).prompt_rows("train"))
    assert dataset[0]["prompt"][0]["role"] == "user" and dataset[0]["task_index"] == 0


def test_find_maps_a_prompt_back_to_its_task(task_writer: TaskWriter, tmp_path: Path) -> None:
    task_writer("train/a", instruction="First.\n")
    task_writer("train/b", instruction="Second.\n")
    source = LocalTaskSource(tmp_path)
    for row in source.prompt_rows("train"):
        assert source.find("train", row["prompt"][0]["content"]).index == row["task_index"]
    assert source.find("train", "  Second.").name == "b"  # surrounding whitespace is forgiven


def test_find_of_an_unknown_instruction_is_a_key_error(task_writer: TaskWriter, tmp_path: Path) -> None:
    task_writer("train/a", instruction="First.\n")
    with pytest.raises(KeyError, match="no task in split 'train'"):
        LocalTaskSource(tmp_path).find("train", "Something else")


def test_tasks_with_the_same_instruction_resolve_to_the_first(
    task_writer: TaskWriter, tmp_path: Path
) -> None:
    task_writer("train/a", instruction="Same.\n")
    task_writer("train/b", instruction="Same.\n")
    assert LocalTaskSource(tmp_path).find("train", "Same.\n").name == "a"


def test_a_split_is_read_from_disk_once(
    task_writer: TaskWriter, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    task_writer("train/a")
    calls: list[Path] = []
    real_load = sources_module.load_task
    monkeypatch.setattr(sources_module, "load_task", lambda p, **kw: calls.append(p) or real_load(p, **kw))
    source = LocalTaskSource(tmp_path)
    for _ in range(3):
        source.tasks("train")
        source.task("train", 0)
        source.prompt_rows("train")
        source.find("train", "Do the thing.\n")
    assert len(calls) == 1


def test_local_and_hub_sources_satisfy_the_protocol(tmp_path: Path) -> None:
    sources: list[TaskSource] = [LocalTaskSource(EXAMPLES), HubTaskSource("org/tasks", cache_dir=tmp_path)]
    assert all(callable(getattr(s, name)) for s in sources for name in TaskSource.__dict__ if name[0] != "_")


def fake_snapshot_download(origin: Path, calls: list[dict[str, Any]]) -> Any:
    """Stands in for the Hub: copies ``origin`` into ``local_dir`` as real files, as the SDK does."""

    def snapshot_download(repo_id: str, **kwargs: Any) -> str:
        calls.append({"repo_id": repo_id, **kwargs})
        local_dir = Path(kwargs["local_dir"])
        shutil.copytree(origin, local_dir, dirs_exist_ok=True)
        (local_dir / ".cache" / "huggingface").mkdir(parents=True, exist_ok=True)
        return str(local_dir)

    return snapshot_download


def test_a_hub_source_downloads_a_dataset_repo_once_into_real_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download(EXAMPLES, calls))
    source = HubTaskSource("org/toy-tasks", revision="v1", cache_dir=tmp_path / "cache")
    assert source.splits() == ["test", "train"]
    local = LocalTaskSource(EXAMPLES)
    assert source.prompt_rows("train") == local.prompt_rows("train")
    task = source.task("test", 1)
    assert task.name == local.task("test", 1).name
    assert task.path.is_relative_to(tmp_path / "cache") and not task.path.is_symlink()
    assert source.find("train", local.task("train", 2).instruction).index == 2
    assert len(calls) == 1
    assert calls[0]["repo_id"] == "org/toy-tasks"
    assert calls[0]["repo_type"] == "dataset" and calls[0]["revision"] == "v1"
    assert Path(calls[0]["local_dir"]) == tmp_path / "cache" / "org--toy-tasks" / "v1"


def test_a_hub_download_failure_is_a_task_error_naming_the_repo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unreachable(repo_id: str, **kwargs: Any) -> str:
        raise huggingface_hub.errors.LocalEntryNotFoundError("offline and not cached")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(TaskError, match="could not download dataset 'org/gone': offline and not cached"):
        HubTaskSource("org/gone", cache_dir=tmp_path).splits()


def test_the_hub_cache_defaults_under_harness_trainer_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HARNESS_TRAINER_CACHE", str(tmp_path))
    assert HubTaskSource("org/x").local_dir == tmp_path / "tasks" / "org--x" / "main"


def test_open_task_source_takes_a_directory_or_a_repo_id(tmp_path: Path) -> None:
    assert isinstance(open_task_source(str(EXAMPLES)), LocalTaskSource)
    assert isinstance(open_task_source(EXAMPLES), LocalTaskSource)
    hub = open_task_source("org/toy-tasks", revision="abc")
    assert isinstance(hub, HubTaskSource) and hub.repo_id == "org/toy-tasks" and hub.revision == "abc"


@pytest.mark.parametrize("spec", ["missing-dir", "./a/b", "a/b/c", "/no/such/place", "~/x", ""])
def test_open_task_source_rejects_what_is_neither(spec: str) -> None:
    with pytest.raises(TaskError, match="neither a directory of tasks nor a Hub dataset repo id"):
        open_task_source(spec)
