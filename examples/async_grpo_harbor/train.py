# /// script
# requires-python = ">=3.11"
# dependencies = ["harness-trainer[train,tracking,e2b,vllm]"]
#
# [tool.uv.sources]
# harness-trainer = { path = "../..", editable = true }
# ///
"""Async GRPO on Harbor tasks with real agents: ``harness-trainer train`` as a script, for running without
installing the project: ``uv run train.py --model … --harness opencode`` (or plain ``python`` where it is
installed) takes ``harness-trainer train``'s flags. Start vLLM and the rollout server first; README.md
beside this file has the three commands. The launcher is :mod:`harness_trainer.launch.harbor_run`."""

from __future__ import annotations

import sys

from harness_trainer.launch.harbor_run import main

if __name__ == "__main__":
    sys.exit(main())
