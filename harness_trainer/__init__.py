"""harness-trainer: async GRPO on the captured behaviour of black-box coding agents.

``from harness_trainer import AsyncGRPOConfig, HarnessAsyncGRPOTrainer, HarborSessionFactory``; names load
on first use, so the CLI and the capture path do not pay for torch until they train.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "AsyncGRPOConfig": "harness_trainer.trainer.config.async_grpo",
    "HarnessAsyncGRPOTrainer": "harness_trainer.trainer.trainer",
    "HarnessRolloutOutcome": "harness_trainer.trainer.step.outcome",
    "HarborSessionFactory": "harness_trainer.rollouts.client.factory",
    "LocalSessionFactory": "harness_trainer.rollouts.client.local_factory",
    "LocalWhiteBoxSessionFactory": "harness_trainer.rollouts.client.local_whitebox",
    "ReActAdapter": "harness_trainer.whitebox.react",
    "TrainingTrace": "harness_trainer.trace",
    "CaptureContractError": "harness_trainer.trace",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'harness_trainer' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
