"""The warm-up of the dev loop's recipe: scripted solver transcripts, captured through the real agent, then a
short supervised fine-tune of the tiny model on exactly those token ids.

The random tiny model never solves a task, so GRPO on it would see only zero rewards. The recipe first
records one solver transcript per task (the dev engine in scripted mode plays the solver, the real agent
runs it in a local sandbox, the capture proxy keeps the ids the agent's own prompt format produced), then
trains on the transcripts' sampled tokens until the model gives each of them a set probability, and saves
the result next to the tiny model, keyed by everything that decides its bytes.

Tasks that are one template with different numbers (a generated family's) are recorded once per template;
the others' transcripts are made from that recording (:mod:`harness_trainer.devloop.instances`). A model
that must learn to copy a number it never saw needs many numbers to learn from (toy-skills' 800), and
recording each would take the agent's seconds a task. Past ``batch_size`` transcripts, each step trains on a
minibatch of them.

With ``distractors`` (the default) each task also gets a distractor transcript: the same agent, the same
format, a command that solves nothing. Trained on both at equal weight, the warm model acts either way at
about even odds, so GRPO starts near half the reward with a clean signal: a solved and a failed rollout
differ at the command the model picked, not in a ramble off a half-memorised transcript (without them,
what GRPO pushed down was mostly noise, and the curve fell; see the README).

Held-out tasks stay out of it (:func:`check_not_held_out`): the warm-up refuses a held-out split
(:data:`HELD_OUT_SPLITS`) and a split that shares an instruction with one, so no solver transcript of a
held-out task is ever trained on. The warm model's ``warmup.json`` lists what it was trained on
(``trained_on``: split, task, instruction digest), and a cached warm model is only reused for the same
instructions, none of them held out now.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from harness_trainer.dev_engine.process import start_engine
from harness_trainer.devloop.instances import Template, common_prefix, instance_rows, plan_recordings
from harness_trainer.devloop.solver import WHITE_BOX, distractor_replies, solver_replies
from harness_trainer.rollouts.client.local_factory import LocalSessionFactory
from harness_trainer.rollouts.harness_mix import HarnessValue, harness_mix
from harness_trainer.tasks.sources import LocalTaskSource
from harness_trainer.trace import TrainingTrace
from harness_trainer.trainer.step.rows import Row, build_rows
from harness_trainer.trainer.step.shared_prefix import shared_prefix_logprobs

# 4: the fine-tune forwards a shared prefix once (the same logprobs up to float rounding, not the same bytes)
# 5: one recording per template, the other tasks' transcripts made from it; minibatches past batch_size
# 6: minibatches' learning rate falls linearly to 0
WARMUP_VERSION = 6
CHECK_EVERY = 25
"""With minibatches, how many steps apart the recorded transcripts are measured for the stop rule."""
DISTRACTOR_SUFFIX = " (distractor)"
HELD_OUT_SPLITS = frozenset({"test", "validation"})
"""Splits kept for evaluation: never warmed up on, and no warmed-up task may share an instruction with
one of theirs."""


@dataclass(frozen=True)
class WarmupRecipe:
    """What decides the warm model; its fingerprint names the cache folder."""

    harness: HarnessValue
    """The harness the transcripts go through; several (a run that mixes them): each task's through each."""
    harness_options: dict[str, Any] = field(default_factory=dict)
    """The harness's options (:func:`~harness_trainer.devloop.prompts.dev_harness_options`; keyed by
    harness name for several): its prompts are in every transcript."""
    target_probability: float = 0.3
    learning_rate: float = 1e-3
    # A warm-up on toy-skills' 1,600 transcripts began to copy numbers at step 175-250 (minibatches of 16);
    # on the bundled tasks' 10 it reaches the target by step ~180 (full batch).
    max_steps: int = 600
    distractors: bool = True
    batch_size: int = 16
    """Transcripts a step trains on; with no more than this in all, every step trains on all of them."""
    # No seed: the fine-tune is AdamW on fixed transcripts from a fixed base without dropout, full-batch or in
    # minibatches drawn by a generator of its own fixed seed, so no run's random draw moves a weight and one
    # warm model serves every run seed (tests/devloop/test_warmup.py).

    def fingerprint(self, base_model: Path, tasks: list[str]) -> str:
        payload = {**asdict(self), "base": base_model.name, "tasks": tasks, "version": WARMUP_VERSION}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


