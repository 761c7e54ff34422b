"""``harness-trainer export-sft``: a run's accepted rollouts as an SFT dataset: conversational messages and
the engine's exact tokens per row, each trajectory once, in three formats, loaded and trained on by TRL's
SFTTrainer; bad input says why and writes nothing."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from harness_trainer.cli import main
from harness_trainer.trace import TrainingTrace, load_trace
from harness_trainer.trainer.feed.evaluation import EVAL_ROLLOUTS_FILE
from harness_trainer.trainer.feed.rollout_log import ROLLOUTS_FILE, RolloutLog, read_rollout_log
from harness_trainer.trainer.feed.rollout_records import RolloutRecord
from harness_trainer.trainer.sft_export import COLUMNS, ExportError, export_sft, sft_rows, trace_rows

BASH = {"type": "function", "function": {"name": "bash", "parameters": {"type": "object", "properties": {
    "command": {"type": "string"}}, "required": ["command"]}}}  # fmt: skip
SYSTEM = {"role": "system", "content": "You are a coding agent."}
USER = {"role": "user", "content": [{"type": "text", "text": "Create hello.txt"}]}  # parts, as some send


def call(name: str, arguments: str, call_id: str) -> dict[str, Any]:
    """A tool call as the engine returns it and the agent sends it back: OpenAI's, arguments as JSON text."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def turn(node: str, prompt: list[int], completion: list[int], messages: list, reply: dict, mask=None) -> dict:
    return {
        "node_id": node, "prompt_token_ids": prompt, "completion_token_ids": completion,
        "per_token_logps": [-0.5] * len(completion),
        "loss_mask": [0] * len(prompt) + (mask if mask is not None else [1] * len(completion)),
        "request": {"messages": messages, "tools": [BASH], "temperature": 1.0},
        "response": {"choices": [{"message": {"role": "assistant", "refusal": None, **reply}}]},
    }  # fmt: skip


def conversation(tag: int = 0, *, rewritten: bool = False, mask: list[int] | None = None) -> TrainingTrace:
    """Two calls of an agent: it runs a command, reads its output, then submits (a tool call as its last
    reply, as mini-swe-agent ends). ``rewritten``: the second call's prompt does not extend the first's
    (a compacted history), so each call is a row of its own."""
    first_reply = {"content": None, "tool_calls": [call("bash", '{"command": "ls"}', "c1")]}
    history = [SYSTEM, USER, {"role": "assistant", **first_reply}, {"role": "tool", "tool_call_id": "c1",
               "content": "hello.txt"}]  # fmt: skip
    prompt = [1, 2, 3 + tag]
    second_prompt = [1, 2, 3 + tag, 99, 20, 21] if rewritten else [*prompt, 10, 11, 12, 20, 21]
    return load_trace({"turns": [
        turn("n0", prompt, [10, 11, 12], [SYSTEM, USER], first_reply, mask),
        turn("n1", second_prompt, [30, 31], history,
             {"content": "Done.", "tool_calls": [call("submit", "{}", "c2")]}, mask and mask[:2]),
    ]})  # fmt: skip


def with_an_image() -> TrainingTrace:
    """A conversation whose task came with an image: not text, so not a row of a text dataset."""
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}
    turns = [t.model_copy(update={"request": {"messages": [SYSTEM, image]}}) for t in conversation().turns]
    return conversation().model_copy(update={"turns": turns})


