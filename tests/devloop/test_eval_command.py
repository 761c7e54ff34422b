"""``harness-trainer eval`` on saved checkpoints: a real process, a real engine, the toy agent in local
sandboxes; and the model folder it serves (tokenizer found, adapter merged)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from harness_trainer.devloop.evaluate import CheckpointError, checkpoint_model, servable_folder
from harness_trainer.trainer.feed.evaluation import read_eval_rollouts
from tests.rollouts.conftest import EXAMPLES, live_sandbox_processes

ROOT = Path(__file__).resolve().parents[2]


def checkpoint(tmp_path: Path, tiny_model_dir: Path, *, name_model: bool = True) -> Path:
    """A run's checkpoint as the trainer writes it: model/ without a tokenizer, the state naming the model."""
    folder = tmp_path / "run" / "checkpoint-3"
    (folder / "model").mkdir(parents=True)
    for file in ("config.json", "model.safetensors"):
        shutil.copy2(tiny_model_dir / file, folder / "model" / file)
    extra = {"model": str(tiny_model_dir)} if name_model else {}
    (folder / "trainer_state.json").write_text(json.dumps({"step": 3, "policy_version": 3, "extra": extra}))
    return folder


def tasks_with_a_test_split(tmp_path: Path) -> Path:
    for split, name in (("train", "hello-file"), ("test", "greet-script"), ("test", "sum-numbers")):
        shutil.copytree(EXAMPLES / split / name, tmp_path / "tasks" / split / name)
    return tmp_path / "tasks"


def run_eval(*args: str, tmp: Path | None = None) -> subprocess.CompletedProcess:
    """``harness-trainer eval ARGS``; with ``tmp``, its temporary folders (the merged model the engine
    serves) go there, so a test can tell its own engines from another test's running at the same time."""
    env = {**os.environ, "TMPDIR": str(tmp)} if tmp is not None else None
    if tmp is not None:
        tmp.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", "harness_trainer.cli", "eval", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip


@pytest.mark.slow
def test_eval_rolls_each_task_of_the_split_out_k_times_and_records_the_checkpoints_step(
    tmp_path, tiny_model_dir
):
    folder = checkpoint(tmp_path, tiny_model_dir)
    done = run_eval(
        "--checkpoint", str(folder), "--split", "test", "-k", "2",
        "--tasks", str(tasks_with_a_test_split(tmp_path)), "--harness", "toy", "--temperature", "0.7",
        "--max-completion-length", "32",
        "--output-dir", str(tmp_path / "eval"), tmp=tmp_path / "tmp",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "eval" / "eval.jsonl").read_text().splitlines()]
    assert [(r["task_name"], r["step"], r["policy_version"], r["k"], r["split"]) for r in records] == [
        ("greet-script", 3, 3, 2, "test"), ("sum-numbers", 3, 3, 2, "test"),
    ]  # fmt: skip
    assert all(len(r["rewards"]) == 2 and r["temperature"] == 0.7 for r in records)
    # k samples per task, each with its reward and, when it was scored, its real trace.
    samples = read_eval_rollouts(tmp_path / "eval")
    assert sorted((s.task_name, s.step, s.member) for s in samples) == [
        (name, 3, member) for name in ("greet-script", "sum-numbers") for member in (0, 1)
    ]
    rewards = {r["task_name"]: r["rewards"] for r in records}
    assert all(s.reward == rewards[s.task_name][s.member] for s in samples)
    assert all(s.trace is not None and s.trace.turns for s in samples if s.unscorable is None)
    assert "greet-script: pass@1" in done.stdout and "mean over 2 tasks: pass@1" in done.stdout
    assert live_sandbox_processes() == [] and engines_serving_eval_folders(tmp_path / "tmp") == []


@pytest.mark.slow
def test_eval_with_several_harnesses_rolls_each_task_out_k_times_under_each_and_reports_each(
    tmp_path, tiny_model_dir
):
    mix = ("toy", "mini-swe-agent")
    done = run_eval(
        "--checkpoint", str(checkpoint(tmp_path, tiny_model_dir)), "--split", "test", "-k", "2",
        "--tasks", str(tasks_with_a_test_split(tmp_path)), "--harness", ",".join(mix),
        "--max-completion-length", "32", "--output-dir", str(tmp_path / "eval"), tmp=tmp_path / "tmp",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "eval" / "eval.jsonl").read_text().splitlines()]
    tasks = ("greet-script", "sum-numbers")
    assert [(r["task_name"], r["harness"], len(r["rewards"])) for r in records] == [
        (name, harness, 2) for harness in mix for name in tasks
    ]
    samples = read_eval_rollouts(tmp_path / "eval")
    assert sorted((s.harness, s.task_name, s.member) for s in samples) == sorted(
        (harness, name, member) for harness in mix for name in tasks for member in (0, 1)
    )
    for harness in mix:
        assert f"greet-script under {harness}: pass@1" in done.stdout
        assert f"\n{harness}: pass@1" in done.stdout
    assert "mean over 2 tasks: pass@1" in done.stdout
    assert live_sandbox_processes() == [] and engines_serving_eval_folders(tmp_path / "tmp") == []


def engines_serving_eval_folders(under: Path) -> list[str]:
    """Command lines of processes serving a folder `harness-trainer eval` made under ``under`` (its
    engines; another test's eval may be running at the same time, with its own)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"{under}/ht-eval-" in text and "--model" in text:
            found.append(text)
    return found


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--split", "nope"], "no split 'nope' in"),
        (["-k", "0"], "-k must be at least 1"),
    ],
)
def test_eval_refuses_bad_input_before_starting_anything(tmp_path, tiny_model_dir, args, message):
    folder = checkpoint(tmp_path, tiny_model_dir)
    done = run_eval("--checkpoint", str(folder), "--tasks", str(tasks_with_a_test_split(tmp_path)), *args)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not list(tmp_path.glob("eval-*"))


def test_a_checkpoint_without_a_tokenizer_takes_the_trained_models_or_says_what_to_pass(
    tmp_path, tiny_model_dir
):
    model, state = checkpoint_model(checkpoint(tmp_path, tiny_model_dir))
    assert model.name == "model" and state["step"] == 3
    served = servable_folder(model, state["extra"]["model"], None, tmp_path / "served")
    assert (served / "tokenizer_config.json").is_file()
    assert (served / "model.safetensors").resolve() == (model / "model.safetensors").resolve()
    bare = checkpoint(tmp_path / "bare", tiny_model_dir, name_model=False)
    with pytest.raises(CheckpointError, match="pass --tokenizer"):
        servable_folder(bare / "model", None, None, tmp_path / "served-bare")
    assert (
        servable_folder(bare / "model", None, tiny_model_dir, tmp_path / "with") / "tokenizer_config.json"
    ).is_file()
    with pytest.raises(CheckpointError, match="no model in"):
        checkpoint_model(tmp_path)


def test_a_lora_checkpoint_is_served_merged_into_its_base(tmp_path, tiny_model_dir):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig(r=4, target_modules=["q_proj"])
    )
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.fill_(0.01)  # a trained adapter: B is no longer 0
    model.save_pretrained(tmp_path / "adapter")
    served = servable_folder(tmp_path / "adapter", None, None, tmp_path / "served")
    merged = AutoModelForCausalLM.from_pretrained(served)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged.state_dict()[name], base.state_dict()[name])
    assert torch.allclose(merged.state_dict()[name], model.merge_and_unload().state_dict()[name])
    assert (served / "tokenizer_config.json").is_file()
