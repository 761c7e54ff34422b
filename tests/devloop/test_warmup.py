"""The dev loop's warm-up: solver transcripts through a real agent, then a fine-tune to a set probability."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from harness_trainer.devloop.prompts import MINI_SWE_AGENT_COMPACT, dev_harness_options
from harness_trainer.devloop.solver import (
    DISTRACTOR,
    WHITE_BOX,
    distractor_replies,
    solve_command,
    solver_replies,
)
from harness_trainer.devloop.warmup import DISTRACTOR_SUFFIX, WarmupRecipe, collect_transcripts, fine_tune
from harness_trainer.harnesses.mini_swe_agent import SUBMIT_COMMAND as MINI_SUBMIT
from harness_trainer.tasks.sources import LocalTaskSource
from tests.rollouts.conftest import EXAMPLES, live_sandbox_processes


def test_solver_transcripts_use_each_harness_shell_tool_and_way_of_finishing() -> None:
    task = LocalTaskSource(EXAMPLES).task("train", 3)
    command = solve_command(task)
    assert "#" not in command and "set -euo" not in command and command.strip()
    mini = solver_replies("mini-swe-agent", task)
    assert mini[0]["tool_calls"][0]["function"]["arguments"] == {"command": command}
    assert mini[1]["tool_calls"][0]["function"]["arguments"] == {"command": MINI_SUBMIT}
    assert solver_replies("opencode", task)[1] == {"content": "Done."}
    wrong = distractor_replies("mini-swe-agent")
    assert (
        wrong[0]["tool_calls"][0]["function"]["arguments"] == {"command": DISTRACTOR} and wrong[1] == mini[1]
    )
    codex = solver_replies("codex", task)  # its own shell tool and argument
    assert codex[0]["tool_calls"][0]["function"] == {"name": "exec_command", "arguments": {"cmd": command}}
    with pytest.raises(ValueError, match="no solver transcript format"):
        solver_replies("no-such-agent", task)


# About 100 s alone on 2 cores; past 300 s (the suite's default) when other work shared them.
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_transcripts_solve_their_tasks_distractors_fail_them_and_the_fine_tune_reaches_its_target(
    tmp_path, tiny_model_dir
):
    tasks = tmp_path / "tasks" / "train"
    shutil.copytree(EXAMPLES / "train" / "hello-file", tasks / "hello-file")
    shutil.copytree(EXAMPLES / "train" / "count-lines", tasks / "count-lines")
    source = LocalTaskSource(tmp_path / "tasks")
    work = tmp_path / "work"
    work.mkdir()
    traces = collect_transcripts(source, "train", "toy", tiny_model_dir, work, distractors=True)
    names = ["count-lines", "hello-file"]
    assert sorted(traces) == sorted(names + [name + DISTRACTOR_SUFFIX for name in names])
    assert all(len(trace.turns) == 2 for trace in traces.values())
    assert live_sandbox_processes() == []

    seen = []
    recipe = WarmupRecipe("toy", target_probability=0.3, learning_rate=3e-3, max_steps=150)
    report = fine_tune(tiny_model_dir, traces, tmp_path / "warm", recipe, on_step=lambda s, p: seen.append(p))
    assert report.probability >= 0.3 and seen[0] < 1e-3 and report.steps < 150
    assert set(report.per_task) == set(traces)
    # Equal weights: the model acts either way, neither transcript taking all the mass.
    assert all(0.1 < report.per_task[name + DISTRACTOR_SUFFIX] < 0.6 for name in names)
    AutoModelForCausalLM.from_pretrained(tmp_path / "warm")
    assert (tmp_path / "warm" / "tokenizer_config.json").exists()


def test_the_dev_loop_runs_mini_with_its_compact_prompt_unless_told_and_warms_up_on_the_prompt_it_runs(
    tmp_path: Path,
) -> None:
    compact = dev_harness_options("mini-swe-agent")
    assert compact == {"agent_config": MINI_SWE_AGENT_COMPACT}
    assert dev_harness_options("mini-swe-agent", stock_prompt=True) == {}
    assert dev_harness_options("toy") == {}  # no compact prompt of its own: its own prompts
    instance = MINI_SWE_AGENT_COMPACT["agent"]["instance_template"]
    assert MINI_SUBMIT in instance and instance.rstrip().endswith("Task: {{task}}")  # rules first: shared ids
    # A warm model is keyed by the prompts its transcripts were recorded with: never reused for the other.
    base, tasks = tmp_path / "tiny", ["a", "b"]
    assert WarmupRecipe("mini-swe-agent", compact).fingerprint(base, tasks) != WarmupRecipe(
        "mini-swe-agent"
    ).fingerprint(base, tasks)


@pytest.mark.slow
def test_white_box_transcripts_are_the_built_in_adapters_episodes_through_the_trainers_model_step(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The scripted engine answers the model step's token-id prompts; ReActAdapter runs each reply's bash
    call in a real local sandbox, then submit ends the episode; the solver passes, the distractor fails
    (collect_transcripts checks both), and each transcript is the step's own two turns."""
    tasks = tmp_path / "tasks" / "train"
    shutil.copytree(EXAMPLES / "train" / "hello-file", tasks / "hello-file")
    source = LocalTaskSource(tmp_path / "tasks")
    work = tmp_path / "work"
    work.mkdir()
    traces = collect_transcripts(source, "train", WHITE_BOX, tiny_model_dir, work, distractors=True)
    assert sorted(traces) == ["hello-file", "hello-file" + DISTRACTOR_SUFFIX]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for name, trace in traces.items():
        first, second = trace.turns
        command = DISTRACTOR if name.endswith(DISTRACTOR_SUFFIX) else solve_command(source.task("train", 0))
        said = tokenizer.decode(first.completion_token_ids)
        assert '"name": "bash"' in said and json.dumps(command)[1:-1] in said
        assert '"name": "submit"' in tokenizer.decode(second.completion_token_ids)
        # The second turn's prompt extends the first turn's prompt and completion: one root, as trained.
        assert second.prompt_token_ids[: len(first.prompt_token_ids)] == first.prompt_token_ids
    assert live_sandbox_processes() == []


