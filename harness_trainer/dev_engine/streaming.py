"""Streaming chat: the SSE replay of a generation in vLLM's chunk shapes.

A role chunk first (carrying ``prompt_token_ids``), then one chunk per sampled token with its
``token_ids`` and ``logprobs``, the finish reason on the last token's chunk, an optional usage chunk with
empty ``choices``, then ``data: [DONE]``. Keepalive comments go out while the model works. With tools,
text from ``<tool_call>`` on is held back and each call is sent whole when its ``</tool_call>`` closes
(vLLM sends a header chunk and then argument fragments; accumulated, the two are the same); chunks of
held tokens carry an empty delta but still their ids and logprobs, as vLLM's do.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

import harness_trainer.dev_engine.chat as chat
import harness_trainer.dev_engine.responses as responses
from harness_trainer.dev_engine.protocol import ChatCompletionRequest, EngineError
from harness_trainer.dev_engine.worker import TokenEvent

KEEPALIVE_SECONDS = 15.0


async def stream_chat(
    request: web.Request,
    req: ChatCompletionRequest,
    model: str,
    request_id: str,
    prompt_ids: list[int],
    items: AsyncIterator[TokenEvent | int],
    name: responses.TokenNamer,
    tools: list[dict[str, Any]] | None,
) -> web.StreamResponse:
    """SSE replay: role chunk (with prompt ids), one chunk per token, usage chunk, ``[DONE]``."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    created = int(time.time())
    common = {
        "request_id": request_id,
        "model": model,
        "created": created,
        "logprobs": req.logprobs,
        "return_token_ids": req.return_token_ids,
        "name": name,
    }

    async def send(payload: dict[str, Any]) -> None:
        await response.write(f"data: {json.dumps(payload)}\n\n".encode())

    await send(
        responses.chat_chunk(
            delta={"role": "assistant", "content": ""},
            events=[],
            finish_reason=None,
            prompt_ids=prompt_ids if req.return_token_ids else None,
            **common,
        )
    )
    text, held_from, count, sent_calls = "", None, 0, 0
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    iterator = items.__aiter__()
    pending = asyncio.ensure_future(iterator.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=KEEPALIVE_SECONDS)
            if not done:
                await response.write(b": keepalive\n\n")
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                break
            pending = asyncio.ensure_future(iterator.__anext__())
            if not isinstance(item, TokenEvent):
                continue
            count += 1
            text += item.text
            if tools and held_from is None and chat.TOOL_CALL_OPEN in text:
                held_from = text.index(chat.TOOL_CALL_OPEN)
                item_text = item.text[: max(0, len(item.text) - (len(text) - held_from))]
            else:
                item_text = item.text if held_from is None else ""
            delta: dict[str, Any] = {"content": item_text} if item_text else {}
            finish = item.finish_reason
            if held_from is not None:
                closed = text.count(chat.TOOL_CALL_CLOSE, held_from)
                if closed > sent_calls or finish is not None:
                    # Mid-stream, parse only up to the last closed block: an open one is not JSON yet.
                    upto = (
                        len(text)
                        if finish is not None
                        else text.rfind(chat.TOOL_CALL_CLOSE) + len(chat.TOOL_CALL_CLOSE)
                    )
                    new_calls = chat.parse_tool_calls(text[held_from:upto]).tool_calls[sent_calls:]
                    if new_calls:
                        delta = {
                            "content": item_text or None,
                            "tool_calls": [
                                {"index": sent_calls + i, **call} for i, call in enumerate(new_calls)
                            ],
                        }
                        sent_calls += len(new_calls)
                    elif finish is not None and not sent_calls:
                        delta = {"content": item_text + text[held_from:]}
                if finish == "stop" and sent_calls:
                    finish = "tool_calls"
            last = finish is not None and not include_usage
            await send(
                responses.chat_chunk(delta=delta, events=[item], finish_reason=finish, last=last, **common)
            )
    except EngineError as exc:
        await send(exc.body())
    except Exception as exc:  # headers are sent: the error can only travel as a stream event
        await send(EngineError(500, f"generation failed: {exc}").body())
    finally:
        pending.cancel()
        with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
            await pending
        await items.aclose()
    if include_usage:
        await send(
            responses.usage_chunk(
                request_id=request_id,
                model=model,
                created=created,
                prompt_tokens=len(prompt_ids),
                completion_tokens=count,
            )
        )
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