@dataclass
class WarmupReport:
    steps: int
    probability: float
    per_task: dict[str, float] = field(default_factory=dict)
    """The recorded transcripts' probabilities at the last measurement."""
    seconds: float = 0.0
    transcripts: int = 0
    """How many transcripts it trained on: recorded and made."""


def instruction_digest(instruction: str) -> str:
    """What ``trained_on`` records of an instruction (surrounding whitespace does not count)."""
    return hashlib.sha256(instruction.strip().encode()).hexdigest()


def trained_on(source: LocalTaskSource, split: str) -> list[dict[str, str]]:
    """What a warm-up on ``split`` trains on, as ``warmup.json`` records it: split, task, instruction
    digest, one entry per task."""
    return [
        {"split": split, "task": task.name, "instruction_sha256": instruction_digest(task.instruction)}
        for task in source.tasks(split)
    ]


def check_not_held_out(source: LocalTaskSource, split: str) -> None:
    """Refuse to warm up on held-out tasks: ``split`` itself, or a task of ``split`` whose instruction a
    held-out split of ``source`` also has.

    Raises:
        ValueError: ``split`` is one of :data:`HELD_OUT_SPLITS`, or shares an instruction with one.
    """
    if split in HELD_OUT_SPLITS:
        raise ValueError(
            f"split {split!r} is held out for evaluation ({', '.join(sorted(HELD_OUT_SPLITS))}): the warm-up "
            "never trains on its solutions; warm up on a training split (--split train)"
        )
    digests = {entry["instruction_sha256"] for entry in trained_on(source, split)}
    leaked = [
        f"{held}/{task.name}"
        for held in sorted(HELD_OUT_SPLITS & set(source.splits()))
        for task in source.tasks(held)
        if instruction_digest(task.instruction) in digests
    ]
    if leaked:
        raise ValueError(
            f"split {split!r} of {source.root} has the instructions of held-out tasks {leaked}: the warm-up "
            "would train on their solutions"
        )


def collect_transcripts(
    source: LocalTaskSource,
    split: str,
    harness: str,
    base_model: Path,
    work_dir: Path,
    *,
    distractors: bool = False,
    rollout_timeout: float = 180.0,
    harness_options: dict[str, Any] | None = None,
    only: Collection[str] | None = None,
) -> dict[str, TrainingTrace]:
    """One captured solver transcript per task of ``split`` (or per task named in ``only``), through the
    real ``harness`` (built with ``harness_options``); with ``distractors`` also one distractor transcript
    per task, named ``task + DISTRACTOR_SUFFIX``.

    Raises:
        ValueError: ``split`` holds held-out tasks (:func:`check_not_held_out`).
    """
    check_not_held_out(source, split)
    rows = [row for row in source.prompt_rows(split) if only is None or row["task_name"] in only]
    plan: list[tuple[dict, str, list[dict]]] = []
    for row in rows:
        task = source.task(split, row["task_index"])
        plan.append((row, row["task_name"], solver_replies(harness, task)))
        if distractors:
            plan.append((row, row["task_name"] + DISTRACTOR_SUFFIX, distractor_replies(harness)))
    script = work_dir / "solver-script.jsonl"
    script.write_text("\n".join(json.dumps(reply) for _, _, replies in plan for reply in replies))
    with (work_dir / "solver-engine.log").open("wb") as log:
        engine = start_engine(base_model, "--script", str(script), output=log)
    traces: dict[str, TrainingTrace] = {}
    try:
        with _factory(source, split, harness, harness_options, base_model, engine.url, work_dir) as factory:
            for row, name, _ in plan:
                session = factory.create(row, seed=0)
                try:
                    session.wait_for_completion(timeout_s=rollout_timeout)
                    reward = session.verify([]).env_reward
                    expected = 0.0 if name.endswith(DISTRACTOR_SUFFIX) else 1.0
                    if reward != expected:
                        raise RuntimeError(
                            f"the transcript {name!r} through {harness} got reward {reward}, not "
                            f"{expected}; see {work_dir}"
                        )
                    traces[name] = session.fetch_training_trace()
                finally:
                    session.close()
    finally:
        engine.stop()
    return traces