@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [16, 1], ids=["full-batch", "minibatches"])
def test_the_fine_tune_has_no_randomness_so_one_warm_model_serves_every_seed(
    tmp_path, tiny_model_dir, batch_size
):
    """AdamW on fixed transcripts from a fixed base, without dropout, all of them a step or minibatches
    drawn by a generator of its own fixed seed: the global RNG's state changes no weight, so the warm-up's
    recipe holds no seed and every run seed reuses one warm model."""
    import torch

    tasks = tmp_path / "tasks" / "train"
    shutil.copytree(EXAMPLES / "train" / "hello-file", tasks / "hello-file")
    source = LocalTaskSource(tmp_path / "tasks")
    work = tmp_path / "work"
    work.mkdir()
    traces = collect_transcripts(source, "train", "toy", tiny_model_dir, work, distractors=True)
    recipe = WarmupRecipe(
        "toy", learning_rate=3e-3, max_steps=3, target_probability=1.0, batch_size=batch_size
    )
    weights = []
    for seed in (0, 1):
        torch.manual_seed(seed)  # as the run's seed would have left it
        random.seed(seed)
        report = fine_tune(tiny_model_dir, traces, tmp_path / f"warm-{seed}", recipe)
        assert report.transcripts == 2 and report.steps == 3 and set(report.per_task) == set(traces)
        weights.append(AutoModelForCausalLM.from_pretrained(tmp_path / f"warm-{seed}").state_dict())
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
    assert not torch.equal(weights[0]["lm_head.weight"], AutoModelForCausalLM.from_pretrained(tiny_model_dir)
                           .state_dict()["lm_head.weight"])  # fmt: skip
    assert "seed" not in WarmupRecipe.__dataclass_fields__
