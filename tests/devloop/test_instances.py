"""Transcripts made from a template's one recording: the grouping, the swap, its refusals, and (slow) a made
transcript against a real recording of the same task through the real agent."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from harness_trainer.devloop.instances import (
    common_prefix,
    instance_rows,
    plan_recordings,
    swap,
    template_key,
)
from harness_trainer.devloop.prompts import dev_harness_options
from harness_trainer.devloop.solver import WHITE_BOX
from harness_trainer.devloop.warmup import DISTRACTOR_SUFFIX, collect_transcripts
from harness_trainer.tasks.held_out import task_values
from harness_trainer.tasks.sources import LocalTaskSource
from harness_trainer.tasks.toy_family import WORDINGS, write_family
from harness_trainer.trainer.step.rows import Row, build_rows
from tests.rollouts.conftest import EXAMPLES, live_sandbox_processes


@pytest.fixture
def family(tmp_path: Path) -> Path:
    root = tmp_path / "family"
    write_family(root, per_skill={"train": 6, "test": 1})
    return root


def test_a_family_s_tasks_group_by_skill_and_wording_and_one_per_group_is_recorded(family: Path) -> None:
    tasks = LocalTaskSource(family).tasks("train")
    templates = plan_recordings(tasks)
    # Wordings are taken in turn per skill: 6 tasks of a skill are 3 of each of its 2 wordings.
    assert len(templates) == sum(len(w) for w in WORDINGS.values()) == 8
    assert all(len(t.members) == 3 for t in templates)
    assert sorted(name for t in templates for name, _ in t.members) == sorted(t.name for t in tasks)
    for template in templates:
        assert template.members[0][0] == template.recorded
        skills = {name.rsplit("-", 2)[0] + name[-3:] for name, _ in template.members}  # skill and wording
        assert len(skills) == 1
        assert len({values for _, values in template.members}) == 3
    first = tasks[0]
    assert task_values(first) == (first.name.split("-")[-2],)


def test_a_task_without_numeric_values_is_its_own_template() -> None:
    tasks = LocalTaskSource(EXAMPLES).tasks("train")
    assert all(template_key(task) is None for task in tasks)
    assert [t.recorded for t in plan_recordings(tasks)] == [t.name for t in tasks]


def test_the_swap_replaces_every_occurrence_and_keeps_every_position() -> None:
    assert swap([1, 2, 3, 9, 1, 2, 3], [1, 2, 3], [4, 5, 6]) == ([4, 5, 6, 9, 4, 5, 6], [0, 4])
    with pytest.raises(ValueError, match="keeps every position"):
        swap([1, 2], [1, 2], [3])
    digits = list(range(100, 110))
    row = Row(0, [7, 7, 101, 102, 103, 8, 101, 102, 103], [0, 0, 0, 0, 0, 1, 1, 1, 1], [0.0] * 5 + [-1.0] * 4)
    made = instance_rows([row], ["123"], ["456"], digits, preamble=2)
    assert made[0].input_ids == [7, 7, 104, 105, 106, 8, 104, 105, 106]
    assert made[0].targets == row.targets and made[0].behaviour_logps == row.behaviour_logps
    with pytest.raises(ValueError, match="value 999 of the recorded transcript stands nowhere"):
        instance_rows([row], ["999"], ["456"], digits, preamble=2)
    with pytest.raises(ValueError, match=r"stands at 2, in the agent's prompt \(first 3 ids\)"):
        instance_rows([row], ["123"], ["456"], digits, preamble=3)
    assert common_prefix([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2
    assert common_prefix([[1, 2, 3]]) == 0  # one recording: its preamble is unknown


# Two tasks of one template recorded through each real agent (mini-swe-agent with the dev loop's prompt, and
# white-box): the transcript made from the first is the second's recording.
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("harness", ["mini-swe-agent", WHITE_BOX])
def test_a_made_transcript_is_the_real_recording_id_for_id(
    tmp_path: Path, family: Path, tiny_model_dir: Path, harness: str
) -> None:
    source = LocalTaskSource(family)
    templates = plan_recordings(source.tasks("train"))
    first, second = templates[0].members[:2]
    other = templates[1].recorded  # a second template: the preamble is what both start with
    work = tmp_path / "work"
    work.mkdir()
    options = {} if harness == WHITE_BOX else dev_harness_options(harness)
    traces = collect_transcripts(
        source, "train", harness, tiny_model_dir, work, distractors=True, harness_options=options,
        only={first[0], second[0], other},
    )  # fmt: skip
    assert len(traces) == 6 and live_sandbox_processes() == []
    digits = AutoTokenizer.from_pretrained(tiny_model_dir).convert_tokens_to_ids(list("0123456789"))
    preamble = common_prefix([build_rows(traces[name], rollout=0)[0].input_ids for name in (first[0], other)])
    assert preamble > 50
    for kind in ("", DISTRACTOR_SUFFIX):
        made = instance_rows(build_rows(traces[first[0] + kind], rollout=0), first[1], second[1], digits,
                             preamble=preamble)  # fmt: skip
        real = build_rows(traces[second[0] + kind], rollout=0)
        assert [m.targets for m in made] == [r.targets for r in real]
        if kind == "":
            assert [m.input_ids for m in made] == [r.input_ids for r in real]
        else:  # ls -la prints the recording's clock; what is trained is the same
            assert [[i for i, t in zip(m.input_ids, m.targets, strict=True) if t] for m in made] == [
                [i for i, t in zip(r.input_ids, r.targets, strict=True) if t] for r in real
            ]


# The warm-up's wiring, kept short: the toy agent, 2 fine-tuning steps.
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_warm_up_records_one_task_per_template_and_trains_on_every_task_s_transcripts(
    tmp_path: Path, family: Path, tiny_model_dir: Path
) -> None:
    import json

    from harness_trainer.devloop.warmup import WarmupRecipe, ensure_warm_model

    base = tmp_path / "models" / tiny_model_dir.name
    base.parent.mkdir()
    base.symlink_to(tiny_model_dir)  # the warm model is cached next to its base: here, under tmp_path
    said: list[str] = []
    recipe = WarmupRecipe("toy", max_steps=2, batch_size=4)
    warm = ensure_warm_model(LocalTaskSource(family), "train", base, recipe, log=said.append)
    assert said[0].endswith("recording 8 solver transcripts and as many distractors (8 of 24 tasks: one per "
                            "template) through toy")  # fmt: skip
    assert said[1] == "warm-up: made 32 more transcripts from those, each with its own task's numbers"
    written = json.loads((warm / "warmup.json").read_text())
    assert written["report"]["transcripts"] == 48 and written["report"]["steps"] == 2
    assert len(written["report"]["per_task"]) == 16  # the recorded ones, measured
    assert len(written["trained_on"]) == 24
    assert live_sandbox_processes() == []
