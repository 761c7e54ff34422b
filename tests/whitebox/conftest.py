"""A scripted dev engine for the white-box tests, served in process on loopback.

The dev engine's own ``--script`` mode scripts chat completions only; the model step samples through
``/v1/completions``. So this engine is the real dev engine app (its routes, validation and wire shapes)
whose worker *replays* scripted text instead of sampling it: the text is tokenised once, emitted as if
sampled, and scored by the tiny model, so the ids are fixed while the logprobs stay the model's own
processed ones (``ModelWorker.replay``, what the script mode uses too).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from harness_trainer.dev_engine.api import EngineConfig, EngineState, build_app
from harness_trainer.dev_engine.worker import GenerationParams, Job, ModelWorker
from tests.proxy.fake_engine import ServerThread


class ReplayingWorker(ModelWorker):
    """A model worker whose generations are the queued texts, tokenised, with the model's logprobs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.replies: deque[str] = deque()
        self.prompts: list[list[int]] = []

    def generate(self, job: Job, prompt_ids: list[int], params: GenerationParams) -> int:
        self.prompts.append(list(prompt_ids))
        text = self.replies.popleft()  # an IndexError here is a test that scripted too few replies
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.replay(job, prompt_ids, ids, params)


@dataclass
class ScriptedEngine:
    url: str
    worker: ReplayingWorker
    model: str = "tiny"
    sent: list[str] = field(default_factory=list)

    def script(self, *texts: str) -> None:
        self.worker.replies.clear()
        self.worker.prompts.clear()
        self.worker.replies.extend(texts)


@pytest.fixture(scope="module")
def scripted_engine(tiny_model_dir: Path) -> Iterator[ScriptedEngine]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    worker = ReplayingWorker(model, tokenizer, (tokenizer.eos_token_id,))
    config = EngineConfig(served_model_name="tiny", model_path=str(tiny_model_dir), max_model_len=4096)
    servers = ServerThread()
    try:
        url = servers.serve(build_app(EngineState(config=config, worker=worker)))
        yield ScriptedEngine(url=url, worker=worker)
    finally:
        servers.close()  # the app's cleanup stops the worker thread
    assert not worker._thread.is_alive()
