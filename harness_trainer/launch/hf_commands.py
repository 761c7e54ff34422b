"""``harness-trainer hf cleanup``: the hf backend's command, its flags and handler (as ``e2b cleanup``).

The handler checks for a Hugging Face token (``HF_TOKEN``, or one stored by ``hf auth login``) before any
call to the Hub; ``huggingface_hub`` loads only then, so ``--help`` stays instant. The Hub it talks to is the
library's (``HF_ENDPOINT``), which is how the tests point it at the fake Hub.
"""

from __future__ import annotations

import argparse
import os
import sys


def add_hf_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``hf`` command's subcommand, with its flags and handler, on ``parser``."""
    hf = parser.add_subparsers(dest="hf_command", required=True)
    cleanup = hf.add_parser(
        "cleanup", help="cancel every HF sandbox job (dedicated sandbox, pool host) of a run (a server that "
        "died left them)",
    )  # fmt: skip
    cleanup.add_argument("--run", required=True, help="the run id (serve --run-id)")
    cleanup.add_argument(
        "--namespace", default=None, help="where the run's jobs are (default: the token's own namespace)"
    )
    cleanup.set_defaults(func=_hf_cleanup)


def _hf_cleanup(args: argparse.Namespace) -> int:
    """Cancel every sandbox job labelled with run ``args.run`` still scheduling or running: 0 when listed
    (however many were cancelled), 1 when the Hub could not list them, 2 without a token."""
    from harness_trainer.sandboxes.hf import stored_login

    token = os.environ.get("HF_TOKEN")
    if not token and not stored_login():
        print(
            "error: HF_TOKEN is not set: finding a run's HF sandbox jobs needs a Hugging Face token "
            "(or a login stored by `hf auth login`)",
            file=sys.stderr,
        )
        return 2
    from harness_trainer.sandboxes.hf_runs import cancel_run

    try:
        cancelled = cancel_run(args.run, token=token, namespace=args.namespace)
    except Exception as exc:  # the Hub's errors (auth, network) are reported, not a traceback
        print(f"error: cannot list the HF sandbox jobs of run {args.run}: {exc}", file=sys.stderr)
        return 1
    print(
        f"cancelled {len(cancelled)} HF sandbox jobs of run {args.run}"
        + (f": {', '.join(cancelled)}" if cancelled else "")
    )
    return 0
