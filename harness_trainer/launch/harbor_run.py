"""A real async GRPO run on Harbor tasks: flags → preflight → factory, config, dataset → train.

``harness-trainer train`` is this module's :func:`add_train_arguments` and :func:`run_train`;
``examples/async_grpo_harbor/train.py`` is its :func:`main`, the same launcher. The run talks to two
processes that are already up: the inference engine (vLLM, or the CPU dev engine) and the rollout server
(``harness-trainer serve``), which runs the agents in sandboxes behind its capture proxy. Before anything
is spent, :func:`~harness_trainer.launch.preflight.run_preflight` checks both and the output directory; a
failure is one line on stderr and exit code 2. Then the launcher records ``--model`` in
``OUTPUT_DIR/launch.json`` (what a later ``--resume`` is checked against) and the resolved config in
``OUTPUT_DIR/run_config.json``, lists the split's tasks from the server as the dataset, and trains with
the reward of :mod:`harness_trainer.launch.rewards`.

Options come from flags and ``--config FILE`` (:mod:`harness_trainer.launch.config_file`): its ``run``
section holds this launcher's own options, its ``trainer`` section the trainer's config; every trainer
field also has a flag; a flag given wins over the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from harness_trainer.engines.kinds import ENGINE_KIND_FACTS
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
from harness_trainer.launch.preflight import (
    FINGERPRINT_FIELDS,
    LAUNCH_FILE,
    PreflightError,
    PreflightOptions,
    run_preflight,
)
from harness_trainer.launch.rewards import correctness_with_tool_efficiency
from harness_trainer.trainer.config.async_grpo import AsyncGRPOConfig

TRAINER_DEFAULTS: dict[str, Any] = {"max_steps": 100, "output_dir": "outputs/async_grpo_harbor"}
"""This launcher's defaults where they differ from ``AsyncGRPOConfig``'s: a bounded run, its own folder."""
OWNED = {"engine": "engine", "vllm_server_base_url": "vllm_url", "rollout_timeout": "agent_timeout_sec"}
"""Trainer fields this launcher sets from its own options (the trainer's wait is derived from the agent's
timeout: :attr:`~harness_trainer.rollouts.run_options.RunOptions.rollout_wait_s`), so its config file's
trainer section may not set them; ``server_capacity`` is what preflight measures."""
SECTION = "run"
WHITE_BOX_ONE_SERVER = "--mode white-box runs its sessions on one rollout server; --server gave {}"
DESCRIPTION = "Async GRPO on Harbor tasks: real agents in sandboxes, through a rollout server."
EPILOG = "Start vLLM and `harness-trainer serve` first: examples/async_grpo_harbor/README.md."


def build_parser() -> argparse.ArgumentParser:
    """The launcher's own parser (``examples/async_grpo_harbor/train.py``): :func:`add_train_arguments`.
    Parse with :func:`parse_args`."""
    parser = argparse.ArgumentParser(description=DESCRIPTION, epilog=EPILOG)
    add_train_arguments(parser)
    return parser


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """The launcher's flags on ``parser`` (``--help`` lists them): its own, ``--config``, and one per
    trainer config field; ``--model`` is required, on the command line or in ``--config``. A namespace
    parsed with them goes to :func:`run_train` (``harness-trainer train``) or :func:`resolve_options`."""
    where = parser.add_argument_group("where things run")
    where.add_argument(
        "--server", nargs="+", default=["http://127.0.0.1:8200"], metavar="URL",
        help="rollout server URL; several: a GRPO group runs on one, groups go where most sessions are free",
    )  # fmt: skip
    where.add_argument("--vllm-url", default="http://127.0.0.1:8000", help="inference engine URL")
    where.add_argument(
        "--engine",
        choices=("auto", *ENGINE_KIND_FACTS),
        default="auto",
        help="engine kind (auto: the dev engine if it answers GET /weight_version, else vLLM)",
    )
    where.add_argument("--model", required=True, help="the policy to train: a model directory or hub id")

    add_run_arguments(parser)
    parser.add_argument(
        "--preflight-only", action="store_true", help="run the checks, print what they found, and exit"
    )
    parser.add_argument(
        "--skip-probes", action="store_true",
        help="do not probe the engine's behaviour in preflight (processed logprobs, tool-call rendering, "
        "the model and tokenizer it serves); logged as a warning",
    )  # fmt: skip
    add_trainer_arguments(
        parser,
        defaults=TRAINER_DEFAULTS,
        exclude=[*OWNED, "server_capacity"],
        aliases={"use_peft": ["--lora"], "resume_from_checkpoint": ["--resume"]},
        extra={"resume_from_checkpoint": {"nargs": "?", "const": "latest", "metavar": "CHECKPOINT"}},
    )
    configurable(parser, SECTION)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The launcher's options, each the flag given, else ``--config``'s ``run`` section, else the default.

    Raises:
        ValueError: a config file's problems (:class:`ConfigFileError`), or no ``--model``.
    """
    return apply_config(build_parser().parse_args(argv))


