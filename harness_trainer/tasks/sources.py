"""Task sources: where a run's Harbor tasks come from, addressed by split and index.

Layout of a source's root directory (local, or a Hub dataset repo once downloaded):

- ``root/<split>/<task>/task.toml``: every sub-directory of ``root`` that holds task folders is a split
  (``train``, ``test``, …); every sub-directory of a split is a task (a broken one raises
  :class:`TaskError` when the split is loaded, it is never skipped).
- ``root/<task>/task.toml``: ``root`` itself holds the task folders; it is one split named ``train``.
- Mixing the two, or a root with no task folders at all, raises :class:`TaskError`.

Names starting with ``.`` are ignored (``.git``, the Hub's ``.cache``). Within a split, tasks are
sorted by folder name and ``index`` is the position in that order. A split is read from disk once and
then served from memory.

Lookups that miss raise ``LookupError`` subclasses: an unknown split ``KeyError``, an index out of
range ``IndexError``, an instruction no task has ``KeyError``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Protocol

from harness_trainer.tasks.loader import load_task
from harness_trainer.tasks.task import HarborTask, TaskError

ROOT_SPLIT = "train"
_HUB_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class TaskSource(Protocol):
    """What the rollout server, the session factories and the trainer's dataset need from tasks."""

    def splits(self) -> list[str]: ...

    def tasks(self, split: str) -> list[HarborTask]: ...

    def task(self, split: str, index: int) -> HarborTask: ...

    def prompt_rows(self, split: str) -> list[dict[str, Any]]: ...

    def find(self, split: str, instruction: str) -> HarborTask: ...


