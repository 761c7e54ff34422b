"""Reading a weight update off the wire: a safetensors body, or a path to a safetensors file.

``POST /update_weights?version=N`` with ``Content-Type: application/octet-stream`` carries the tensors
themselves (a state dict, whole or partial, serialised by ``safetensors.torch.save``); with
``Content-Type: application/json`` the body is ``{"path": FILE, "version": N}`` and the engine reads the
file itself (the trainer and the engine share a disk). Names and shapes are checked by the worker before
anything is copied, so a bad update changes nothing.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from harness_trainer.dev_engine.protocol import EngineError


def _version(raw: Any) -> int:
    try:
        version = int(raw)
    except (TypeError, ValueError) as exc:
        raise EngineError(
            400, f"a weight update needs an integer version, got {raw!r}", param="version"
        ) from exc
    return version


async def read_weight_update(request: web.Request) -> tuple[dict[str, Any], int]:
    """Parse ``request`` into (named tensors, version); raises EngineError(400) on anything malformed."""
    from safetensors import SafetensorError
    from safetensors.torch import load, load_file

    if request.content_type == "application/json":
        try:
            body = json.loads(await request.read())
        except json.JSONDecodeError as exc:
            raise EngineError(400, f"malformed JSON body: {exc}") from exc
        if not isinstance(body, dict) or not isinstance(body.get("path"), str):
            raise EngineError(400, 'expected {"path": "<file.safetensors>", "version": N}', param="path")
        version = _version(body.get("version", request.query.get("version")))
        try:
            return load_file(body["path"]), version
        except (OSError, SafetensorError) as exc:
            raise EngineError(
                400, f"cannot read safetensors file {body['path']}: {exc}", param="path"
            ) from exc
    version = _version(request.query.get("version"))
    try:
        return load(await request.read()), version
    except (SafetensorError, ValueError) as exc:
        raise EngineError(400, f"the body is not a safetensors state dict: {exc}") from exc