def test_a_trace_is_one_row_of_its_conversation_and_its_exact_tokens() -> None:
    (row,) = trace_rows(conversation())
    assert row["prompt_ids"] == [1, 2, 3]
    # Sampled ids are 1, the tool result's ids (20, 21) between the two calls are 0: context, not trained.
    assert row["completion_ids"] == [10, 11, 12, 20, 21, 30, 31]
    assert row["completion_mask"] == [1, 1, 1, 0, 0, 1, 1]
    assert json.loads(row["tools"]) == [BASH]
    # The conversation as chat templates take it: text content, arguments as objects, roles kept; the last
    # reply with its tool call (TRL's transcript keeps its text alone).
    assert row["messages"] == [
        SYSTEM,
        {"role": "user", "content": "Create hello.txt"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": {"command": "ls"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "hello.txt"},
        {"role": "assistant", "content": "Done.", "tool_calls": [
            {"id": "c2", "type": "function", "function": {"name": "submit", "arguments": {}}}]},
    ]  # fmt: skip


def test_a_rewritten_history_gives_a_row_per_call_each_with_its_own_conversation() -> None:
    first, second = trace_rows(conversation(rewritten=True))
    assert (first["prompt_ids"], first["completion_ids"]) == ([1, 2, 3], [10, 11, 12])
    assert first["completion_mask"] == [1, 1, 1] and len(first["messages"]) == 3
    assert first["messages"][-1]["tool_calls"][0]["function"]["name"] == "bash"
    assert (second["prompt_ids"], second["completion_ids"]) == ([1, 2, 3, 99, 20, 21], [30, 31])
    assert second["messages"][-1]["content"] == "Done." and len(second["messages"]) == 5


def record(group: int, reward: float | None, trace: TrainingTrace | None, member: int = 0) -> RolloutRecord:
    return RolloutRecord(
        group=group, member=member, rollout_id=f"group{group}-member{member}", task_name=f"task-{group}",
        reward=reward, trace=trace,
    )  # fmt: skip


def write_run(run: Path, records: list[RolloutRecord]) -> None:
    with RolloutLog(run) as log:
        log.write(records)


MIXED = [
    record(0, None, conversation(0)),  # ungraded: never accepted, whatever the threshold
    record(1, 0.5, conversation(1)),
    record(2, 1.0, conversation(2)),
    record(3, 1.0, conversation(2)),  # the same trajectory as group 2's: dropped
    record(4, 1.0, None),  # its trace not logged (rollout_log_steps): skipped
    record(5, 2.0, conversation(5, mask=[0, 0, 0])),  # nothing trained in it: skipped
    record(6, 1.5, conversation(6, rewritten=True)),
]


def test_accepted_rollouts_are_those_rewarded_at_least_the_threshold_with_a_trace_each_trajectory_once(
    tmp_path: Path,
) -> None:
    write_run(tmp_path, MIXED)
    rows, summary = sft_rows(read_rollout_log(tmp_path), min_reward=1.0)
    assert [(row["rollout_id"], row["task_name"], row["reward"]) for row in rows] == [
        ("group2-member0", "task-2", 1.0),
        ("group6-member0", "task-6", 1.5),  # a row per call of its rewritten history
        ("group6-member0", "task-6", 1.5),
    ]
    assert rows[0]["prompt_ids"] == [1, 2, 5]
    assert (summary.rollouts, summary.accepted, summary.without_trace, summary.without_tokens) == (7, 5, 1, 1)
    assert (summary.rows, summary.duplicates, summary.written) == (4, 1, 3)
    # At the threshold counts: 0.5 is accepted at 0.5, the ungraded one never.
    at_half, _ = sft_rows(read_rollout_log(tmp_path), 0.5)
    assert [row["rollout_id"] for row in at_half][:1] == ["group1-member0"]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "hf"])
