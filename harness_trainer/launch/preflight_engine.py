"""Preflight's engine checks and the HTTP helpers every preflight check shares: what the engine says of
itself (its kind, its served models, the capture shapes of one ``max_tokens=1`` completion, vLLM's
dev-mode ``/server_info``), each failure a one-line :class:`PreflightError`
(:mod:`harness_trainer.launch.preflight` runs them in order; :mod:`harness_trainer.launch.probes` checks
what it does)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import httpx

from harness_trainer.engines.kinds import kind_of

PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": []},
    },
}


class PreflightError(Exception):
    """A check failed; the message is one line saying what is wrong and how to fix it."""


def detect_engine(engine_url: str, timeout_s: float) -> str:
    """The engine's kind (:func:`~harness_trainer.engines.detect_engine_kind`, which the trainer asks too)."""
    from harness_trainer.engines import EngineUnavailable, detect_engine_kind  # late: engines loads torch

    try:
        return detect_engine_kind(engine_url, timeout_s)
    except EngineUnavailable as exc:
        cause = exc.__cause__ or exc  # the transport's own error, as the other unreachable checks name it
        raise PreflightError(f"engine at {engine_url} unreachable (GET /weight_version): {cause!r}") from exc


def check_engine(client: httpx.Client, engine_url: str, kind: str, *, weight_sync: str = "auto") -> list[str]:
    """The engine's served model names, after checking that it gives the capture proxy what it records
    (and, for an engine that takes weights out of band, vLLM, that it takes them by the path
    ``weight_sync`` resolves to)."""
    models = get_or_refuse(client, engine_url, "/v1/models", "engine")
    served = [str(m.get("id")) for m in json_or_empty(models).get("data") or [] if isinstance(m, dict)]
    if models.status_code != 200 or not served:
        raise PreflightError(
            f"engine at {engine_url} lists no model on GET /v1/models ({models.status_code})"
        )
    body = {
        "model": served[0],
        "messages": [{"role": "user", "content": "Say OK."}],
        "tools": [PROBE_TOOL],
        "max_tokens": 1,
        "temperature": 1.0,
        "seed": 0,
        "logprobs": True,
        "top_logprobs": 0,
        "return_token_ids": True,
    }
    try:
        reply = client.post(f"{engine_url}/v1/chat/completions", json=body)
    except httpx.HTTPError as exc:
        raise PreflightError(f"engine at {engine_url} failed a one-token chat completion: {exc!r}") from exc
    if reply.status_code != 200:
        raise PreflightError(
            f"engine at {engine_url} refused a one-token chat completion with a tool and logprobs "
            f"({reply.status_code}: {error_text(reply)}); vLLM needs --enable-auto-tool-choice "
            "--tool-call-parser <parser>"
        )
    check_capture_shapes(json_or_empty(reply), engine_url)
    if kind_of(kind).weights_out_of_band:
        from harness_trainer.engines.weight_sync import choose_weight_sync

        check_vllm_config(
            client, engine_url, needs_transfer_engine=choose_weight_sync(weight_sync, engine_url) == "nccl"
        )
    return served


def check_capture_shapes(reply: Mapping[str, Any], engine_url: str) -> None:
    """A chat completion carries the engine's prompt ids, the sampled ids and one logprob per sampled id."""
    if not _ids(reply.get("prompt_token_ids")):
        raise PreflightError(
            f"engine at {engine_url} returned no prompt_token_ids for return_token_ids=true: the capture "
            "proxy records the engine's own prompt ids (use a vLLM that honours return_token_ids)"
        )
    choice = (reply.get("choices") or [{}])[0]
    sampled = _ids(choice.get("token_ids"))
    if not sampled:
        raise PreflightError(
            f"engine at {engine_url} returned no completion token_ids for return_token_ids=true"
        )
    entries = (choice.get("logprobs") or {}).get("content") or []
    if len(entries) != len(sampled):
        raise PreflightError(
            f"engine at {engine_url} returned {len(entries)} logprob entries for {len(sampled)} sampled "
            "token(s) with logprobs=true"
        )
    for token_id, entry in zip(sampled, entries, strict=True):
        if entry.get("token") != f"token_id:{token_id}":
            raise PreflightError(
                f"engine at {engine_url} names sampled token {token_id} {entry.get('token')!r} in its "
                "logprobs, not 'token_id:N': start vLLM with --return-tokens-as-token-ids"
            )
        logprob = entry.get("logprob")
        if isinstance(logprob, bool) or not isinstance(logprob, int | float) or not logprob <= 0:
            raise PreflightError(f"engine at {engine_url} returned logprob {logprob!r}, not a number ≤ 0")
        if not math.isfinite(logprob):
            raise PreflightError(f"engine at {engine_url} returned logprob {logprob!r}, not a finite number")


def check_vllm_config(client: httpx.Client, engine_url: str, *, needs_transfer_engine: bool = True) -> None:
    """vLLM runs in dev mode, with processed logprobs and, when the weights go by NCCL, a weight transfer
    engine (``GET /server_info``; the ``file`` path needs dev mode only: its reload is a collective RPC).

    A field that this vLLM version does not report is not held against it.
    """
    reply = get_or_refuse(client, engine_url, "/server_info", "engine", params={"config_format": "json"})
    if reply.status_code == 404:
        raise PreflightError(
            f"vLLM at {engine_url} has no dev-mode routes (GET /server_info is 404): start it with "
            "VLLM_SERVER_DEV_MODE=1, the trainer pauses it and pushes weights through them"
        )
    config = json_or_empty(reply).get("vllm_config")
    if reply.status_code != 200 or not isinstance(config, dict):
        raise PreflightError(f"vLLM at {engine_url} answered GET /server_info with {reply.status_code}")
    mode = (config.get("model_config") or {}).get("logprobs_mode", "processed_logprobs")
    if mode != "processed_logprobs":
        raise PreflightError(
            f"vLLM at {engine_url} returns {mode}: start it with --logprobs-mode processed_logprobs (the "
            "trainer's importance ratio compares against the policy's logprobs after temperature)"
        )
    if needs_transfer_engine and "weight_transfer_config" in config and not config["weight_transfer_config"]:
        raise PreflightError(
            f"vLLM at {engine_url} cannot take weights by NCCL: start it with "
            """--weight-transfer-config '{"backend": "nccl"}' (or --weight-sync file, same host only)"""
        )


def get_or_refuse(client: httpx.Client, base_url: str, path: str, what: str, **kwargs: Any) -> httpx.Response:
    try:
        return client.get(base_url + path, **kwargs)
    except httpx.HTTPError as exc:
        raise PreflightError(f"{what} at {base_url} unreachable (GET {path}): {exc!r}") from exc


def json_or_empty(reply: httpx.Response) -> dict[str, Any]:
    try:
        body = reply.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def error_text(reply: httpx.Response) -> str:
    """The server's own error message on one line (OpenAI, vLLM and rollout-server shapes)."""
    body = json_or_empty(reply)
    error = body.get("error", body.get("detail", reply.text))
    message = error.get("message", error) if isinstance(error, dict) else error
    return " ".join(str(message).split())[:300]


def _ids(value: Any) -> list[int]:
    """``value`` as a non-empty list of token ids, or empty when it is not one."""
    if not isinstance(value, list) or not value:
        return []
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
        return []
    return value


def span(indices: list[int]) -> str:
    return f"{min(indices)}–{max(indices)}" if indices else "none"
