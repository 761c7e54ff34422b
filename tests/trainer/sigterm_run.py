"""A training run for the SIGTERM test: hand-made sessions that hang after the first groups.

``python -m tests.trainer.sigterm_run MODEL_DIR OUTPUT_DIR``; writes ``OUTPUT_DIR/sessions.json`` (created,
closed, live) after ``train()`` returns, so the test can see that every session was closed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from harness_trainer import AsyncGRPOConfig, HarnessAsyncGRPOTrainer
from tests.trainer.handmade import HandmadeFactory


def main(model_dir: str, output_dir: str) -> None:
    factory = HandmadeFactory(hang=lambda n: n >= 8)
    config = AsyncGRPOConfig(
        output_dir=output_dir, engine="none", num_generations=4, max_concurrent_rollouts=4, max_steps=100,
        learning_rate=1e-4, disable_tqdm=True, token_budget=64, rollout_timeout=600,
    )  # fmt: skip
    trainer = HarnessAsyncGRPOTrainer(model_dir, lambda sampling: factory, config)
    try:
        trainer.train()
    finally:
        summary = {"created": len(factory.created), "closed": factory.closed, "live": len(factory.live),
                   "step": trainer.state.step, "factory_closed": factory.factory_closed}  # fmt: skip
        Path(output_dir, "sessions.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main(*sys.argv[1:3])