def _factory(
    source: LocalTaskSource,
    split: str,
    harness: str,
    harness_options: dict[str, Any] | None,
    base_model: Path,
    engine_url: str,
    work_dir: Path,
) -> contextlib.AbstractContextManager[Any]:
    """The sessions a transcript is recorded through: the real agent's through the capture proxy, or in
    white-box mode the trainer's own (the built-in adapter driving its model step over the sandbox's tools),
    so the ids are those the run will sample and train on."""
    if harness != WHITE_BOX:
        return LocalSessionFactory(
            source, upstream=engine_url, split=split, harness=harness, harness_options=harness_options,
            sampling={"temperature": 1.0}, data_dir=work_dir / "capture",
        )  # fmt: skip
    from transformers import AutoTokenizer

    from harness_trainer.rollouts.client.local_whitebox import LocalWhiteBoxSessionFactory
    from harness_trainer.trainer.feed.whitebox import white_box_factory
    from harness_trainer.whitebox.react import react_trainer_options

    adapter = react_trainer_options(max_turns=4)  # a transcript is 2 turns
    return contextlib.closing(
        white_box_factory(
            LocalWhiteBoxSessionFactory(source, split=split), adapter["harness_adapter"],
            tokenizer=AutoTokenizer.from_pretrained(base_model), base_url=engine_url,
            sampling={"temperature": 1.0}, limits=adapter["harness_limits"],
        )
    )  # fmt: skip


def _recipe_harnesses(recipe: WarmupRecipe) -> list[tuple[str, dict[str, Any]]]:
    """Each harness the recipe's transcripts go through, with its own options."""
    if recipe.harness == WHITE_BOX:
        return [(WHITE_BOX, dict(recipe.harness_options))]
    mix = harness_mix(recipe.harness)
    return [(name, mix.options_for(recipe.harness_options, name)) for name in mix.names]


def _with_rollout(rows: list[Row], index: int) -> list[Row]:
    return [Row(index, row.input_ids, row.targets, row.behaviour_logps) for row in rows]


def _probabilities(
    model: torch.nn.Module, transcripts: dict[str, list[Row]], names: list[str]
) -> dict[str, float]:
    """Each named transcript's probability under ``model``: exp of the sum of its trained tokens' logprobs."""
    rows = [row for index, name in enumerate(names) for row in _with_rollout(transcripts[name], index)]
    with torch.no_grad():
        logps = shared_prefix_logprobs(model, rows)
    sums = [0.0] * len(names)
    for row, row_logps in zip(rows, logps, strict=True):
        sums[row.rollout] += float(row_logps.sum())
    return {name: math.exp(total) for name, total in zip(names, sums, strict=True)}


