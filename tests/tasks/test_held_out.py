"""The leak checker: every test task that shares a solution, a verifier, an expected output or a value with a
training task is reported with the pair, and a benchmark's check refuses such a folder naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness_trainer.tasks import LocalTaskSource
from harness_trainer.tasks.held_out import Leak, check_held_out, find_leaks, leaks_in
from harness_trainer.tasks.toy_family import ToyTask, toy_family, write_family

from .conftest import TOY_SKILLS, TaskWriter, write_task

SOLVE = "#!/bin/bash\necho {}\n"
TEST_SH = "#!/bin/bash\nmkdir -p /logs/verifier\n[ -f /app/{} ] && echo 1 > /logs/verifier/reward.txt\n"


def _task(
    root: Path, relative: str, *, solve: str | None, test: str, values: list[str] | None = None
) -> None:
    toml = 'version = "1.0"\n' + (f"[metadata]\nvalues = {values!r}\n".replace("'", '"') if values else "")
    folder = write_task(root / relative, toml=toml, test_sh=test)
    if solve is not None:
        (folder / "solution").mkdir()
        (folder / "solution" / "solve.sh").write_text(solve)


def test_a_folder_whose_test_tasks_share_nothing_with_train_has_no_leak(tmp_path: Path) -> None:
    _task(tmp_path, "train/a", solve=SOLVE.format("a"), test=TEST_SH.format("a"), values=["a"])
    _task(tmp_path, "test/b", solve=SOLVE.format("b"), test=TEST_SH.format("b"), values=["b"])
    assert leaks_in(tmp_path) == []
    check_held_out(tmp_path)


def test_each_shared_piece_is_reported_with_its_pair(tmp_path: Path) -> None:
    _task(tmp_path, "train/a", solve=SOLVE.format("x"), test=TEST_SH.format("a"), values=["a", "v"])
    _task(tmp_path, "train/b", solve=SOLVE.format("b"), test=TEST_SH.format("t"))
    _task(tmp_path, "test/same-solution", solve=SOLVE.format("x"), test=TEST_SH.format("s"))
    _task(tmp_path, "test/same-verifier", solve=None, test=TEST_SH.format("t"))
    _task(tmp_path, "test/same-value", solve=SOLVE.format("w"), test=TEST_SH.format("w"), values=["w", "v"])
    (tmp_path / "train/b/tests/expected.txt").write_text("42\n")
    _task(tmp_path, "test/same-expected", solve=SOLVE.format("e"), test=TEST_SH.format("e"))
    (tmp_path / "test/same-expected/tests/expected.txt").write_text("42\n")

    assert leaks_in(tmp_path) == [
        Leak("same-expected", "b", "expected output"),
        Leak("same-solution", "a", "solution"),
        Leak("same-value", "a", "value", "v"),
        Leak("same-verifier", "b", "verifier"),
    ]
    with pytest.raises(
        ValueError, match="test task 'same-expected' shares its expected output with train task 'b'"
    ):
        check_held_out(tmp_path)


def test_no_solution_on_either_side_is_not_a_shared_solution(task_writer: TaskWriter, tmp_path: Path) -> None:
    task_writer("train/a", test_sh=TEST_SH.format("a"))
    task_writer("test/b", test_sh=TEST_SH.format("b"))
    assert leaks_in(tmp_path) == []


def test_a_deliberately_leaking_toy_family_is_refused_naming_the_pair(tmp_path: Path) -> None:
    write_family(tmp_path, per_skill={"train": 2, "test": 1}, combined=1)
    check_held_out(tmp_path)  # as generated: held out
    # A test task that is a training task in another wording: same value, so the same solution and verifier.
    trained = toy_family(per_skill={"train": 2, "test": 1}, combined=1)["train"][0]
    copy = ToyTask("test", trained.skills, trained.values, 1 - trained.wording)
    for relative, text in copy.files().items():
        path = tmp_path / "test" / copy.folder / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    shared = {(leak.test, leak.train, leak.shared) for leak in leaks_in(tmp_path)}
    assert shared == {
        (copy.folder, trained.folder, "solution"),
        (copy.folder, trained.folder, "verifier"),
        (copy.folder, trained.folder, "value"),
    }
    with pytest.raises(
        ValueError, match=rf"test task '{copy.folder}' shares its solution with train task '{trained.folder}'"
    ):
        check_held_out(tmp_path)


def test_the_shipped_toy_family_is_held_out() -> None:
    check_held_out(TOY_SKILLS)
    source = LocalTaskSource(TOY_SKILLS)
    assert find_leaks(source.tasks("train"), source.tasks("test")) == []


def test_the_message_names_the_first_leaks_then_counts_the_rest(tmp_path: Path) -> None:
    _task(tmp_path, "train/a", solve=SOLVE.format("x"), test=TEST_SH.format("x"))
    for i in range(4):
        _task(tmp_path, f"test/t{i}", solve=SOLVE.format("x"), test=TEST_SH.format("x"))
    with pytest.raises(
        ValueError, match=r"'t2' shares its solution with train task 'a' \(and 3 more\)"
    ) as caught:
        check_held_out(tmp_path)
    assert "'t2' shares its verifier" not in str(caught.value)
