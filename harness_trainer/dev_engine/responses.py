"""vLLM's OpenAI-compatible response shapes, built from sampled tokens (pure functions).

Non-streaming chat: ``prompt_token_ids`` at the top level, ``choices[0].token_ids`` and
``choices[0].logprobs.content[i] = {token, logprob, bytes, top_logprobs}`` with one entry per sampled id,
including the end-of-turn token the text omits. Streaming chat: ``prompt_token_ids`` on the first chunk
only, ``token_ids`` and ``logprobs`` per chunk, ``finish_reason`` on the last token's chunk, then an
optional usage chunk with empty ``choices``. Each response also carries ``weight_version``, the engine's
version of the weights that sampled it (a dev-engine extension; vLLM has no such field).
"""

from __future__ import annotations

import functools
import time
import uuid
from typing import Any

from harness_trainer import __version__
from harness_trainer.dev_engine.worker import TokenEvent

SYSTEM_FINGERPRINT = f"harness-trainer-dev-engine-{__version__}"


class TokenNamer:
    """How a token id is written in logprobs (``token_id:N`` or its text), and the bytes it stands for."""

    def __init__(self, tokenizer: Any, as_ids: bool) -> None:
        self._tokenizer = tokenizer
        self.as_ids = as_ids

    def __call__(self, token_id: int) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        return self._tokenizer.decode([token_id])

    def raw_bytes(self, token_id: int) -> list[int]:
        """The token's own bytes (as vLLM reports them, whatever ``token`` says)."""
        return token_bytes(self._tokenizer, token_id)


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level table, inverted: printable bytes stand for themselves, the rest from U+0100 on."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(256 + extra)] = byte
            extra += 1
    return table


def token_bytes(tokenizer: Any, token_id: int) -> list[int]:
    """Bytes of one token: byte-level BPE pieces map back through GPT-2's byte table."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if token_id in tokenizer.all_special_ids or piece in tokenizer.get_added_vocab():
        return list(piece.encode("utf-8"))
    table = _byte_decoder()
    if all(char in table for char in piece):
        return [table[char] for char in piece]
    return list(tokenizer.decode([token_id]).encode("utf-8"))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def chat_logprob(event: TokenEvent, name: TokenNamer) -> dict[str, Any]:
    return {
        "token": name(event.token_id),
        "logprob": event.logprob,
        "bytes": name.raw_bytes(event.token_id),
        "top_logprobs": [
            {"token": name(i), "logprob": lp, "bytes": name.raw_bytes(i)} for i, lp in event.top
        ],
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def chat_completion(
    *,
    request_id: str,
    model: str,
    prompt_ids: list[int],
    events: list[TokenEvent],
    message: dict[str, Any],
    finish_reason: str,
    logprobs: bool,
    return_token_ids: bool,
    name: TokenNamer,
    weight_version: int,
) -> dict[str, Any]:
    """A non-streaming ``chat.completion`` object."""
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": {"content": [chat_logprob(e, name) for e in events]} if logprobs else None,
                "finish_reason": finish_reason,
                "stop_reason": events[-1].stop_reason if events else None,
                "token_ids": [e.token_id for e in events] if return_token_ids else None,
                "routed_experts": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": usage(len(prompt_ids), len(events)),
        "prompt_logprobs": None,
        "prompt_token_ids": prompt_ids if return_token_ids else None,
        "prompt_text": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
        "weight_version": weight_version,
    }


def assistant_message(content: str | None, tool_calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The reply message; like vLLM, ``tool_calls`` is present only when there are some."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
    }
    if tool_calls:
        message["tool_calls"] = tool_calls
    message["reasoning"] = None
    return message


def chat_chunk(
    *,
    request_id: str,
    model: str,
    created: int,
    delta: dict[str, Any],
    events: list[TokenEvent],
    finish_reason: str | None,
    logprobs: bool,
    return_token_ids: bool,
    name: TokenNamer,
    prompt_ids: list[int] | None = None,
    last: bool = False,
) -> dict[str, Any]:
    """One ``chat.completion.chunk``; ``prompt_ids`` only on the first chunk, the fingerprint on the last."""
    choice: dict[str, Any] = {
        "index": 0,
        "delta": delta,
        "logprobs": {"content": [chat_logprob(e, name) for e in events]} if logprobs and events else None,
        "finish_reason": finish_reason,
    }
    if finish_reason is not None:
        choice["stop_reason"] = events[-1].stop_reason if events else None
    if return_token_ids and events:
        choice["token_ids"] = [e.token_id for e in events]
    chunk: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if prompt_ids is not None:
        chunk["prompt_token_ids"] = prompt_ids
        chunk["prompt_text"] = None
    if last:
        chunk["system_fingerprint"] = SYSTEM_FINGERPRINT
    if events and events[-1].weight_version is not None:
        chunk["weight_version"] = events[-1].weight_version
    return chunk


def usage_chunk(
    *,
    request_id: str,
    model: str,
    created: int,
    prompt_tokens: int,
    completion_tokens: int,
    object_name: str = "chat.completion.chunk",
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": object_name,
        "created": created,
        "model": model,
        "choices": [],
        # vLLM's usage chunk carries the three counts only, and the fingerprint of the last chunk.
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
        },
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }


def completion_logprobs(events: list[TokenEvent], name: TokenNamer, start_offset: int = 0) -> dict[str, Any]:
    """The legacy completions logprobs object (``tokens``, ``token_logprobs``, ``top_logprobs``...)."""
    offsets, offset = [], start_offset
    for event in events:
        offsets.append(offset)
        offset += len(event.text)
    return {
        "text_offset": offsets,
        "token_logprobs": [e.logprob for e in events],
        "tokens": [name(e.token_id) for e in events],
        "top_logprobs": [{name(e.token_id): e.logprob, **{name(i): lp for i, lp in e.top}} for e in events],
    }


def text_completion(
    *,
    request_id: str,
    model: str,
    prompt_ids: list[int],
    events: list[TokenEvent],
    logprobs: bool,
    return_token_ids: bool,
    name: TokenNamer,
    weight_version: int,
) -> dict[str, Any]:
    """A non-streaming ``text_completion`` object."""
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": "".join(e.text for e in events),
                "logprobs": completion_logprobs(events, name) if logprobs else None,
                "finish_reason": events[-1].finish_reason if events else "length",
                "stop_reason": events[-1].stop_reason if events else None,
                "token_ids": [e.token_id for e in events] if return_token_ids else None,
                "prompt_logprobs": None,
                "prompt_token_ids": prompt_ids if return_token_ids else None,
                "routed_experts": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": usage(len(prompt_ids), len(events)),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
        "weight_version": weight_version,
    }
