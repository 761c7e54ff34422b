"""A deterministic fake vLLM engine over real HTTP, for the proxy's tests.

It answers ``POST /v1/chat/completions`` (non-streaming) in vLLM 0.32's shape, with ``prompt_token_ids``,
``choices[0].token_ids`` and ``logprobs.content[].token = "token_id:N"``. Its "tokenizer" is append-only by
construction, like a real chat template: a prompt is the concatenation of one block per message plus the
assistant header, and a reply's completion ids are exactly the ids its assistant message renders to in
the next prompt, so a follow-up call's prompt extends the previous prompt + completion.

What it replies is driven by the last message's text:
- ``CALL:<name>:<json args>`` → a tool call (``finish_reason: tool_calls``);
- ``SAY:<text>`` → that text; anything else → ``"ok: "`` + the first 24 characters.
``max_tokens`` truncates (``finish_reason: length``); ``stop`` strings cut the reply (``stop_reason``).

Faults are queued with ``POST /_faults {"queue": [{"mode": ...}, ...]}``; each chat request takes the
next one: ``status`` (answer ``status`` with ``message``, optional ``retry_after``), ``timeout`` (sleep
``seconds``), ``disconnect`` (send headers and half a body, then drop the connection), ``no_ids``,
``bad_pairing``, ``positive_logprob``, ``context_length`` (vLLM's 400), ``malformed`` (200, not JSON),
``delay`` (sleep ``seconds``, then answer), ``spaced`` (pretty-printed JSON). Replies are otherwise
compact JSON, as vLLM sends them. ``GET /_requests`` lists the bodies received.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

from aiohttp import web

MODEL = "fake-model"
ROLE_IDS = {"system": 1, "user": 2, "assistant": 3, "tool": 4, "developer": 1}
END, TOOLS = 5, 6
OFFSET = 10  # byte b is token id b + OFFSET


def encode(text: str) -> list[int]:
    return [b + OFFSET for b in text.encode()]


def tool_call_text(name: str, arguments: str) -> str:
    args = json.loads(arguments) if arguments else {}
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}, sort_keys=True) + "</tool_call>"


def message_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    text = content or ""
    for call in message.get("tool_calls") or []:
        function = call.get("function", {})
        text += tool_call_text(function.get("name", ""), function.get("arguments") or "{}")
    return text


def render(messages: list[dict[str, Any]], tools: list[Any] | None) -> list[int]:
    ids: list[int] = []
    if tools:
        names = sorted(t.get("function", {}).get("name", "") for t in tools)
        ids += [TOOLS, *encode(",".join(names)), END]
    for message in messages:
        ids += [ROLE_IDS.get(message.get("role", "user"), 2), *encode(message_text(message)), END]
    return [*ids, ROLE_IDS["assistant"]]


def plan_reply(messages: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
    last = message_text(messages[-1]) if messages else ""
    if "CALL:" in last:
        spec = last.split("CALL:", 1)[1]
        name, _, args = spec.partition(":")
        args = json.dumps(json.loads(args or "{}"), sort_keys=True)
        call_id = f"call_{abs(hash((len(messages), name, args))) % 10**12:012d}"
        return None, [{"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}]
    if "SAY:" in last:
        return last.split("SAY:", 1)[1], []
    return "ok: " + last[:24], []


class FakeEngine:
    def __init__(self, model: str = MODEL) -> None:
        self.model = model
        """The name ``GET /v1/models`` lists (replies name :data:`MODEL` whatever it is)."""
        self.faults: list[dict[str, Any]] = []
        self.requests: list[dict[str, Any]] = []
        self.authorizations: list[dict[str, str]] = []
        """Per chat request, its ``Authorization`` and ``X-*`` headers (what a session's credential set)."""
        self.weight_version = 0
        self.start_time = time.time()
        """``process_start_time_seconds`` on its ``/metrics`` (change it to play a restarted engine)."""

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/_faults", self.set_faults)
        app.router.add_get("/_requests", self.list_requests)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def metrics(self, request: web.Request) -> web.Response:
        lines = ["# TYPE process_start_time_seconds gauge", f"process_start_time_seconds {self.start_time!r}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def set_faults(self, request: web.Request) -> web.Response:
        self.faults = list((await request.json())["queue"])
        return web.json_response({"queued": len(self.faults)})

    async def list_requests(self, request: web.Request) -> web.Response:
        return web.json_response(self.requests)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.authorizations.append(
            {k: v for k, v in request.headers.items() if k == "Authorization" or k.startswith("X-")}
        )
        fault = self.faults.pop(0) if self.faults else {}
        mode = fault.get("mode")
        if mode in ("timeout", "delay"):
            await asyncio.sleep(float(fault.get("seconds", 30)))
        if mode == "status":
            headers = {"Retry-After": str(fault["retry_after"])} if "retry_after" in fault else {}
            error = {"message": fault.get("message", "fault"), "type": "Error", "code": fault["status"]}
            return web.json_response({"error": error}, status=fault["status"], headers=headers)
        if mode == "context_length":
            message = (
                "This model's maximum context length is 32 tokens. However, your request has 90 input "
                "tokens. Please reduce the length of the input messages."
            )
            return web.json_response({"error": {"message": message, "type": "BadRequestError"}}, status=400)
        if mode == "malformed":
            return web.Response(body=b"{not json", content_type="application/json")
        reply = self.reply(body, mode)
        if mode == "disconnect":
            raw = json.dumps(reply).encode()
            response = web.StreamResponse(headers={"Content-Length": str(len(raw))})
            await response.prepare(request)
            await response.write(raw[: len(raw) // 2])
            assert request.transport is not None
            request.transport.close()
            return response
        if mode == "spaced":  # what a pretty-printing engine would send: the proxy's slow path
            return web.json_response(reply, dumps=lambda v: json.dumps(v, indent=1))
        return web.json_response(reply, dumps=lambda v: json.dumps(v, separators=(",", ":")))

    def reply(self, body: dict[str, Any], mode: str | None) -> dict[str, Any]:
        messages = body["messages"]
        prompt = render(messages, body.get("tools"))
        content, calls = plan_reply(messages)
        finish, stop_reason = ("tool_calls" if calls else "stop"), None
        for stop in [body["stop"]] if isinstance(body.get("stop"), str) else body.get("stop") or []:
            if content and stop in content:
                content, stop_reason = content[: content.index(stop)], stop
        completion = [*encode(message_text({"content": content, "tool_calls": calls})), END]
        cap = body.get("max_tokens")
        if cap is not None and len(completion) > cap:
            completion, finish, calls = completion[:cap], "length", []
            content = bytes(i - OFFSET for i in completion if i >= OFFSET).decode(errors="replace")
        logprobs = [-0.05 - (i % 7) * 0.1 for i in range(len(completion))]
        entries = [
            {"token": f"token_id:{t}", "logprob": lp, "bytes": [], "top_logprobs": []}
            for t, lp in zip(completion, logprobs, strict=True)
        ]
        if mode == "bad_pairing" and entries:
            entries[0]["token"] = "token_id:999999"
        if mode == "positive_logprob" and entries:
            entries[0]["logprob"] = 0.5
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content,
            "tool_calls": calls,
            "reasoning_content": None,
        }
        choice = {
            "index": 0,
            "message": message,
            "logprobs": {"content": entries},
            "finish_reason": finish,
            "stop_reason": stop_reason,
            "token_ids": completion,
        }
        reply: dict[str, Any] = {
            "id": f"chatcmpl-{len(self.requests)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": MODEL,
            "choices": [choice],
            "prompt_token_ids": prompt,
            "weight_version": self.weight_version,
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(completion),
                "total_tokens": len(prompt) + len(completion),
            },
        }
        if mode == "no_ids":
            del reply["prompt_token_ids"], choice["token_ids"]
        return reply


class ServerThread:
    """Runs aiohttp apps on loopback in a background event loop, so sync clients can call them."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="servers")
        self.thread.start()
        self.runners: list[web.AppRunner] = []

    def run(self, coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def serve(self, app: web.Application, port: int = 0) -> str:
        async def start() -> str:
            runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", port)
            await site.start()
            self.runners.append(runner)
            return f"http://127.0.0.1:{runner.addresses[-1][1]}"

        return self.run(start())

    def stop_runner(self, runner: web.AppRunner) -> None:
        self.run(runner.cleanup())
        self.runners.remove(runner)

    def close(self) -> None:
        for runner in reversed(self.runners):
            self.run(runner.cleanup())
        self.runners.clear()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