class LocalTaskSource:
    """Tasks in a local directory (layout in the module docstring)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser().resolve()
        self._split_dirs: dict[str, Path] | None = None
        self._tasks: dict[str, list[HarborTask]] = {}
        self._by_instruction: dict[str, dict[str, HarborTask]] = {}

    def __repr__(self) -> str:
        return f"LocalTaskSource({str(self.root)!r})"

    def splits(self) -> list[str]:
        return sorted(self._splits())

    def tasks(self, split: str) -> list[HarborTask]:
        if split not in self._tasks:
            split_dir = self._split_dir(split)
            folders = sorted(_visible_dirs(split_dir), key=lambda p: p.name)
            self._tasks[split] = [load_task(folder, split=split, index=i) for i, folder in enumerate(folders)]
        return list(self._tasks[split])

    def task(self, split: str, index: int) -> HarborTask:
        tasks = self.tasks(split)
        if not 0 <= index < len(tasks):
            raise IndexError(f"task index {index} out of range: split {split!r} has {len(tasks)} tasks")
        return tasks[index]

    def prompt_rows(self, split: str) -> list[dict[str, Any]]:
        """One row per task, for ``datasets.Dataset.from_list``: the instruction as a user message."""
        return [
            {
                "prompt": [{"role": "user", "content": task.instruction}],
                "task_index": task.index,
                "task_name": task.name,
            }
            for task in self.tasks(split)
        ]

    def find(self, split: str, instruction: str) -> HarborTask:
        """The task whose instruction is ``instruction`` (exactly, else up to surrounding whitespace).

        Tasks with the same instruction cannot be told apart this way; the first (lowest index) wins.
        """
        if split not in self._by_instruction:
            table: dict[str, HarborTask] = {}
            for task in reversed(self.tasks(split)):  # reversed: the lowest index is written last
                table[task.instruction.strip()] = task
                table[task.instruction] = task
            self._by_instruction[split] = table
        table = self._by_instruction[split]
        found = table.get(instruction) or table.get(instruction.strip())
        if found is None:
            preview = instruction[:80]
            raise KeyError(f"no task in split {split!r} of {self.root} has this instruction: {preview!r}")
        return found

    def _splits(self) -> dict[str, Path]:
        if self._split_dirs is None:
            self._split_dirs = _discover_splits(self.root)
        return self._split_dirs

    def _split_dir(self, split: str) -> Path:
        split_dirs = self._splits()
        if split not in split_dirs:
            raise KeyError(f"no split {split!r} in {self.root}; splits: {sorted(split_dirs)}")
        return split_dirs[split]


class HubTaskSource:
    """Tasks in a Hugging Face dataset repo of task folders, downloaded once as real files.

    The snapshot goes to ``cache_dir/<owner>--<name>/<revision or main>`` (``cache_dir`` defaults to
    ``$HARNESS_TRAINER_CACHE/tasks``, else ``~/.cache/harness-trainer/tasks``) through ``local_dir``, so
    files are copies, not symlinks into the Hub cache. The download happens on first use.
    """

    def __init__(
        self, repo_id: str, revision: str | None = None, cache_dir: str | Path | None = None
    ) -> None:
        self.repo_id = repo_id
        self.revision = revision
        base = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
        self.local_dir = base.expanduser() / repo_id.replace("/", "--") / (revision or "main")
        self._local: LocalTaskSource | None = None

    def __repr__(self) -> str:
        return f"HubTaskSource({self.repo_id!r}, revision={self.revision!r})"

    def download(self) -> LocalTaskSource:
        """Fetch the snapshot (once) and return the local source over it.

        Raises:
            TaskError: the repo or revision does not exist, or the Hub could not be reached.
        """
        if self._local is None:
            import huggingface_hub  # late: only Hub sources need it

            try:
                path = huggingface_hub.snapshot_download(
                    self.repo_id, repo_type="dataset", revision=self.revision, local_dir=self.local_dir
                )
            except (OSError, ValueError) as exc:  # the Hub's errors are OSError subclasses
                raise TaskError(f"could not download dataset {self.repo_id!r}: {exc}") from exc
            self._local = LocalTaskSource(path)
        return self._local

    def splits(self) -> list[str]:
        return self.download().splits()

    def tasks(self, split: str) -> list[HarborTask]:
        return self.download().tasks(split)

    def task(self, split: str, index: int) -> HarborTask:
        return self.download().task(split, index)

    def prompt_rows(self, split: str) -> list[dict[str, Any]]:
        return self.download().prompt_rows(split)

    def find(self, split: str, instruction: str) -> HarborTask:
        return self.download().find(split, instruction)


def open_task_source(spec: str | Path, *, revision: str | None = None) -> TaskSource:
    """A local directory if ``spec`` is one, else a Hub dataset repo id (``owner/name``).

    Raises:
        TaskError: ``spec`` is neither an existing directory nor a repo id.
    """
    path = Path(spec).expanduser()
    if str(spec) and path.is_dir():
        return LocalTaskSource(path)
    text = str(spec)
    if _HUB_REPO_ID.fullmatch(text):
        return HubTaskSource(text, revision=revision)
    raise TaskError(f"{text!r} is neither a directory of tasks nor a Hub dataset repo id (owner/name)")


def _default_cache_dir() -> Path:
    base = os.environ.get("HARNESS_TRAINER_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "harness-trainer") / "tasks"


def _visible_dirs(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")]


def _discover_splits(root: Path) -> dict[str, Path]:
    if not root.is_dir():
        raise TaskError(f"{root}: no such task directory")
    children = _visible_dirs(root)
    direct_tasks = [p for p in children if (p / "task.toml").is_file()]
    splits = {
        p.name: p
        for p in children
        if p not in direct_tasks and any((c / "task.toml").is_file() for c in _visible_dirs(p))
    }
    if direct_tasks and splits:
        raise TaskError(
            f"{root}: holds both task folders ({direct_tasks[0].name}, …) and split folders "
            f"({sorted(splits)[0]}, …); put every task under a split"
        )
    if direct_tasks:
        return {ROOT_SPLIT: root}
    if not splits:
        raise TaskError(f"{root}: no task folders (expected <split>/<task>/task.toml or <task>/task.toml)")
    return splits
