"""``harness-trainer view RUN_DIR``: the command that writes a run's trace viewer (:mod:`.page`).

Importing this module loads no pydantic, jinja, transformers or torch: the CLI builds its parser with
:func:`add_view_arguments` whatever command it runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from harness_trainer.viewer.page import VIEWER_FILE, build_viewer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def default_tokenizer_dir(run_dir: str | os.PathLike[str]) -> Path | None:
    """The newest ``checkpoint-*/model`` of the run that holds tokenizer files, or None."""
    from harness_trainer.trainer.checkpoint import CHECKPOINT_PREFIX, MODEL_DIR  # imports torch: only here

    candidates = []
    for path in Path(run_dir).glob(f"{CHECKPOINT_PREFIX}*/{MODEL_DIR}"):
        step = path.parent.name.removeprefix(CHECKPOINT_PREFIX)
        if step.isdigit() and any((path / name).is_file() for name in TOKENIZER_FILES):
            candidates.append((int(step), path))
    return max(candidates)[1] if candidates else None


def add_view_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``harness-trainer view RUN_DIR [--tokenizer DIR] [-o FILE] [--steps N]
    [--max-tokens N] [--capture-dir DIR]``."""
    parser.add_argument("run_dir", type=Path, help="a training run's output folder (holds rollouts.jsonl)")
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="tokenizer folder to decode tokens (default: the run's newest checkpoint-*/model with tokenizer "
        "files; without one, tokens show as ⟨id⟩)",
    )
    parser.add_argument(
        "-o", "--output", type=Path, default=None, help=f"HTML file to write (default: RUN_DIR/{VIEWER_FILE})"
    )
    parser.add_argument("--steps", type=int, default=20, help="how many of the last steps to include")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=1_000_000,
        help="tokens rendered at most, newest steps first; later traces are left out (about 40 bytes each)",
    )
    parser.add_argument(
        "--capture-dir",
        type=Path,
        default=None,
        help="the capture proxy's data folder (its --data-dir), named in each rollout's proxy-trace command "
        "(default: RUN_DIR/capture when it holds sessions/, as the dev loop's runs do; else DATA_DIR)",
    )


def run_view(args: argparse.Namespace) -> int:
    """``harness-trainer view``: print the HTML file's path; 2 with a message when the run cannot be read."""
    tokenizer = args.tokenizer if args.tokenizer is not None else default_tokenizer_dir(args.run_dir)
    try:
        path = build_viewer(
            args.run_dir,
            tokenizer_dir=tokenizer,
            out=args.output,
            max_steps_shown=args.steps,
            max_tokens_shown=args.max_tokens,
            capture_dir=args.capture_dir,
        )
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0