def build_config(args: argparse.Namespace, **overrides: Any) -> AsyncGRPOConfig:
    """The trainer's config: :data:`TRAINER_DEFAULTS` < ``--config``'s trainer section < the trainer flags
    given < what the launcher's own options set (:data:`OWNED`) < ``overrides``.

    Raises:
        ValueError: a value ``AsyncGRPOConfig`` refuses, or a trainer field of :data:`OWNED` in the file.
    """
    from_file = args.config_sections.get(TRAINER, {})
    clash = [f"{TRAINER}.{name}: set by {SECTION}.{OWNED[name]} here" for name in OWNED if name in from_file]
    if clash:
        raise ConfigFileError(args.config, clash)
    owned = {
        "rollout_timeout": run_options_from(args).rollout_wait_s,
        "vllm_server_base_url": args.vllm_url,
        "engine": "vllm" if args.engine == "auto" else args.engine,
    }
    values = trainer_values(TRAINER_DEFAULTS, from_file, given_trainer_flags(args))
    return AsyncGRPOConfig(**{**values, **owned, **overrides})


def resolve(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, AsyncGRPOConfig]:
    """The launcher's options and the trainer's config for ``argv``, checked: what a run would start with.

    Raises:
        ValueError: a config file's problems, a value the trainer's config refuses, or several servers in
            white-box mode.
    """
    return resolve_options(build_parser().parse_args(argv))


def resolve_options(namespace: argparse.Namespace) -> tuple[argparse.Namespace, AsyncGRPOConfig]:
    """:func:`resolve` for a namespace already parsed with :func:`add_train_arguments`' flags.

    Raises:
        ValueError: as :func:`resolve`.
    """
    args = apply_config(namespace)
    if run_options_from(args).white_box and len(servers(args)) > 1:
        raise ValueError(WHITE_BOX_ONE_SERVER.format(len(servers(args))))
    return args, build_config(args)


def servers(args: argparse.Namespace) -> list[str]:
    """The rollout servers' URLs (``--server``, or a config file's ``server``: one URL or a list)."""
    given = args.server
    return [given] if isinstance(given, str) else list(given)


def session_builder(args: argparse.Namespace) -> partial[Any]:
    """The factory builder the trainer calls with its sampling policy. Rollouts sample from the trainer's
    engine (``llm_url``) under the name the rollout server learned from it: ``--model`` is what the
    trainer loads, which the engine may serve under another name (preflight checks they are one model).

    Raises:
        ValueError: several servers in white-box mode (its sessions run on one server).
    """
    urls, run = servers(args), run_options_from(args)
    if run.white_box:
        from harness_trainer.rollouts.client.whitebox_session import WhiteBoxSessionFactory

        if len(urls) > 1:
            raise ValueError(WHITE_BOX_ONE_SERVER.format(len(urls)))
        return partial(
            WhiteBoxSessionFactory, urls[0], split=run.split, sandbox=run.sandbox,
            episode_timeout_sec=run.agent_timeout_sec, reward_key=run.reward_key,
        )  # fmt: skip
    from harness_trainer.rollouts.client.factory import HarborSessionFactory

    return partial(
        HarborSessionFactory,
        urls[0] if len(urls) == 1 else urls,
        split=run.split,
        harness=run.harness,
        harness_options=run.harness_options,
        sandbox=run.sandbox,
        llm_url=args.vllm_url,
        agent_timeout_sec=run.agent_timeout_sec,
        agent_step_limit=run.agent_step_limit,
        reward_key=run.reward_key,
        num_tasks=run.num_tasks,
        indices=run.task_indices,
    )