def fine_tune(
    base_model: Path,
    traces: dict[str, TrainingTrace],
    out: Path,
    recipe: WarmupRecipe,
    *,
    on_step: Callable[[int, float], None] | None = None,
    tasks: list[dict[str, str]] | None = None,
    made: dict[str, list[Row]] | None = None,
) -> WarmupReport:
    """Train ``base_model`` on the sampled tokens of the recorded transcripts ``traces`` and of the
    transcripts ``made`` from them (:mod:`harness_trainer.devloop.instances`) until the least likely
    recorded transcript has the recipe's target probability (or ``max_steps``); save the model and
    tokenizer to ``out``, with ``warmup.json`` (the recipe, the report, and ``tasks`` as ``trained_on``).

    At most ``recipe.batch_size`` transcripts in all: every step trains on all of them, and the stop rule
    reads that step's forward. More: each step trains on ``batch_size`` of them, drawn by a generator of a
    fixed seed (the recipe holds none, so one warm model serves every run seed), at a learning rate that falls
    linearly to 0 at ``max_steps``, and the recorded ones are measured every :data:`CHECK_EVERY` steps.
    Every sampled token of a step weighs the same: where a solver and its distractor part ways, their two
    tokens pull equally (a per-transcript mean would favour the shorter transcript's choice)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate)
    transcripts = {name: build_rows(trace, rollout=0) for name, trace in sorted(traces.items())}
    transcripts.update(made or {})
    names, checked = sorted(transcripts), sorted(traces)
    full = len(names) <= recipe.batch_size
    draw = random.Random(0)
    # Minibatches: the learning rate falls linearly to 0 at max_steps. At a constant 1e-3 the least likely
    # recorded transcript of a toy-skills warm-up swung between 0.00 and 0.29 from one check to the next, and
    # the model saved was wherever the swing stopped.
    schedule = None
    if not full:
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / recipe.max_steps)
    report = WarmupReport(steps=0, probability=0.0, transcripts=len(names))

    def measured(step: int, per_task: dict[str, float]) -> bool:
        report.per_task, report.steps, report.probability = per_task, step, min(per_task.values())
        if on_step is not None:
            on_step(step, report.probability)
        return report.probability >= recipe.target_probability or step == recipe.max_steps

    for step in range(recipe.max_steps + 1):
        if not full and (step % CHECK_EVERY == 0 or step == recipe.max_steps):
            if measured(step, _probabilities(model, transcripts, checked)):
                break
        batch = names if full else sorted(draw.sample(names, recipe.batch_size))
        rows = [row for index, name in enumerate(batch) for row in _with_rollout(transcripts[name], index)]
        # A task's solver and distractor share their first ~1,400 ids: forwarded once, not twice.
        logps = shared_prefix_logprobs(model, rows)
        if full:
            sums = [0.0] * len(batch)
            for row, row_logps in zip(rows, logps, strict=True):
                sums[row.rollout] += float(row_logps.detach().sum())
            if measured(step, {name: math.exp(total) for name, total in zip(batch, sums, strict=True)}):
                break
        total = sum(row.n_targets for row in rows)
        loss = -torch.stack([row_logps.sum() for row_logps in logps]).sum() / total
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if schedule is not None:
            schedule.step()
    report.seconds = time.monotonic() - started
    tmp = Path(tempfile.mkdtemp(prefix=".warm-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(base_model).save_pretrained(tmp)
        (tmp / "warmup.json").write_text(
            json.dumps(
                {"recipe": asdict(recipe), "report": asdict(report), "trained_on": tasks or []}, indent=2
            )
        )
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report


def ensure_warm_model(
    source: LocalTaskSource,
    split: str,
    base_model: Path,
    recipe: WarmupRecipe,
    *,
    log: Callable[[str], None] = print,
) -> Path:
    """The warm model for ``recipe`` (built once, then reused from the cache next to ``base_model``).

    Raises:
        ValueError: ``split`` holds held-out tasks (:func:`check_not_held_out`), or the cached warm model
            was trained on other instructions than ``split``'s tasks have now, or on held-out ones.
    """
    check_not_held_out(source, split)
    tasks = sorted(row["task_name"] for row in source.prompt_rows(split))
    out = base_model.parent / f"{base_model.name}-warm-{recipe.fingerprint(base_model, tasks)}"
    if (out / "warmup.json").is_file():
        _check_cached(out, source, split)
        log(f"warm-up: reusing {out}")
        return out
    # One build per recipe on this machine: a second run (or test process) asking at the same time waits
    # for the first, then reuses its model, instead of replacing the folder the first one is reading.
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "warmup.json").is_file():
            _check_cached(out, source, split)
            log(f"warm-up: reusing {out} (built meanwhile by another process)")
            return out
        return _build_warm_model(source, split, recipe, base_model, tasks, out, log)


def _check_cached(out: Path, source: LocalTaskSource, split: str) -> None:
    """The cache is keyed by task names, not contents: a cached warm model is reused only if it was
    trained on the instructions ``split``'s tasks have now (which :func:`check_not_held_out` passed), not
    on ones since moved to a held-out split; one built before ``trained_on`` was recorded is reused as it
    always was."""
    recorded = json.loads((out / "warmup.json").read_text()).get("trained_on")
    if not recorded:
        return
    digests = {entry["instruction_sha256"] for entry in recorded}
    if digests != {entry["instruction_sha256"] for entry in trained_on(source, split)}:
        raise ValueError(
            f"the cached warm model {out} was trained on other instructions than split {split!r} of "
            f"{source.root} has now (same task names): delete it to warm up again"
        )


def _build_warm_model(
    source: LocalTaskSource,
    split: str,
    recipe: WarmupRecipe,
    base_model: Path,
    tasks: list[str],
    out: Path,
    log: Callable[[str], None],
) -> Path:
    templates = plan_recordings(source.tasks(split))
    recorded = {template.recorded for template in templates}
    with tempfile.TemporaryDirectory(prefix="warmup-") as work:
        extra = " and as many distractors" if recipe.distractors else ""
        of = f" ({len(recorded)} of {len(tasks)} tasks: one per template)"
        of = "" if len(templates) == len(tasks) else of
        traces: dict[str, TrainingTrace] = {}
        made: dict[str, list[Row]] = {}
        for harness, options in _recipe_harnesses(recipe):
            log(f"warm-up: recording {len(recorded)} solver transcripts{extra}{of} through {harness}")
            folder = Path(work) / harness
            folder.mkdir()
            recorded_here = collect_transcripts(
                source, split, harness, base_model, folder, distractors=recipe.distractors,
                harness_options=options, only=recorded,
            )  # fmt: skip
            suffix = f" via {harness}" if isinstance(recipe.harness, list | dict) else ""
            traces.update({name + suffix: trace for name, trace in recorded_here.items()})
            made.update(_made_transcripts(templates, recorded_here, base_model, recipe, suffix))
        if made:
            log(f"warm-up: made {len(made)} more transcripts from those, each with its own task's numbers")
        each = "each recorded transcript" if made else "each transcript"
        log(
            f"warm-up: fine-tuning until {each} has probability {recipe.target_probability:.0%} "
            f"(at most {recipe.max_steps} steps)"
        )

        def progress(step: int, probability: float) -> None:
            if step % CHECK_EVERY == 0:
                log(f"warm-up: step {step}, least likely transcript {probability:.3f}")

        report = fine_tune(
            base_model, traces, out, recipe, on_step=progress, tasks=trained_on(source, split), made=made
        )
    log(f"warm-up: {report.steps} steps in {report.seconds:.0f} s, probability {report.probability:.2f}")
    return out


def _made_transcripts(
    templates: list[Template],
    recorded: dict[str, TrainingTrace],
    base_model: Path,
    recipe: WarmupRecipe,
    suffix: str,
) -> dict[str, list[Row]]:
    """Every not recorded task's transcripts (solver, and distractor with ``recipe.distractors``), made from
    its template's recording (:func:`~harness_trainer.devloop.instances.instance_rows`), named as
    :func:`collect_transcripts` names them, plus ``suffix``."""
    if all(len(template.members) == 1 for template in templates):
        return {}
    from transformers import AutoTokenizer

    digit_ids = AutoTokenizer.from_pretrained(base_model).convert_tokens_to_ids(list("0123456789"))
    kinds = ["", DISTRACTOR_SUFFIX] if recipe.distractors else [""]
    rows = {name: build_rows(trace, rollout=0) for name, trace in recorded.items()}
    preamble = common_prefix([rows[template.recorded][0].input_ids for template in templates])
    made: dict[str, list[Row]] = {}
    for template in templates:
        for name, values in template.members[1:]:
            for kind in kinds:
                made[name + kind + suffix] = instance_rows(
                    rows[template.recorded + kind], template.values, values, digit_ids, preamble=preamble
                )
    return made
