"""The dev engine's HTTP server: a CPU, transformers-backed stand-in for vLLM's OpenAI server.

Routes (same wire shapes as vLLM serving with ``--return-tokens-as-token-ids`` and
``--logprobs-mode processed_logprobs``):

- ``POST /v1/chat/completions`` (streaming and not), ``POST /v1/completions`` (string or token-id prompt),
  ``GET /v1/models``, ``GET /health``, ``POST /tokenize``, ``POST /detokenize``.
- ``GET /metrics``: its load in Prometheus text under vLLM's metric names (module ``metrics``).
- Weight control for the trainer (module ``control``): ``POST /pause``, ``POST /resume``,
  ``GET /is_paused``, ``POST /update_weights``, ``GET /weight_version``.

Errors are ``{"error": {"message", "type", "param", "code"}}``: malformed JSON or a bad field → 400 with
the reason, unknown model → 404, prompt longer than the context → 400, ``n > 1`` → 400. The server keeps
serving after every one of them.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pydantic
from aiohttp import web

import harness_trainer.dev_engine.chat as chat
import harness_trainer.dev_engine.responses as responses
from harness_trainer.dev_engine.control import add_control_routes
from harness_trainer.dev_engine.metrics import metrics
from harness_trainer.dev_engine.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EngineError,
    SamplingFields,
    TokenizeRequest,
)
from harness_trainer.dev_engine.script import ScriptError, completion_ids, reply_ids
from harness_trainer.dev_engine.state import STATE, EngineConfig, EngineState
from harness_trainer.dev_engine.streaming import stream_chat
from harness_trainer.dev_engine.worker import GenerationParams, Job, TokenEvent, event_emitter

__all__ = ["EngineConfig", "EngineState", "build_app"]


@web.middleware
async def errors_as_json(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except EngineError as exc:
        return web.json_response(exc.body(), status=exc.status)
    except pydantic.ValidationError as exc:
        errors = exc.errors()
        reasons = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in errors)
        param = ".".join(["body", *map(str, errors[0]["loc"])]) if errors else None
        return web.json_response(EngineError(400, reasons, param=param).body(), status=400)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return web.json_response(EngineError(exc.status, exc.reason or "error").body(), status=exc.status)


async def read_json(request: web.Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EngineError(400, f"malformed JSON body: {exc}", param="body") from exc
    if not isinstance(body, dict):
        raise EngineError(400, "the request body must be a JSON object", param="body")
    return body


def check_model(state: EngineState, model: str | None) -> str:
    if model is not None and model not in (state.config.served_model_name, state.config.model_path):
        raise EngineError(404, f"The model `{model}` does not exist.", param="model")
    return state.config.served_model_name


def generation_params(
    state: EngineState, request: SamplingFields, prompt_len: int, limit: int | None, top_logprobs: int
) -> GenerationParams:
    room = state.config.max_model_len - prompt_len
    if room <= 0:
        raise EngineError(
            400,
            f"This model's maximum context length is {state.config.max_model_len} tokens. "
            f"However, your request has {prompt_len} input tokens.",
            param="input_tokens",
        )
    if limit is not None and limit > room:
        raise EngineError(
            400,
            f"'max_tokens' is too large: {limit}. This model's maximum context length is "
            f"{state.config.max_model_len} tokens and your request has {prompt_len} input "
            f"tokens ({limit} > {state.config.max_model_len} - {prompt_len}).",
            param="max_tokens",
        )
    temperature = 1.0 if request.temperature is None else request.temperature
    return GenerationParams(
        max_tokens=limit or room,
        temperature=temperature,
        seed=request.seed,
        stop=request.stop_strings(),
        stop_token_ids=tuple(request.stop_token_ids or ()),
        top_logprobs=top_logprobs,
    )


async def run_job(state: EngineState, body: Any) -> AsyncIterator[TokenEvent | int]:
    """Submit ``body(job)`` to the worker; yield its TokenEvents, then the weight version."""
    queue: asyncio.Queue = asyncio.Queue()
    job = Job(run=body, emit=event_emitter(asyncio.get_running_loop(), queue))
    state.worker.submit(job)
    try:
        while True:
            kind, payload = await queue.get()
            if kind == "error":
                if isinstance(payload, ScriptError):
                    raise EngineError(400, str(payload)) from payload
                raise payload
            yield payload
            if kind == "done":
                return
    finally:
        job.cancelled.set()  # a client that went away stops its generation at the next token


async def job_body(
    state: EngineState,
    prompt_ids: list[int],
    params: GenerationParams,
    scripted_ids: Callable[[dict[str, Any]], list[int]],
    skip_script: bool = False,
) -> Callable[[Job], int]:
    """What a request's job runs: sampling, or in scripted mode (unless the request asks to
    ``skip_script``) the script's next reply (its ids from ``scripted_ids``) replayed with the model's
    logprobs. A script that has run out is a 400."""
    if state.script is None or skip_script:
        return lambda job: state.worker.generate(job, prompt_ids, params)
    try:
        fixed = await asyncio.to_thread(scripted_ids, state.script.take())
    except ScriptError as exc:
        raise EngineError(400, str(exc)) from exc
    return lambda job: state.worker.replay(job, prompt_ids, fixed, params)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = ChatCompletionRequest.model_validate(await read_json(request))
    model = check_model(state, req.model)
    tools = req.tools if req.tool_choice != "none" else None
    try:
        prompt_ids = await asyncio.to_thread(
            chat.render_prompt_ids, state.worker.tokenizer, req.messages, req.tools
        )
    except chat.RenderError as exc:
        raise EngineError(400, str(exc), param="messages") from exc
    params = generation_params(
        state, req, len(prompt_ids), req.completion_limit(), req.top_logprobs or 0 if req.logprobs else 0
    )
    body = await job_body(
        state,
        prompt_ids,
        params,
        functools.partial(completion_ids, state.worker.tokenizer, req.messages, req.tools),
        req.skip_script,
    )

    name = responses.TokenNamer(
        state.worker.tokenizer,
        req.return_tokens_as_token_ids
        if req.return_tokens_as_token_ids is not None
        else state.config.return_tokens_as_token_ids,
    )
    request_id = responses.new_id("chatcmpl")
    if req.stream:
        return await stream_chat(
            request, req, model, request_id, prompt_ids, run_job(state, body), name, tools
        )
    events: list[TokenEvent] = []
    version = 0
    async for item in run_job(state, body):
        if isinstance(item, TokenEvent):
            events.append(item)
        else:
            version = item
    text = "".join(e.text for e in events)
    parsed = chat.parse_tool_calls(text) if tools else chat.ParsedReply(content=text, tool_calls=[])
    finish = events[-1].finish_reason or "length"
    if parsed.tool_calls and finish == "stop":
        finish = "tool_calls"
    return web.json_response(
        responses.chat_completion(
            request_id=request_id,
            model=model,
            prompt_ids=prompt_ids,
            events=events,
            message=responses.assistant_message(parsed.content, parsed.tool_calls),
            finish_reason=finish,
            logprobs=req.logprobs,
            return_token_ids=req.return_token_ids,
            name=name,
            weight_version=version,
        )
    )


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = CompletionRequest.model_validate(await read_json(request))
    model = check_model(state, req.model)
    if req.stream:
        raise EngineError(400, "streaming /v1/completions is not supported by the dev engine", param="stream")
    tokenizer = state.worker.tokenizer
    prompt_ids = req.prompt if isinstance(req.prompt, list) else tokenizer(req.prompt)["input_ids"]
    if max(prompt_ids) >= len(tokenizer):
        raise EngineError(400, f"token id {max(prompt_ids)} is out of vocabulary (size {len(tokenizer)})")
    params = generation_params(state, req, len(prompt_ids), req.max_tokens, req.logprobs or 0)
    body = await job_body(state, prompt_ids, params, functools.partial(reply_ids, tokenizer), req.skip_script)

    events, version = [], 0
    async for item in run_job(state, body):
        if isinstance(item, TokenEvent):
            events.append(item)
        else:
            version = item
    as_ids = (
        state.config.return_tokens_as_token_ids
        if req.return_tokens_as_token_ids is None
        else req.return_tokens_as_token_ids
    )
    return web.json_response(
        responses.text_completion(
            request_id=responses.new_id("cmpl"),
            model=model,
            prompt_ids=prompt_ids,
            events=events,
            logprobs=req.logprobs is not None,
            return_token_ids=req.return_token_ids,
            name=responses.TokenNamer(tokenizer, as_ids),
            weight_version=version,
        )
    )


async def models(request: web.Request) -> web.Response:
    config = request.app[STATE].config
    card = {
        "id": config.served_model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "vllm",
        "root": config.model_path,
        "parent": None,
        "max_model_len": config.max_model_len,
    }
    card["permission"] = [
        {  # OpenAI's legacy permission record, as vLLM still sends it
            "id": responses.new_id("modelperm"),
            "object": "model_permission",
            "created": card["created"],
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
    ]
    return web.json_response({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req = TokenizeRequest.model_validate(await read_json(request))
    check_model(state, req.model)
    tokenizer = state.worker.tokenizer
    if req.messages is not None:
        try:
            ids = chat.render_prompt_ids(tokenizer, req.messages, req.tools, req.add_generation_prompt)
        except chat.RenderError as exc:
            raise EngineError(400, str(exc), param="messages") from exc
    else:
        ids = tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]
    strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return web.json_response(
        {"count": len(ids), "max_model_len": state.config.max_model_len, "tokens": ids, "token_strs": strs}
    )


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req = DetokenizeRequest.model_validate(await read_json(request))
    check_model(state, req.model)
    if any(t < 0 or t >= len(state.worker.tokenizer) for t in req.tokens):
        raise EngineError(400, "token ids must be within the vocabulary", param="tokens")
    return web.json_response({"prompt": state.worker.tokenizer.decode(req.tokens)})


def build_app(state: EngineState) -> web.Application:
    """The aiohttp application serving ``state``; its worker is stopped on cleanup."""
    app = web.Application(middlewares=[errors_as_json], client_max_size=state.config.max_request_bytes)
    app[STATE] = state

    async def stop_worker(app: web.Application) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(app[STATE].worker.stop)

    app.cleanup_ctx.append(stop_worker)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/metrics", metrics)
    add_control_routes(app)
    return app
