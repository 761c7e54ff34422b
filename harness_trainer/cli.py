"""The ``harness-trainer`` command: one parser over the subcommands. A command's flags and handler live in
the module that owns it (``train``: :mod:`harness_trainer.launch.harbor_run`, ``serve``:
:mod:`harness_trainer.launch.serve`, ``e2b``: :mod:`harness_trainer.launch.e2b_commands`, ``hf``:
:mod:`harness_trainer.launch.hf_commands`; ``dev``, ``eval``, ``view``, ``plot`` and ``jobs submit`` beside
their code); the few small ones are here. Every handler imports the heavy libraries it needs late, so
``--help`` answers at once."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from capture_proxy.cli import add_proxy_arguments
from harness_trainer.devloop.evaluate import add_eval_arguments, run_eval
from harness_trainer.devloop.run import add_dev_arguments, run_dev
from harness_trainer.jobs.submit import add_submit_arguments, run_submit
from harness_trainer.launch import harbor_run
from harness_trainer.launch.config_file import apply_config, configurable
from harness_trainer.launch.e2b_commands import add_e2b_arguments
from harness_trainer.launch.hf_commands import add_hf_arguments
from harness_trainer.launch.serve import add_serve_arguments, run_serve
from harness_trainer.plots import add_plot_arguments, run_plot
from harness_trainer.viewer.command import add_view_arguments, run_view


def _tiny_model(args: argparse.Namespace) -> int:
    from harness_trainer.models.tiny import ensure_tiny_model

    try:
        print(ensure_tiny_model(args.out))
    except FileExistsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _engine(args: argparse.Namespace) -> int:
    import torch

    from harness_trainer.dev_engine import load_engine, serve
    from harness_trainer.dev_engine.script import ScriptError
    from harness_trainer.models.tiny import ensure_tiny_model

    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model or str(ensure_tiny_model())
    try:
        state = load_engine(
            model,
            served_model_name=args.served_model_name,
            max_model_len=args.max_model_len,
            script=args.script,
            seed=args.seed,
        )
    except (OSError, ValueError, ScriptError) as exc:
        print(f"error: cannot start the dev engine: {exc}", file=sys.stderr)
        return 2
    print(
        f"dev engine: serving {state.config.served_model_name} on http://{args.host}:{args.port}/v1"
        + (f" (scripted by {args.script})" if args.script else ""),
        flush=True,
    )
    serve(state, host=args.host, port=args.port)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from harness_trainer.demo import run_demo

    return run_demo(port=args.port)


def _proxy(args: argparse.Namespace) -> int:
    from capture_proxy.cli import serve

    try:
        args = apply_config(args)
    except ValueError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return serve(args)


def _proxy_trace(args: argparse.Namespace) -> int:
    from capture_proxy.assembly import UntrainableSession
    from capture_proxy.export import trace_from_journal
    from capture_proxy.journal import JournalError
    from harness_trainer.trace import CaptureContractError, dump_trace, load_trace

    try:
        trace = load_trace(trace_from_journal(args.session), session_id=args.session.name)
    except (UntrainableSession, JournalError, CaptureContractError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = dump_trace(trace)
    if args.out:
        args.out.write_text(text)
        print(f"{len(trace.turns)} turns -> {args.out}")
    else:
        print(text)
    return 0


def _export_sft(args: argparse.Namespace) -> int:
    from harness_trainer.trainer.sft_export import ExportError, export_sft

    try:
        out, summary = export_sft(
            args.run_dir, min_reward=args.min_reward, fmt=args.format, output=args.output, source=args.source
        )
    except (ExportError, OSError) as exc:  # OSError: the output could not be written (nothing was)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"export-sft: {summary.line(args.min_reward)} -> {out} ({args.format})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand's flags, ``train`` first; a parsed namespace's ``func`` runs the command."""
    parser = argparse.ArgumentParser(
        prog="harness-trainer",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Train LLMs with reinforcement learning (async GRPO) on the behaviour of real coding agents.\n"
            "Agents (opencode, mini-swe-agent, claude-code, codex) run their own loop in sandboxes; a "
            "capture\nproxy records the exact tokens the engine sampled for them, and the trainer learns "
            "from those."
        ),
        epilog=(
            "start here:\n"
            "  harness-trainer dev            the whole loop on a CPU: tiny model, dev engine, a real agent\n"
            "                                 in local sandboxes, GRPO; leaves curves and a trace viewer\n"
            "  harness-trainer serve ...      the rollout server (with the capture proxy) for a real run\n"
            "  harness-trainer train ...      that real run: async GRPO against vLLM and the rollout server\n"
            "  harness-trainer jobs submit    a whole training run on Hugging Face Jobs\n"
            "\n"
            "'harness-trainer COMMAND --help' for a command's options. Documentation: README.md and docs/\n"
            "in the repository; 'mkdocs serve' there builds it as a site."
        ),
    )
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser(
        "train",
        help="train a model by async GRPO on Harbor tasks with real agents (vLLM and `serve` up first)",
        description=harbor_run.DESCRIPTION,
        epilog=harbor_run.EPILOG,
    )
    harbor_run.add_train_arguments(train)
    train.set_defaults(func=harbor_run.run_train)

    tiny = sub.add_parser("tiny-model", help="build (if needed) the tiny local model and print its directory")
    tiny.add_argument(
        "--out",
        type=Path,
        default=None,
        help="directory to build into (default: the cache, ~/.cache/harness-trainer)",
    )
    tiny.set_defaults(func=_tiny_model)

    engine = sub.add_parser("engine", help="serve a model on CPU with vLLM's wire shapes (the dev engine)")
    engine.add_argument("--model", default=None, help="model directory or hub id (default: the tiny model)")
    engine.add_argument("--host", default="127.0.0.1")
    engine.add_argument("--port", type=int, default=8000)
    engine.add_argument("--served-model-name", default=None, help="name clients use (default: --model)")
    engine.add_argument("--max-model-len", type=int, default=None, help="context length (default: model's)")
    engine.add_argument(
        "--script",
        default=None,
        help="JSON/JSONL file of assistant messages to reply with, in order (scripted mode)",
    )
    engine.add_argument("--seed", type=int, default=0, help="seed for requests that bring none")
    engine.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    engine.set_defaults(func=_engine)

    demo = sub.add_parser(
        "demo", help="start the dev engine on the tiny model and chat with it (tools included)"
    )
    demo.add_argument("--port", type=int, default=0, help="engine port (default: a free one)")
    demo.set_defaults(func=_demo)

    proxy = sub.add_parser(
        "proxy", help="serve the capture proxy in front of an engine (vLLM or the dev engine)"
    )
    add_proxy_arguments(proxy)
    configurable(proxy, "proxy", trainer=False)  # `python -m capture_proxy` stands alone: flags only
    proxy.set_defaults(func=_proxy)

    export = sub.add_parser("proxy-trace", help="export a session's TrainingTrace from its journal (offline)")
    export.add_argument(
        "session", type=Path, help="session directory (DATA_DIR/sessions/ID) or its calls.jsonl"
    )
    export.add_argument("--out", type=Path, default=None, help="write here instead of stdout")
    export.set_defaults(func=_proxy_trace)

    sft = sub.add_parser(
        "export-sft",
        help="write a run's rollouts with a reward >= --min-reward as a dataset TRL's SFTTrainer loads",
        description=(
            "Write the accepted rollouts of a run (reward >= --min-reward, with a trace) as an SFT dataset: "
            "conversational `messages` and `tools` for TRL's SFTTrainer, the engine's exact `prompt_ids`, "
            "`completion_ids` and `completion_mask` beside them, and `task_name`, `reward`, `rollout_id`; "
            "each trajectory once. Columns: docs/training.md."
        ),
    )
    sft.add_argument(
        "run_dir",
        type=Path,
        help="a run's output folder, or a rollouts.jsonl / eval_rollouts.jsonl file (read as its name says)",
    )
    sft.add_argument(
        "--min-reward", type=float, required=True, help="accept rollouts whose reward is at least this"
    )
    sft.add_argument(
        "--source",
        choices=("rollouts", "eval"),
        default=None,
        help="in a run folder, read rollouts.jsonl (training, the default) or eval_rollouts.jsonl "
        "(evaluation)",
    )
    sft.add_argument(
        "--format",
        choices=("jsonl", "parquet", "hf"),
        default="jsonl",
        help="jsonl: one JSON object a line; parquet: one Parquet file; hf: a datasets.Dataset's "
        "save_to_disk folder (default: jsonl)",
    )
    sft.add_argument(
        "--output",
        type=Path,
        default=None,
        help="where to write (default: sft.jsonl, sft.parquet or sft/ beside the records; sft-eval... for "
        "--source eval)",
    )
    sft.set_defaults(func=_export_sft)

    serve = sub.add_parser("serve", help="serve rollouts of Harbor tasks over HTTP, with the capture proxy")
    add_serve_arguments(serve)
    serve.set_defaults(func=run_serve)
    add_e2b_arguments(sub.add_parser("e2b", help="E2B sandboxes"))
    add_hf_arguments(sub.add_parser("hf", help="Hugging Face sandboxes (the hf backend)"))

    dev = sub.add_parser(
        "dev", help="the local dev loop: tiny model, dev engine, a real agent in local sandboxes, GRPO"
    )
    add_dev_arguments(dev)
    dev.set_defaults(func=run_dev)

    evaluate = sub.add_parser(
        "eval", help="evaluate a checkpoint on a split of local tasks: k rollouts per task, pass@1 and pass@k"
    )
    add_eval_arguments(evaluate)
    evaluate.set_defaults(func=run_eval)

    view = sub.add_parser("view", help="write a run's static HTML trace viewer (one file, no server)")
    add_view_arguments(view)
    view.set_defaults(func=run_view)
    plot = sub.add_parser("plot", help="draw a run's reward / length / tool-call / loss curves as a PNG")
    add_plot_arguments(plot)
    plot.set_defaults(func=run_plot)

    jobs = sub.add_parser("jobs", help="Hugging Face Jobs").add_subparsers(dest="jobs_command", required=True)
    submit = jobs.add_parser("submit", help="submit a training run to Hugging Face Jobs")
    add_submit_arguments(submit)
    submit.set_defaults(func=run_submit)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command ``argv`` names (default: the command line); returns its exit code."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