def preflight_options(args: argparse.Namespace, config: AsyncGRPOConfig) -> PreflightOptions:
    """What preflight checks for these flags; the checkpoint fingerprint comes from ``config``."""
    settings, run = config.to_dict(), run_options_from(args)
    return PreflightOptions(
        engine_url=args.vllm_url,
        server_url=servers(args)[0],
        more_servers=tuple(servers(args)[1:]),
        model=args.model,
        harness=run.harness,
        sandbox=run.sandbox,
        output_dir=Path(config.output_dir),
        engine=args.engine,
        split=run.split,
        max_concurrent_rollouts=config.max_concurrent_rollouts,
        task_indices=run.task_indices,
        num_tasks=run.num_tasks,
        resume=config.resume_from_checkpoint,
        fingerprint={key: settings[key] for key in FINGERPRINT_FIELDS},
        weight_sync=config.weight_sync,
        trainer_config=config,
        skip_probes=args.skip_probes,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the launcher on ``argv`` (default: the command line); returns :func:`run_train`'s exit code
    (bad flags exit 2, as argparse does)."""
    return run_train(build_parser().parse_args(argv), argv)


def run_train(namespace: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    """Run the launcher on parsed flags (``harness-trainer train``); returns the exit code (2: a bad config,
    flags that do not fit or a failed preflight, nothing spent). The resolved config is written to
    ``OUTPUT_DIR/run_config.json`` once the run starts; ``argv`` (default: the command line) is recorded
    in ``OUTPUT_DIR/launch.json``."""
    try:
        args, config = resolve_options(namespace)
    except ValueError as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    options = preflight_options(args, config)
    try:
        report = run_preflight(options)
    except PreflightError as exc:
        print(f"preflight: {_one_line(exc)}", file=sys.stderr)
        return 2
    print(report.summary(options), flush=True)
    if args.preflight_only:
        return 0

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # else one line per rollout poll
    config = dataclasses.replace(config, engine=report.engine_kind, server_capacity=report.server_capacity)
    _write_launch_record(args, config, report.engine_kind, argv)
    run_options = {dest: getattr(args, dest) for dest in args.config_layers.defaults}
    write_resolved(config.output_dir, {SECTION: run_options, TRAINER: config.to_dict()})
    builder = session_builder(args)
    from harness_trainer.trainer.trainer import HarnessAsyncGRPOTrainer  # torch: only once a run starts

    trainer = HarnessAsyncGRPOTrainer(
        args.model,
        builder,
        args=config,
        train_dataset=_task_rows(builder, config, args),
        rollout_reward_fn=correctness_with_tool_efficiency,
        **white_box_options(args),
    )
    trainer.train()
    return 0


def white_box_options(args: argparse.Namespace) -> dict[str, Any]:
    """The trainer's ``harness_adapter`` and ``harness_limits`` in white-box mode (none in black-box): the
    built-in :class:`~harness_trainer.whitebox.react.ReActAdapter`, its turns bounded by
    ``--agent-step-limit`` (0: OpenEnv's default)."""
    run = run_options_from(args)
    if not run.white_box:
        return {}
    from harness_trainer.whitebox.react import react_trainer_options

    return react_trainer_options(run.agent_step_limit)


def _task_rows(
    builder: partial[Any], config: AsyncGRPOConfig, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """The dataset: one row per chosen task of the split, as the server lists them (a white-box factory
    lists every task: ``--task-indices`` and ``--num-tasks`` choose here)."""
    run = run_options_from(args)
    if run.white_box:
        rows = builder().prompt_rows()  # holds no server session
        if run.task_indices is not None:
            rows = [row for row in rows if row["task_index"] in set(run.task_indices)]
        return rows[: run.num_tasks] if run.num_tasks is not None else rows
    factory = builder(sampling=config.sampling)
    try:
        return factory.prompt_rows()
    finally:
        factory.close()  # frees its metadata session before the trainer's own factory opens one


def _write_launch_record(
    args: argparse.Namespace, config: AsyncGRPOConfig, engine_kind: str, argv: Sequence[str] | None
) -> None:
    """``OUTPUT_DIR/launch.json``: what a later ``--resume`` must match (written atomically)."""
    record = {
        "model": args.model,
        "harness": args.harness,
        "sandbox": args.sandbox,
        "split": args.split,
        "server": servers(args)[0] if len(servers(args)) == 1 else servers(args),
        "engine": engine_kind,
        "engine_url": args.vllm_url,
        "argv": list(sys.argv[1:] if argv is None else argv),
    }
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    staging = output_dir / f".{LAUNCH_FILE}.{os.getpid()}.tmp"
    staging.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(staging, output_dir / LAUNCH_FILE)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
