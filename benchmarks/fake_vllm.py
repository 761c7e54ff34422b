"""The two servers the proxy benchmark runs behind the agents: a fake vLLM engine and a thin pass-through.

``engine``: answers ``POST /v1/chat/completions`` (non-streaming only, as the capture proxy calls it)
at once, in vLLM 0.32's reply shape (see ``tests/fixtures/vllm_cpu/``): top-level ``prompt_token_ids``,
``choices[0].token_ids`` (``COMPLETION_TOKENS`` ids), ``choices[0].logprobs.content`` with one
``{"token": "token_id:N", "logprob", "bytes", "top_logprobs": []}`` entry per id, and a ``bash`` tool call
in the message (``finish_reason: "tool_calls"``). Also ``GET /health`` and ``GET /v1/models``.

The prompt ids model an append-only chat template, so a conversation's prompts extend each other the way
a real engine's do: every message renders to a block of ids derived from a hash of its content (about
one id per 4 characters, behind a role header), the tool schemas render right after the first
message, and the prompt ends with a generation header. An assistant message renders to exactly the ids
the engine sampled for it, by construction: a reply's completion ids are the hash block of its tool
call's ``arguments`` text, which is what the message carries back on the next turn. So turn *k+1*'s
prompt is turn *k*'s prompt + completion + the new tool result's block + the generation header.

Speed: everything that does not depend on the request is rendered once at start-up (a logprobs entry
for each of the 65,536 possible ids, the reply's fixed JSON around the variable parts); message blocks
are cached by content, so a request costs one ``orjson`` parse, a few dict look-ups and a byte join.

``passthrough``: forwards every request's bytes to ``--upstream`` (same method, path and content type)
and the response's bytes back unchanged, over one shared ``aiohttp.ClientSession`` with a bounded
keep-alive pool (``TCP_NODELAY`` on both sides: aiohttp sets it on every connection). It is the
practical floor for any aiohttp proxy: HTTP in, HTTP out, no parsing.

Engine options for the rollout benchmark: ``--delay SECONDS`` holds every reply that long (a slow
engine, so agents stay in flight), and ``--command TEXT`` makes the tool call's command ``TEXT`` (with a
``# nonce`` comment, so each turn's reply still differs) instead of the default ``grep`` pipeline. For the
replicas benchmark: ``--max-concurrent N`` holds at most N replies at once (the others wait their turn), so
an engine with ``--delay`` has a fixed capacity of N / delay calls per second, as a real engine's batch does.

Both run with the access log off. Run: ``python benchmarks/fake_vllm.py engine --port P [--delay S]
[--command TEXT]`` or ``python benchmarks/fake_vllm.py passthrough --port P --upstream http://127.0.0.1:E``.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import functools
import hashlib
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

MODEL = "fake-vllm"
COMPLETION_TOKENS = 200
VOCAB = 1 << 16  # ids are 16-bit words of a hash
HEADER = {"system": b"1,10,", "user": b"1,11,", "tool": b"1,12,", "assistant": b"1,13,"}
GENERATION_HEADER = b"1,13"  # "<|im_start|>assistant\n": the prompt's last ids
CACHE_SIZE = 1 << 15


def hash_ids(key: bytes, count: int) -> list[int]:
    """``count`` ids in ``[0, VOCAB)``, a deterministic function of ``key``."""
    return array.array("H", hashlib.shake_128(key).digest(2 * count)).tolist()


def _logprob_entry(token_id: int) -> bytes:
    # Formatted, not orjson.dumps'd: each small orjson result kept alive holds a page of RSS.
    text = ",".join(str(97 + (token_id >> shift) % 26) for shift in (0, 5, 10))
    logprob = -0.5 - (token_id % 1000) / 250
    return (
        f'{{"token":"token_id:{token_id}","logprob":{logprob},"bytes":[{text}],"top_logprobs":[]}}'.encode()
    )


LOGPROB_ENTRIES = [_logprob_entry(token_id) for token_id in range(VOCAB)]


@functools.lru_cache(maxsize=CACHE_SIZE)
def text_block(role: str, content: str) -> tuple[bytes, int]:
    """A non-assistant message's ids as a JSON fragment (``"a,b,...,"``) and their count."""
    data = content.encode()
    ids = hash_ids(role.encode() + b"\0" + data, max(1, len(data) // 4))
    return HEADER.get(role, b"1,14,") + b",".join(b"%d" % i for i in ids) + b",2,", len(ids) + 3


@functools.lru_cache(maxsize=CACHE_SIZE)
def completion(arguments: str) -> tuple[list[int], bytes]:
    """The ids sampled for a reply whose tool call carries ``arguments``, and their JSON fragment."""
    ids = hash_ids(b"assistant\0" + arguments.encode(), COMPLETION_TOKENS)
    return ids, b",".join(b"%d" % i for i in ids)


def _content_text(content: Any) -> str:
    if isinstance(content, list):  # content parts: [{"type": "text", "text": ...}]
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


def render_prompt(messages: list[dict[str, Any]], tools: list[Any] | None) -> tuple[bytes, int]:
    """The prompt's ids as a JSON array, and their count (see the module docstring for the template)."""
    parts: list[bytes] = []
    count = 2
    for index, message in enumerate(messages):
        if message.get("role") == "assistant" and message.get("tool_calls"):
            ids_json = completion(message["tool_calls"][0]["function"]["arguments"])[1]
            parts += (GENERATION_HEADER, b",", ids_json, b",")
            count += 2 + COMPLETION_TOKENS
        else:
            block, size = text_block(str(message.get("role")), _content_text(message.get("content")))
            parts.append(block)
            count += size
        if index == 0 and tools:
            block, size = text_block("tools", orjson.dumps(tools).decode())
            parts.append(block)
            count += size
    return b"[" + b"".join(parts) + GENERATION_HEADER + b"]", count


def render_reply(request: dict[str, Any], command: str | None = None) -> bytes:
    """The whole vLLM-shaped chat completion for ``request``, as bytes; ``command``: the tool call's."""
    messages = request["messages"]
    prompt_json, prompt_count = render_prompt(messages, request.get("tools"))
    nonce = hashlib.blake2b(orjson.dumps(messages[-1]), digest_size=6).hexdigest()
    text = f"{command}  # {nonce}" if command else f"grep -rn 'def handler_{nonce}' src/ | head -n 20"
    arguments = orjson.dumps({"command": text}).decode()
    ids, ids_json = completion(arguments)
    usage = b'{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d,' % (
        prompt_count,
        prompt_count + COMPLETION_TOKENS,
        COMPLETION_TOKENS,
    )
    return b"".join(
        (
            b'{"id":"chatcmpl-',
            nonce.encode(),
            b'","object":"chat.completion","created":%d,"model":"' % int(time.time()),
            MODEL.encode(),
            b'","choices":[{"index":0,"message":{"role":"assistant","content":null,"refusal":null,'
            b'"annotations":null,"audio":null,"function_call":null,"tool_calls":[{"id":"chatcmpl-tool-',
            nonce.encode(),
            b'","type":"function","function":{"name":"bash","arguments":',
            orjson.dumps(arguments),
            b'}}],"reasoning":null},"logprobs":{"content":[',
            b",".join([LOGPROB_ENTRIES[i] for i in ids]),
            b']},"finish_reason":"tool_calls","stop_reason":null,"token_ids":[',
            ids_json,
            b'],"routed_experts":null}],"service_tier":null,"system_fingerprint":null,"usage":',
            usage,
            b'"prompt_tokens_details":null,"completion_tokens_details":null},"prompt_logprobs":null,'
            b'"prompt_token_ids":',
            prompt_json,
            b',"kv_transfer_params":null}',
        )
    )


DELAY = web.AppKey("delay", float)
COMMAND = web.AppKey("command", str)
SLOTS = web.AppKey("slots", asyncio.Semaphore)


async def chat_completions(request: web.Request) -> web.Response:
    body = orjson.loads(await request.read())
    if body.get("stream"):
        error = {"error": {"message": "the fake engine does not stream", "type": "BadRequestError"}}
        return web.Response(status=400, body=orjson.dumps(error), content_type="application/json")
    if request.app[DELAY] > 0:
        async with request.app[SLOTS]:
            await asyncio.sleep(request.app[DELAY])
    reply = render_reply(body, request.app[COMMAND] or None)
    return web.Response(body=reply, content_type="application/json")


async def health(_: web.Request) -> web.Response:
    return web.Response(status=200)


async def models(_: web.Request) -> web.Response:
    listing = {"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 131072}]}
    return web.Response(body=orjson.dumps(listing), content_type="application/json")


def engine_app(delay: float = 0.0, command: str = "", max_concurrent: int = 0) -> web.Application:
    """The fake engine; each reply waits ``delay`` seconds (at most ``max_concurrent`` at once, when given),
    its tool call runs ``command`` when given."""
    app = web.Application(client_max_size=64 * 1024**2)
    app[DELAY], app[COMMAND] = delay, command
    app[SLOTS] = asyncio.Semaphore(max_concurrent or 1_000_000)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    return app


UPSTREAM = web.AppKey("upstream", str)
CLIENT = web.AppKey("client", ClientSession)


def passthrough_app(upstream: str, pool: int) -> web.Application:
    app = web.Application(client_max_size=64 * 1024**2)
    app[UPSTREAM] = upstream.rstrip("/")

    async def client_ctx(app: web.Application) -> AsyncIterator[None]:
        connector = TCPConnector(limit=pool, keepalive_timeout=60)
        async with ClientSession(connector=connector, timeout=ClientTimeout(total=600)) as client:
            app[CLIENT] = client
            yield

    async def forward(request: web.Request) -> web.Response:
        headers = {"Content-Type": request.content_type} if request.body_exists else {}
        async with app[CLIENT].request(
            request.method, app[UPSTREAM] + request.path_qs, data=await request.read(), headers=headers
        ) as upstream_reply:
            body = await upstream_reply.read()
            content_type = upstream_reply.headers.get("Content-Type", "application/octet-stream")
        return web.Response(status=upstream_reply.status, body=body, headers={"Content-Type": content_type})

    app.cleanup_ctx.append(client_ctx)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("role", choices=("engine", "passthrough"))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", default=None, help="passthrough: the engine's base URL")
    parser.add_argument("--pool", type=int, default=128, help="passthrough: keep-alive connections, at most")
    parser.add_argument("--delay", type=float, default=0.0, help="engine: seconds to hold each reply")
    parser.add_argument("--command", default="", help="engine: the bash tool call's command (default: grep)")
    parser.add_argument(
        "--max-concurrent", type=int, default=0, help="engine: replies held at once, at most (0: no limit)"
    )
    args = parser.parse_args()
    if args.role == "passthrough" and not args.upstream:
        parser.error("passthrough needs --upstream")
    if args.role == "engine":
        app = engine_app(args.delay, args.command, args.max_concurrent)
    else:
        app = passthrough_app(args.upstream, args.pool)
    web.run_app(app, host=args.host, port=args.port, access_log=None)


if __name__ == "__main__":
    main()
