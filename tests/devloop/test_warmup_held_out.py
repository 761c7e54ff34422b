"""The warm-up never trains on held-out tasks: it refuses a held-out split and a split that shares an
instruction with one, records what it trained on, and reuses a cached warm model only for the same
instructions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from harness_trainer.devloop.warmup import (
    WarmupRecipe,
    check_not_held_out,
    collect_transcripts,
    ensure_warm_model,
    instruction_digest,
)
from harness_trainer.examples import TOY_SKILLS
from harness_trainer.tasks.sources import LocalTaskSource
from harness_trainer.tasks.toy_family import write_family


@pytest.fixture
def family(tmp_path: Path) -> Path:
    """A small toy-skills family: two instances of each skill in train, one in test."""
    root = tmp_path / "family"
    write_family(root, per_skill={"train": 2, "test": 1})
    return root


def test_the_committed_family_s_train_split_may_be_warmed_up_on_and_its_test_split_may_not(
    tmp_path: Path,
) -> None:
    source = LocalTaskSource(TOY_SKILLS)
    check_not_held_out(source, "train")
    with pytest.raises(ValueError, match="split 'test' is held out for evaluation"):
        check_not_held_out(source, "test")
    # Refused before anything starts: no engine, no agent, no model read.
    with pytest.raises(ValueError, match="held out"):
        collect_transcripts(source, "test", "toy", tmp_path / "no-model", tmp_path)
    with pytest.raises(ValueError, match="held out"):
        ensure_warm_model(source, "test", tmp_path / "no-model", WarmupRecipe("toy"))


def test_a_train_task_with_a_held_out_instruction_is_refused_by_name(family: Path) -> None:
    leaked = sorted((family / "test").iterdir())[0]
    shutil.copytree(leaked, family / "train" / "renamed-copy")
    with pytest.raises(ValueError, match=rf"held-out tasks \['test/{leaked.name}'\]"):
        check_not_held_out(LocalTaskSource(family), "train")


# A real warm-up, kept short: 8 solver transcripts through the toy agent, 2 fine-tuning steps.
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_warm_model_records_only_train_tasks_and_is_not_reused_once_their_instructions_change(
    tmp_path: Path, family: Path, tiny_model_dir: Path
) -> None:
    base = tmp_path / "models" / tiny_model_dir.name
    base.parent.mkdir()
    base.symlink_to(tiny_model_dir)  # the warm model is cached next to its base: here, under tmp_path
    recipe = WarmupRecipe("toy", max_steps=2, distractors=False)
    source = LocalTaskSource(family)
    warm = ensure_warm_model(source, "train", base, recipe, log=lambda line: None)

    recorded = json.loads((warm / "warmup.json").read_text())["trained_on"]
    train, test = source.tasks("train"), source.tasks("test")
    assert [(e["split"], e["task"]) for e in recorded] == [("train", t.name) for t in train]
    assert {e["instruction_sha256"] for e in recorded} == {instruction_digest(t.instruction) for t in train}
    assert not {e["task"] for e in recorded} & {t.name for t in test}
    assert not {e["instruction_sha256"] for e in recorded} & {instruction_digest(t.instruction) for t in test}

    assert ensure_warm_model(LocalTaskSource(family), "train", base, recipe, log=lambda line: None) == warm
    changed = train[0].path / "instruction.md"
    changed.write_text(changed.read_text() + "Then stop.\n")
    with pytest.raises(ValueError, match="trained on other instructions"):
        ensure_warm_model(LocalTaskSource(family), "train", base, recipe, log=lambda line: None)
