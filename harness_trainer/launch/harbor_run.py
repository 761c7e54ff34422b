"""A real async GRPO run on Harbor tasks: flags → preflight → factory, config, dataset → train.

``examples/async_grpo_harbor/train.py`` is this module's :func:`main`. The run talks to two processes that
are already up: the inference engine (vLLM, or the CPU dev engine) and the rollout server
(``harness-trainer serve``), which runs the agents in sandboxes behind its capture proxy. Before anything
is spent, :func:`~harness_trainer.launch.preflight.run_preflight` checks both and the output directory; a
failure is one line on stderr and exit code 2. Then the launcher records ``--model`` in
``OUTPUT_DIR/launch.json`` (what a later ``--resume`` is checked against), lists the split's tasks from
the server as the dataset, and trains with the reward of :mod:`harness_trainer.launch.rewards`.
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

from harness_trainer.launch.preflight import (
    FINGERPRINT_FIELDS,
    LAUNCH_FILE,
    PreflightError,
    PreflightOptions,
    run_preflight,
)
from harness_trainer.launch.rewards import correctness_with_tool_efficiency
from harness_trainer.sandboxes import describe_backends
from harness_trainer.trainer.config import DTYPES, WEIGHT_SYNCS, AsyncGRPOConfig

WAIT_MARGIN_S = 600.0
"""Added to ``--agent-timeout`` for the trainer's own wait on a rollout. The server enforces the agent's
timeout; the trainer's wait also covers the sandbox start, the agent's install and the verifier, and is
only a backstop for a server that stopped answering."""


def build_parser() -> argparse.ArgumentParser:
    """The launcher's flags (``--help`` lists them); only ``--model`` is required."""
    parser = argparse.ArgumentParser(
        description="Async GRPO on Harbor tasks: real agents in sandboxes, through a rollout server.",
        epilog="Start vLLM and `harness-trainer serve` first: examples/async_grpo_harbor/README.md.",
    )
    where = parser.add_argument_group("where things run")
    where.add_argument("--server", default="http://127.0.0.1:8200", help="rollout server URL")
    where.add_argument("--vllm-url", default="http://127.0.0.1:8000", help="inference engine URL")
    where.add_argument(
        "--engine",
        choices=("auto", "vllm", "dev"),
        default="auto",
        help="engine kind (auto: the dev engine if it answers GET /weight_version, else vLLM)",
    )
    where.add_argument(
        "--weight-sync",
        choices=WEIGHT_SYNCS,
        default="auto",
        help="how weights reach vLLM: file (its in-place reload from /dev/shm; same host), nccl (its NCCL "
        "transfer; another GPU or host), auto (file for a vLLM on this host, else nccl)",
    )
    where.add_argument("--model", required=True, help="the policy to train: a model directory or hub id")
    where.add_argument("--dtype", choices=DTYPES, default="float32", help="training dtype")

    tasks = parser.add_argument_group("tasks and agents")
    tasks.add_argument("--split", default="train", help="task split on the rollout server")
    tasks.add_argument(
        "--harness", default="opencode", help="opencode, mini-swe-agent, claude-code, codex (toy: tests)"
    )
    tasks.add_argument("--sandbox", default="e2b", help=f"where agents run: {describe_backends()}")
    tasks.add_argument("--reward-key", default="", help="named score of reward.json to train on")
    tasks.add_argument("--num-tasks", type=_positive_int, default=None, help="use the first N tasks")
    tasks.add_argument(
        "--task-indices", type=_indices, default=None, help="use these task indices (comma-separated)"
    )
    tasks.add_argument("--agent-timeout", type=float, default=600.0, help="seconds an agent may run")
    tasks.add_argument("--agent-step-limit", type=int, default=30, help="agent steps (0: harness default)")

    train = parser.add_argument_group("training")
    train.add_argument("--num-generations", type=int, default=8, help="rollouts per task (a group)")
    train.add_argument("--max-concurrent-rollouts", type=int, default=8, help="sessions live at once")
    train.add_argument("--max-steps", type=int, default=100, help="optimizer steps")
    train.add_argument("--learning-rate", type=float, default=1e-6)
    train.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    train.add_argument("--max-staleness", type=int, default=1, help="policy versions a rollout may lag")
    train.add_argument(
        "--lora", action="store_true",
        help="train a LoRA adapter (vLLM gets the adapter alone: serve it with --enable-lora)",
    )  # fmt: skip
    train.add_argument("--output-dir", type=Path, default=Path("outputs/async_grpo_harbor"))
    train.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: at the end)")
    train.add_argument("--report-to", default="none", help="none, tensorboard, wandb, trackio (comma list)")
    train.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        metavar="CHECKPOINT",
        help="continue from the latest checkpoint in --output-dir, or from CHECKPOINT",
    )
    train.add_argument(
        "--preflight-only", action="store_true", help="run the checks, print what they found, and exit"
    )
    return parser