def test_each_format_loads_back_as_the_rows_written(tmp_path: Path, fmt: str, capsys) -> None:
    import datasets

    write_run(tmp_path / "run", MIXED)
    assert main(["export-sft", str(tmp_path / "run"), "--min-reward", "1", "--format", fmt]) == 0
    out = tmp_path / "run" / {"jsonl": "sft.jsonl", "parquet": "sft.parquet", "hf": "sft"}[fmt]
    said = capsys.readouterr().out
    assert "7 rollouts, 5 accepted" in said and "1 dropped as duplicate trajectories, 3 kept" in said
    assert str(out) in said
    if fmt == "hf":
        loaded = datasets.load_from_disk(str(out))
    else:
        kind = "json" if fmt == "jsonl" else "parquet"
        loaded = datasets.load_dataset(kind, data_files=str(out), split="train", cache_dir=str(tmp_path))
    rows, _ = sft_rows(read_rollout_log(tmp_path / "run"), 1.0)
    assert loaded.column_names == list(COLUMNS)
    # Messages of different shapes (tool calls or not, different argument keys) come back as they were.
    assert [dict(row) for row in loaded] == [{c: row[c] for c in COLUMNS} for row in rows]
    assert sorted(p.name for p in out.parent.iterdir() if p.name.startswith(".")) == []  # no temporary left


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize(
    ("records", "args", "message"),
    [
        (None, [], "has no rollouts.jsonl"),
        ([], [], "holds no rollouts"),
        (MIXED, ["--min-reward", "3"], "no rollout of .* has a reward >= 3 \\(7 rollouts, best reward 2\\)"),
        ([record(0, 1.0, None), record(1, 0.0, conversation())], [],
         "none of the 1 accepted rollouts .* has a trace with a trained token \\(1 without a trace, 0 "
         "without a trained token; rollout_log_steps=N keeps"),
        (MIXED, ["--min-reward", "nan"], "must be a finite number"),
        ([record(0, 1.0, with_an_image())], [],
         "rollout group0-member0 \\(group 0\\): messages\\[1\\]: only text content parts are supported"),
        (MIXED, ["--source", "eval"], "has no eval_rollouts.jsonl"),
    ],
)  # fmt: skip
def test_bad_input_says_why_on_stderr_exits_1_and_writes_nothing(
    tmp_path: Path, records: list[RolloutRecord] | None, args: list[str], message: str, capsys
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    if records is not None:
        write_run(run, records)
    before = listing(tmp_path)
    args = args if any(a == "--min-reward" for a in args) else [*args, "--min-reward", "1"]
    assert main(["export-sft", str(run), *args]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    assert re.search(message, err), err
    assert listing(tmp_path) == before


def test_a_missing_path_exits_1_from_the_console_script_without_a_traceback(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "harness-trainer"
    result = subprocess.run(
        [str(script), "export-sft", str(tmp_path / "nowhere"), "--min-reward", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.strip() == f"error: {tmp_path / 'nowhere'} does not exist"


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "hf"])
def test_a_failed_write_leaves_no_partial_output_and_keeps_the_earlier_export(
    tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from harness_trainer.trainer import sft_export

    write_run(tmp_path, MIXED)
    out, _ = export_sft(tmp_path, min_reward=1.5, fmt=fmt)  # group 6's two rows
    before = listing(tmp_path)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise OSError("disk full")

    monkeypatch.setattr(sft_export.orjson, "dumps", broken)
    monkeypatch.setattr(sft_export, "_dataset", broken)
    with pytest.raises(OSError, match="disk full"):
        export_sft(tmp_path, min_reward=1.0, fmt=fmt)
    assert listing(tmp_path) == before
    monkeypatch.undo()
    export_sft(tmp_path, min_reward=1.0, fmt=fmt)  # replaced whole
    assert listing(tmp_path) == before and out.exists()


def test_an_hf_export_never_replaces_a_folder_that_is_not_a_saved_dataset(tmp_path: Path) -> None:
    write_run(tmp_path, MIXED)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ExportError, match="is not a saved dataset"):
        export_sft(tmp_path, min_reward=1.0, fmt="hf", output=tmp_path / "mine")
    with pytest.raises(ExportError, match="is a folder: --format jsonl writes a file"):
        export_sft(tmp_path, min_reward=1.0, output=tmp_path / "mine")
    assert listing(tmp_path / "mine") == ["notes.txt"]


def test_an_evaluation_s_samples_export_from_the_run_folder_or_their_file(tmp_path: Path) -> None:
    # Written as the evaluator writes them: one record a line, the evaluation's step set.
    samples = [record(0, 1.0, conversation(7)).model_copy(update={"step": 5}), record(1, 0, conversation(8))]
    (tmp_path / EVAL_ROLLOUTS_FILE).write_text("".join(s.model_dump_json() + "\n" for s in samples))
    out, summary = export_sft(tmp_path, min_reward=1.0, source="eval")
    assert out == tmp_path / "sft-eval.jsonl" and (summary.rollouts, summary.written) == (2, 1)
    assert json.loads(out.read_text())["prompt_ids"] == [1, 2, 10]
    out, _ = export_sft(tmp_path / EVAL_ROLLOUTS_FILE, min_reward=1.0, output=tmp_path / "direct.jsonl")
    assert out.read_text() == (tmp_path / "sft-eval.jsonl").read_text()
    with pytest.raises(ExportError, match="--source rollouts does not match"):
        export_sft(tmp_path / EVAL_ROLLOUTS_FILE, min_reward=1.0, source="rollouts")
    with pytest.raises(ExportError, match=f"has no {ROLLOUTS_FILE}"):
        export_sft(tmp_path, min_reward=1.0)


# A real run, once for the tests below: the trainer's first step on the toy agent in local sandboxes,
# against a dev engine replaying a solver and a give-up reply (tests/trainer/test_trainer_local.py's).
@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    from harness_trainer import AsyncGRPOConfig, HarnessAsyncGRPOTrainer, LocalSessionFactory
    from harness_trainer.dev_engine.process import start_engine
    from harness_trainer.tasks.sources import LocalTaskSource
    from tests.rollouts.conftest import EXAMPLES, bash_call

    work = tmp_path_factory.mktemp("real-run")
    solve = [bash_call("printf 'Hello, Harbor!\\n' > /app/hello.txt"), {"content": "Done."}]
    script = work / "script.jsonl"
    script.write_text("\n".join(json.dumps(reply) for reply in [*solve, {"content": "I cannot."}] * 6))
    engine = start_engine(tiny_model_dir, "--script", str(script), name="tiny")
    try:
        rows = [r for r in LocalTaskSource(EXAMPLES).prompt_rows("train") if r["task_name"] == "hello-file"]
        config = AsyncGRPOConfig(
            output_dir=str(work / "out"), engine="dev", vllm_server_base_url=engine.url, num_generations=2,
            max_concurrent_rollouts=1, max_staleness=0, max_steps=1, learning_rate=1e-4, disable_tqdm=True,
            rollout_timeout=120, token_budget=4096,
        )  # fmt: skip
        factory = partial(
            LocalSessionFactory, str(EXAMPLES), upstream=engine.url, split="train", harness="toy"
        )
        HarnessAsyncGRPOTrainer(str(tiny_model_dir), factory, config, train_dataset=rows).train()
    finally:
        engine.stop()
    return work / "out"


def sft_trainer_step(dataset: Any, model: Path, out: Path, **config: Any) -> Any:
    """One SFTTrainer step on ``dataset``, on the CPU; returns the trainer."""
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(
        output_dir=str(out), max_steps=1, per_device_train_batch_size=1, report_to="none", save_strategy="no",
        use_cpu=True, disable_tqdm=True, **config,
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(model)
    trainer = SFTTrainer(model=str(model), args=args, train_dataset=dataset, processing_class=tokenizer)
    result = trainer.train()
    assert result.global_step == 1 and result.training_loss > 0
    return trainer


@pytest.mark.slow
def test_a_real_run_s_solved_rollouts_export_once_and_their_messages_render_to_the_sampled_tokens(
    real_run: Path, tiny_model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    script = Path(sys.executable).parent / "harness-trainer"
    result = subprocess.run(
        [str(script), "export-sft", str(real_run), "--min-reward", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    # The solvers all sampled the same ids (the scripted reply): one trajectory; the give-ups fail. Which
    # rollouts got which replies is the run's (the scripted engine answers calls in arrival order), so the
    # counts are read from its log, not assumed.
    solved = [r.rollout_id for r in read_rollout_log(real_run) if r.reward is not None and r.reward >= 1]
    assert solved, "the run solved nothing: nothing to export"
    assert f"4 rollouts, {len(solved)} accepted (reward >= 1)" in result.stdout
    assert f"{len(solved)} rows, {len(solved) - 1} dropped as duplicate trajectories, 1 kept" in result.stdout
    (row,) = [json.loads(line) for line in (real_run / "sft.jsonl").read_text().splitlines()]
    assert (row["task_name"], row["reward"], row["rollout_id"]) == ("hello-file", 1.0, solved[0])
    roles = [m["role"] for m in row["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    assert row["messages"][2]["tool_calls"][0]["function"]["arguments"] == {
        "command": "printf 'Hello, Harbor!\\n' > /app/hello.txt"
    }
    # The model's chat template renders the messages and tools to the very ids the engine had: the two
    # representations agree (then the template's newline after the last <|im_end|>).
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tokenizer.apply_chat_template(row["messages"], tools=json.loads(row["tools"]), return_dict=True)[
        "input_ids"
    ]
    sequence = row["prompt_ids"] + row["completion_ids"]
    assert ids[: len(sequence)] == sequence and tokenizer.decode(ids[len(sequence) :]) == "\n"
    trace = next(r.trace for r in read_rollout_log(real_run) if r.rollout_id == solved[0])
    assert trace is not None and sum(row["completion_mask"]) == sum(
        sum(turn.loss_mask) for turn in trace.turns
    )  # every sampled token, each once; the tool's output between the calls is not


@pytest.mark.slow
def test_sft_trainer_takes_a_step_on_the_exported_jsonl_and_hf_dataset_as_they_are(
    real_run: Path, tiny_model_dir: Path, tmp_path: Path, fresh_accelerate: None
) -> None:
    import datasets

    run = tmp_path / "run"
    shutil.copytree(real_run, run, ignore=shutil.ignore_patterns("checkpoint-*", "sft*"))
    export_sft(run, min_reward=0.0)
    export_sft(run, min_reward=0.0, fmt="hf")
    files = str(run / "sft.jsonl")
    jsonl = datasets.load_dataset("json", data_files=files, split="train", cache_dir=str(tmp_path))
    hf = datasets.load_from_disk(str(run / "sft"))
    assert len(jsonl) == len(hf) == 2  # the solver and the give-up, each once
    for dataset in (jsonl, hf):
        trainer = sft_trainer_step(dataset, tiny_model_dir, tmp_path / "sft-out")
        # It tokenised the messages with the chat template: the sampled ids, every token trained.
        assert trainer.train_dataset[0]["input_ids"][:-1] == hf[0]["prompt_ids"] + hf[0]["completion_ids"]

    # The exact tokens, as SFTTrainer's pre-tokenised form: only the sampled tokens are trained.
    def pretokenized(row: dict[str, Any]) -> dict[str, list[int]]:
        return {
            "input_ids": row["prompt_ids"] + row["completion_ids"],
            "completion_mask": [0] * len(row["prompt_ids"]) + row["completion_mask"],
        }

    tokens = hf.map(pretokenized, remove_columns=hf.column_names)
    trainer = sft_trainer_step(tokens, tiny_model_dir, tmp_path / "sft-tokens", completion_only_loss=True)
    labels = trainer.train_dataset[0]["labels"]
    assert sum(label != -100 for label in labels) == sum(hf[0]["completion_mask"])
