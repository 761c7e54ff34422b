"""The warm-up of the dev loop's recipe: scripted solver transcripts, captured through the real agent, then a
short supervised fine-tune of the tiny model on exactly those token ids.

The random tiny model never solves a task, so GRPO on it would see only zero rewards. The recipe first
records one solver transcript per task (the dev engine in scripted mode plays the solver, the real agent
runs it in a local sandbox, the capture proxy keeps the ids the agent's own prompt format produced), then
trains on the transcripts' sampled tokens until the model gives them a set probability (by default 30 %,
so that GRPO has both successes and failures to learn from), and saves the result next to the tiny
model, keyed by everything that decides its bytes.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from harness_trainer.dev_engine.process import start_engine
from harness_trainer.devloop.solver import solver_replies
from harness_trainer.rollouts.local_factory import LocalSessionFactory
from harness_trainer.tasks.sources import LocalTaskSource
from harness_trainer.trace import TrainingTrace
from harness_trainer.trainer.logprobs import token_logprobs, use_packed_attention
from harness_trainer.trainer.packing import collate
from harness_trainer.trainer.rows import Row, build_rows

WARMUP_VERSION = 1


@dataclass(frozen=True)
class WarmupRecipe:
    """What decides the warm model; its fingerprint names the cache folder."""

    harness: str
    target_probability: float = 0.3
    learning_rate: float = 1e-3
    max_steps: int = 200
    seed: int = 0

    def fingerprint(self, base_model: Path, tasks: list[str]) -> str:
        payload = {**asdict(self), "base": base_model.name, "tasks": tasks, "version": WARMUP_VERSION}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


@dataclass
class WarmupReport:
    steps: int
    probability: float
    per_task: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0


def collect_transcripts(
    source: LocalTaskSource,
    split: str,
    harness: str,
    base_model: Path,
    work_dir: Path,
    *,
    agent_timeout: float = 180.0,
) -> dict[str, TrainingTrace]:
    """One captured solver transcript per task of ``split``, through the real ``harness``."""
    rows = source.prompt_rows(split)
    replies = [
        reply for row in rows for reply in solver_replies(harness, source.task(split, row["task_index"]))
    ]
    script = work_dir / "solver-script.jsonl"
    script.write_text("\n".join(json.dumps(reply) for reply in replies))
    with (work_dir / "solver-engine.log").open("wb") as log:
        engine = start_engine(base_model, "--script", str(script), output=log)
    traces: dict[str, TrainingTrace] = {}
    try:
        with LocalSessionFactory(
            source, upstream=engine.url, split=split, harness=harness, sampling={"temperature": 1.0},
            data_dir=work_dir / "capture",
        ) as factory:  # fmt: skip
            for row in rows:
                session = factory.create(row, seed=0)
                try:
                    session.wait_for_completion(timeout_s=agent_timeout)
                    reward = session.verify([]).env_reward
                    if reward != 1.0:
                        raise RuntimeError(
                            f"the solver transcript for {row['task_name']} did not solve it through "
                            f"{harness} (reward {reward}); see {work_dir}"
                        )
                    traces[row["task_name"]] = session.fetch_training_trace()
                finally:
                    session.close()
    finally:
        engine.stop()
    return traces


def _rows(traces: dict[str, TrainingTrace]) -> tuple[list[Row], dict[int, float], dict[int, str]]:
    rows: list[Row] = []
    names: dict[int, str] = {}
    for index, (name, trace) in enumerate(sorted(traces.items())):
        names[index] = name
        rows.extend(build_rows(trace, rollout=index))
    weights = {}
    for index in names:
        n_targets = sum(r.n_targets for r in rows if r.rollout == index)
        weights[index] = 1.0 / (n_targets * len(names))
    return rows, weights, names


def _probabilities(
    logps: torch.Tensor, batch_rollouts: torch.Tensor, targets: torch.Tensor, names: dict
) -> dict:
    """Each transcript's probability under the model: exp of the sum of its trained tokens' logprobs."""
    out = {}
    for index, name in names.items():
        chosen = targets & (batch_rollouts == index)
        out[name] = math.exp(float(logps[chosen].sum()))
    return out


def fine_tune(
    base_model: Path,
    traces: dict[str, TrainingTrace],
    out: Path,
    recipe: WarmupRecipe,
    *,
    on_step: Callable[[int, float], None] | None = None,
) -> WarmupReport:
    """Train ``base_model`` on the transcripts' sampled tokens until their mean probability reaches the
    recipe's target (or ``max_steps``); save the model and tokenizer to ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    torch.manual_seed(recipe.seed)
    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    use_packed_attention(model)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate)
    rows, weights, names = _rows(traces)
    batch = collate(rows, {index: 1.0 for index in names}, weights)
    report = WarmupReport(steps=0, probability=0.0)
    for step in range(recipe.max_steps + 1):
        logps, _ = token_logprobs(model, batch, 1.0, with_entropy=False, targets_only=True)
        per_task = _probabilities(logps.detach(), batch.rollouts, batch.targets, names)
        report.per_task, report.steps = per_task, step
        report.probability = sum(per_task.values()) / len(per_task)
        if on_step is not None:
            on_step(step, report.probability)
        if report.probability >= recipe.target_probability or step == recipe.max_steps:
            break
        loss = -(logps * batch.token_weights).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    report.seconds = time.monotonic() - started
    tmp = Path(tempfile.mkdtemp(prefix=".warm-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(base_model).save_pretrained(tmp)
        (tmp / "warmup.json").write_text(
            json.dumps({"recipe": asdict(recipe), "report": asdict(report)}, indent=2)
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
    """The warm model for ``recipe`` (built once, then reused from the cache next to ``base_model``)."""
    tasks = sorted(row["task_name"] for row in source.prompt_rows(split))
    out = base_model.parent / f"{base_model.name}-warm-{recipe.fingerprint(base_model, tasks)}"
    if (out / "warmup.json").is_file():
        log(f"warm-up: reusing {out}")
        return out
    with tempfile.TemporaryDirectory(prefix="warmup-") as work:
        log(f"warm-up: recording {len(tasks)} solver transcripts through {recipe.harness}")
        traces = collect_transcripts(source, split, recipe.harness, base_model, Path(work))
        log(f"warm-up: fine-tuning until the transcripts have probability {recipe.target_probability:.0%}")
        report = fine_tune(base_model, traces, out, recipe)
    log(f"warm-up: {report.steps} steps in {report.seconds:.0f} s, probability {report.probability:.2f}")
    return out