def build_config(args: argparse.Namespace, **overrides: Any) -> AsyncGRPOConfig:
    """The trainer's config from the flags (``overrides`` win).

    Raises:
        ValueError: a value ``AsyncGRPOConfig`` refuses.
    """
    fields: dict[str, Any] = {
        "num_generations": args.num_generations,
        "max_concurrent_rollouts": args.max_concurrent_rollouts,
        "max_staleness": args.max_staleness,
        "agent_timeout": args.agent_timeout + WAIT_MARGIN_S,
        "learning_rate": args.learning_rate,
        "temperature": args.temperature,
        "max_steps": args.max_steps,
        "save_steps": args.save_steps,
        "use_peft": args.lora,
        "dtype": args.dtype,
        "output_dir": str(args.output_dir),
        "report_to": args.report_to,
        "resume_from_checkpoint": args.resume,
        "vllm_server_base_url": args.vllm_url,
        "engine": "vllm" if args.engine == "auto" else args.engine,
        "weight_sync": args.weight_sync,
    }
    return AsyncGRPOConfig(**{**fields, **overrides})


def session_builder(args: argparse.Namespace) -> partial[Any]:
    """The factory builder the trainer calls with its sampling policy."""
    from harness_trainer.rollouts.factory import HarborSessionFactory

    return partial(
        HarborSessionFactory,
        args.server,
        split=args.split,
        harness=args.harness,
        sandbox=args.sandbox,
        llm_url=args.vllm_url,
        model=args.model,
        agent_timeout_sec=args.agent_timeout,
        agent_step_limit=args.agent_step_limit,
        reward_key=args.reward_key,
        num_tasks=args.num_tasks,
        indices=args.task_indices,
    )


def preflight_options(args: argparse.Namespace, config: AsyncGRPOConfig) -> PreflightOptions:
    """What preflight checks for these flags; the checkpoint fingerprint comes from ``config``."""
    settings = config.to_dict()
    return PreflightOptions(
        engine_url=args.vllm_url,
        server_url=args.server,
        model=args.model,
        harness=args.harness,
        sandbox=args.sandbox,
        output_dir=args.output_dir,
        engine=args.engine,
        split=args.split,
        max_concurrent_rollouts=args.max_concurrent_rollouts,
        task_indices=args.task_indices,
        num_tasks=args.num_tasks,
        resume=args.resume,
        fingerprint={key: settings[key] for key in FINGERPRINT_FIELDS},
        weight_sync=config.weight_sync,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the launcher; returns the exit code (2: bad flags or a failed preflight, nothing spent)."""
    args = build_parser().parse_args(argv)
    try:
        config = build_config(args)
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
    _write_launch_record(args, report.engine_kind, argv)
    builder = session_builder(args)
    from harness_trainer.trainer.trainer import HarnessAsyncGRPOTrainer  # torch: only once a run starts

    trainer = HarnessAsyncGRPOTrainer(
        args.model,
        builder,
        args=config,
        train_dataset=_task_rows(builder, config),
        rollout_reward_fn=correctness_with_tool_efficiency,
    )
    trainer.train()
    return 0


def _task_rows(builder: partial[Any], config: AsyncGRPOConfig) -> list[dict[str, Any]]:
    """The dataset: one row per chosen task of the split, as the server lists them."""
    factory = builder(sampling=config.sampling)
    try:
        return factory.prompt_rows()
    finally:
        factory.close()  # frees its metadata session before the trainer's own factory opens one


def _write_launch_record(args: argparse.Namespace, engine_kind: str, argv: Sequence[str] | None) -> None:
    """``OUTPUT_DIR/launch.json``: what a later ``--resume`` must match (written atomically)."""
    record = {
        "model": args.model,
        "harness": args.harness,
        "sandbox": args.sandbox,
        "split": args.split,
        "server": args.server,
        "engine": engine_kind,
        "engine_url": args.vllm_url,
        "argv": list(sys.argv[1:] if argv is None else argv),
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    staging = args.output_dir / f".{LAUNCH_FILE}.{os.getpid()}.tmp"
    staging.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(staging, args.output_dir / LAUNCH_FILE)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _indices(text: str) -> list[int]:
    try:
        indices = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated task indices, got {text!r}") from None
    if not indices or min(indices) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated task indices ≥ 0, got {text!r}")
    return indices
