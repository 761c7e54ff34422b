"""The dev engine: a CPU, transformers-backed server with vLLM's wire shapes (see ``api``).

``load_engine(...)`` builds the state (model, tokenizer, worker) that ``api.build_app`` serves;
``serve(...)`` runs it until interrupted. Models load with ``from_pretrained``, so a local directory
(the tiny model) and a hub name take the same path.
"""

from __future__ import annotations

from pathlib import Path

from harness_trainer.dev_engine.api import EngineConfig, EngineState, build_app


def load_engine(
    model: str,
    *,
    served_model_name: str | None = None,
    max_model_len: int | None = None,
    script: str | Path | None = None,
    seed: int = 0,
    return_tokens_as_token_ids: bool = True,
) -> EngineState:
    """Load ``model`` (a directory or hub id) on CPU in float32 and start its worker."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from harness_trainer.dev_engine.script import ScriptedReplies
    from harness_trainer.dev_engine.worker import ModelWorker

    replies = ScriptedReplies.from_file(script) if script is not None else None
    tokenizer = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    eos = set()
    try:
        eos_ids = GenerationConfig.from_pretrained(model).eos_token_id
        eos.update(eos_ids if isinstance(eos_ids, list) else [eos_ids] if eos_ids is not None else [])
    except OSError:
        pass  # no generation_config.json: the tokenizer's eos is the only stop token
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    context = lm.config.max_position_embeddings
    if max_model_len is not None and max_model_len > context:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's context of {context} tokens")
    config = EngineConfig(
        served_model_name=served_model_name or model,
        model_path=model,
        max_model_len=max_model_len or context,
        return_tokens_as_token_ids=return_tokens_as_token_ids,
    )
    return EngineState(
        config=config, worker=ModelWorker(lm, tokenizer, tuple(sorted(eos)), seed=seed), script=replies
    )


def serve(state: EngineState, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve ``state`` on ``host:port`` until interrupted (the worker stops on the way out)."""
    from aiohttp import web

    web.run_app(build_app(state), host=host, port=port, print=None, access_log=None)
