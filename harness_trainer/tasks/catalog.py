"""Several task datasets behind one name space of splits: what ``serve --dataset A --dataset B`` serves.

A *split name* picks one split of one dataset (OpenEnv's ``split``, "a dataset spec"):

- ``NAME`` — dataset ``NAME``'s default split: its ``train`` split, else its only one. ``NAME`` is the
  dataset as given to ``--dataset`` (a Hub id ``owner/name``, or a folder; a folder is also known by
  its base name when no other dataset has that name).
- ``NAME:SPLIT`` — split ``SPLIT`` of dataset ``NAME`` (e.g. ``owner/tasks:test``).
- ``SPLIT`` — split ``SPLIT`` of the *first* dataset (what a one-dataset server has always served:
  ``train``, ``test``).
- ``""`` — the first dataset's default split.

:meth:`TaskCatalog.splits` lists every ``NAME:SPLIT`` (the canonical names); an unknown name raises
``KeyError`` listing them. Tasks keep their own split name (``HarborTask.split``); indices are per split.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness_trainer.tasks.sources import ROOT_SPLIT, LocalTaskSource, TaskSource, open_task_source
from harness_trainer.tasks.task import HarborTask, TaskError


class TaskCatalog:
    """A :class:`~harness_trainer.tasks.sources.TaskSource` over named datasets; the first is the default."""

    def __init__(self, datasets: dict[str, TaskSource]) -> None:
        if not datasets:
            raise TaskError("a task catalog needs at least one dataset")
        self.datasets = dict(datasets)
        self._aliases: dict[str, str] = {}
        for name, source in self.datasets.items():
            if isinstance(source, LocalTaskSource):
                alias = source.root.name
                if alias not in self.datasets and alias not in self._aliases:
                    self._aliases[alias] = name

    @classmethod
    def open(cls, specs: list[str], *, revision: str | None = None) -> TaskCatalog:
        """Open each ``--dataset`` spec (a folder or a Hub dataset id), named as given.

        Raises:
            TaskError: a spec is neither, or two specs are the same.
        """
        datasets: dict[str, TaskSource] = {}
        for spec in specs:
            name = spec.rstrip("/") or spec
            if name in datasets:
                raise TaskError(f"dataset {name!r} is given twice")
            datasets[name] = open_task_source(spec, revision=revision)
        return cls(datasets)

    def __repr__(self) -> str:
        return f"TaskCatalog({list(self.datasets)!r})"

    @property
    def default(self) -> str:
        """The first dataset's name."""
        return next(iter(self.datasets))

    def splits(self) -> list[str]:
        """Every split, as ``NAME:SPLIT``, datasets in the order given."""
        return [f"{name}:{split}" for name, source in self.datasets.items() for split in source.splits()]

    def resolve(self, split: str) -> tuple[TaskSource, str]:
        """The dataset and its own split name that ``split`` means (rules in the module docstring).

        Raises:
            KeyError: no dataset or split by that name; the message lists the known ones.
        """
        name = self._aliases.get(split, split)
        if split == "":
            name = self.default
        if name in self.datasets:
            return self.datasets[name], self._default_split(name)
        dataset, _, own = split.rpartition(":")
        dataset = self._aliases.get(dataset, dataset)
        if dataset in self.datasets and own in self.datasets[dataset].splits():
            return self.datasets[dataset], own
        first = self.datasets[self.default]
        if not dataset and split in first.splits():
            return first, split
        raise KeyError(f"no split {split!r}; splits: {self.splits()}")

    def canonical(self, split: str) -> str:
        """``split`` as ``NAME:SPLIT``."""
        source, own = self.resolve(split)
        name = next(n for n, s in self.datasets.items() if s is source)
        return f"{name}:{own}"

    def _default_split(self, name: str) -> str:
        own = self.datasets[name].splits()
        if ROOT_SPLIT in own:
            return ROOT_SPLIT
        if len(own) == 1:
            return own[0]
        choices = [f"{name}:{split}" for split in own]
        raise KeyError(f"dataset {name!r} has several splits and no {ROOT_SPLIT!r}; name one of {choices}")

    def tasks(self, split: str) -> list[HarborTask]:
        source, own = self.resolve(split)
        return source.tasks(own)

    def task(self, split: str, index: int) -> HarborTask:
        source, own = self.resolve(split)
        return source.task(own, index)

    def prompt_rows(self, split: str) -> list[dict[str, Any]]:
        source, own = self.resolve(split)
        return source.prompt_rows(own)

    def find(self, split: str, instruction: str) -> HarborTask:
        source, own = self.resolve(split)
        return source.find(own, instruction)


def as_catalog(tasks: TaskSource | TaskCatalog | str | Path) -> TaskCatalog:
    """``tasks`` as a catalog: a catalog as is; one source (or a folder / Hub id) as a one-dataset one."""
    if isinstance(tasks, TaskCatalog):
        return tasks
    if isinstance(tasks, (str, Path)):
        return TaskCatalog.open([str(tasks)])
    name = str(tasks.root) if isinstance(tasks, LocalTaskSource) else getattr(tasks, "repo_id", repr(tasks))
    return TaskCatalog({name: tasks})
