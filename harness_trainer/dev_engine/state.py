"""What a running dev engine holds: its start-up config, its model worker, and its optional script."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from harness_trainer.dev_engine.script import ScriptedReplies
from harness_trainer.dev_engine.worker import ModelWorker


@dataclass
class EngineConfig:
    """What the server was started with."""

    served_model_name: str
    model_path: str
    max_model_len: int
    return_tokens_as_token_ids: bool = True
    max_request_bytes: int = 64 * 1024 * 1024


@dataclass
class EngineState:
    config: EngineConfig
    worker: ModelWorker
    script: ScriptedReplies | None = None


STATE = web.AppKey("engine_state", EngineState)
