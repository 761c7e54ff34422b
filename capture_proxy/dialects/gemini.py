"""Google's Gemini API (``POST /v1beta/models/{model}:generateContent`` and ``:streamGenerateContent``),
as gemini-cli and the ``google-genai`` SDKs speak it.

The route, not the body, names the model and says whether to stream: :func:`route_body` adds both to the
agent's body (as ``model`` and ``stream``) before :meth:`GeminiDialect.parse_request` reads it.

Contract (request → one upstream Chat Completions body):

- Every field is read under its lowerCamelCase name or its snake_case one: Google's API parses proto3
  JSON, which accepts both, and the Python SDK sends some nested objects in snake_case (a declaration's
  ``parameters_json_schema``, ``thinkingConfig.thinking_budget``, a schema's ``min_items``).
- ``systemInstruction`` (a content's text parts, or a string) becomes one leading system message;
  ``contents`` are ``user`` and ``model`` turns (``function``, an older SDK's role for results, and a
  missing role are user turns). Text parts of one turn are joined with :data:`TEXT_JOIN`.
- A model turn's ``thought`` text parts go upstream as the message's ``reasoning`` (as in the other
  dialects); ``functionCall`` parts become ``tool_calls`` with ``arguments = json.dumps(args)`` (the
  Anthropic dialect's spelling and its ``{"_raw": …}`` inverse). ``thoughtSignature`` is opaque to the
  engine and dropped.
- Tool-call ids: a call without an ``id`` gets :data:`CALL_ID` of its turn's index in ``contents`` and
  its index among the turn's calls: deterministic, and unchanged as the history grows, so the same
  history always gives the same upstream body. Replies carry the engine's own ids, which gemini-cli and
  the SDK send back. A ``functionResponse`` is matched to a call of the model turn before it by ``id``,
  else to the first unanswered call of its ``name`` (a client that invented its own id for a call
  without one, as gemini-cli does, is matched by name), and goes upstream as a ``role: "tool"`` message
  for that call's id, its ``response`` object as JSON text. Results come first in their turn, then the
  turn's text as one user message (Chat Completions wants tool results right after the call).
- ``tools[].functionDeclarations`` become function tools: ``parametersJsonSchema`` as it is, or
  ``parameters`` (Google's OpenAPI-style schema) as JSON Schema: types in lower case, ``nullable`` as a
  ``"null"`` type, keywords in camelCase, ``propertyOrdering`` (a Gemini-only hint) dropped.
- ``generationConfig.maxOutputTokens`` → ``max_tokens``, ``stopSequences`` → ``stop``; the whole
  ``generationConfig``, ``toolConfig``, ``safetySettings`` and ``serviceTier`` are copied to
  ``agent_params`` as sent (sampling is the session's).
- Refused with 400 before anything is forwarded: constrained decoding (``functionCallingConfig`` mode
  ``ANY``/``VALIDATED`` or ``allowedFunctionNames``; ``responseMimeType`` other than ``text/plain``,
  ``responseSchema``, ``responseJsonSchema``), ``candidateCount`` > 1, non-text output modalities,
  media and other non-text parts (``inlineData``, ``fileData``, code execution, …), server tools
  (``googleSearch``, ``codeExecution``, …), ``cachedContent`` (the proxy is stateless: send the full
  contents), a trailing model turn (prefill), a result that matches no call and has no id, malformed
  fields.

Replies render as a ``GenerateContentResponse`` (one candidate: thought part, text part, function call
parts; ``finishReason`` ``MAX_TOKENS`` when the output cap was hit, else ``STOP``, as Gemini reports a
turn that ends in function calls) or, streamed, as ``data: <GenerateContentResponse>`` frames: thought
and text in pieces, then the function calls in one chunk, the last chunk carrying ``finishReason`` and
the full ``usageMetadata``. Errors are Google's ``{"error": {"code", "message", "status"}}``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import orjson

from capture_proxy.dialects.anthropic import tool_arguments, tool_input
from capture_proxy.dialects.base import ChatCall, DialectError, Reply, optional_list, required_string
from capture_proxy.dialects.count_tokens import estimate_tokens
from capture_proxy.dialects.gemini_fields import camel, get_field, json_schema, snake

TEXT_JOIN = "\n\n"
DELTA_CHARS = 64  # characters per streamed piece; any split is valid, this keeps frames small and few
CALL_ID = "call_{turn}_{index}"
AGENT_PARAM_FIELDS = ("generationConfig", "toolConfig", "safetySettings", "serviceTier")
USER_ROLES = (None, "user", "function")
FORCED_MODES = ("ANY", "VALIDATED")
PLAIN_TEXT = (None, "text/plain")
STRUCTURED_OUTPUT = ("responseSchema", "responseJsonSchema")
STATUSES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ABORTED",
    413: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    500: "INTERNAL",
    501: "UNIMPLEMENTED",
    502: "UNAVAILABLE",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}
# U+2028/U+2029 are line terminators to JavaScript's regex ``.``, which the JS SDK's frame parser uses:
# left raw (orjson does) inside a frame, they would keep gemini-cli from ever matching it.
_JS_LINE_BREAKS = (("\u2028".encode(), b"\\u2028"), ("\u2029".encode(), b"\\u2029"))


def route_body(body: dict[str, Any], model: str, stream: bool) -> dict[str, Any]:
    """The agent's body with what its route says: the model from the path (``models/`` prefix off) and
    whether the method streams. Any ``model``/``stream`` in the body itself is overridden."""
    return {**body, "model": model.removeprefix("models/"), "stream": stream}


class GeminiDialect:
    """The Gemini API; see the module docstring for the translation contract."""

    name = "gemini"
    # Google's clients parse every line of an event stream as a data frame: an SSE comment breaks the
    # Python SDK's JSON parsing and stops the JS SDK's (gemini-cli's) frame reader for good.
    keepalive = None

    def parse_request(self, body: dict[str, Any]) -> ChatCall:
        """Translate a (routed) generateContent body; raise :class:`DialectError` (400) for what cannot
        be forwarded."""
        if not isinstance(body, dict):
            raise DialectError("request body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise DialectError("model: required in the path, a non-empty string", param="model")
        if get_field(body, "cachedContent") is not None:
            raise DialectError(
                "cachedContent: not supported; this proxy is stateless, send the full contents",
                param="cachedContent",
            )
        config = _object(get_field(body, "generationConfig"), "generationConfig")
        _refuse_constrained_config(config)
        upstream: dict[str, Any] = {
            "messages": _system(get_field(body, "systemInstruction")) + _contents(body)
        }
        tools = _tools(get_field(body, "tools"))
        choice = _tool_choice(_object(get_field(body, "toolConfig"), "toolConfig"))
        if tools:
            upstream["tools"] = tools
            if choice is not None:
                upstream["tool_choice"] = choice
        cap = get_field(config, "maxOutputTokens")
        if cap is not None:
            if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
                at = "generationConfig.maxOutputTokens"
                raise DialectError(f"{at}: must be a positive integer", param=at)
            upstream["max_tokens"] = cap
        stop = get_field(config, "stopSequences")
        if stop is not None:
            if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
                at = "generationConfig.stopSequences"
                raise DialectError(f"{at}: must be a list of strings", param=at)
            if stop:
                upstream["stop"] = stop
        agent_params = {}
        for name in AGENT_PARAM_FIELDS:
            for key in (name, snake(name)):
                if key in body:
                    agent_params[key] = body[key]
        return ChatCall(self.name, upstream, body.get("stream") is True, model, agent_params)

    def render_reply(self, reply: Reply, call: ChatCall) -> dict[str, Any]:
        """The ``GenerateContentResponse`` for a non-streaming response."""
        parts = _reply_parts(reply) or [{"text": ""}]
        return _response(reply, call, parts, final=True)

    def render_stream(self, reply: Reply, call: ChatCall) -> Iterator[bytes]:
        """``data: <GenerateContentResponse>`` frames replaying ``reply``: thought and text in pieces, the
        function calls in one chunk; the last chunk carries ``finishReason`` and ``usageMetadata``."""
        chunks: list[list[dict[str, Any]]] = []
        for piece in _chunks(reply.reasoning or ""):
            chunks.append([{"text": piece, "thought": True}])
        for piece in _chunks(reply.content or ""):
            chunks.append([{"text": piece}])
        calls = [_call_part(c.id, c.name, c.arguments) for c in reply.tool_calls]
        if calls:
            chunks.append(calls)
        if not chunks:
            chunks.append([{"text": ""}])
        for i, parts in enumerate(chunks):
            yield _frame(_response(reply, call, parts, final=i == len(chunks) - 1))

    def render_error(self, status: int, message: str) -> dict[str, Any]:
        """``{"error": {"code", "message", "status"}}``, Google's shape, with the gRPC status name."""
        return {"error": {"code": status, "message": message, "status": _status(status)}}

    def render_stream_error(self, status: int, message: str) -> bytes:
        """One ``data:`` frame holding :meth:`render_error`'s body (the SDKs raise it as an API error)."""
        return _frame(self.render_error(status, message))


DIALECT = GeminiDialect()


def count_tokens(body: dict[str, Any]) -> dict[str, int]:
    """``{"totalTokens": n}`` for ``:countTokens``, answered locally: the estimate of
    :func:`~capture_proxy.dialects.count_tokens.estimate_tokens` over the body's ``systemInstruction``,
    ``contents`` and ``tools`` (or those of its ``generateContentRequest``, the API's other form).

    Raises:
        DialectError: (400) the body is not an object or holds no ``contents`` list.
    """
    if not isinstance(body, dict):
        raise DialectError("request body must be a JSON object")
    inner = get_field(body, "generateContentRequest")
    request = inner if isinstance(inner, dict) else body
    if not isinstance(get_field(request, "contents"), list):
        raise DialectError("contents: required, a list", param="contents")
    counted = [get_field(request, key) for key in ("systemInstruction", "contents", "tools")]
    return {"totalTokens": estimate_tokens([value for value in counted if value is not None])}


# ---------------------------------------------------------------------------------------------- requests


def _object(value: Any, path: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise DialectError(f"{path}: must be an object", param=path)
    return value


def _refuse_constrained_config(config: dict[str, Any]) -> None:
    count = get_field(config, "candidateCount")
    if count not in (None, 1):
        at = "generationConfig.candidateCount"
        raise DialectError(f"{at}={count!r} is not supported: the proxy captures exactly one", param=at)
    mime = get_field(config, "responseMimeType")
    if mime not in PLAIN_TEXT:
        at = "generationConfig.responseMimeType"
        raise DialectError(
            f"{at}: {mime!r} asks for structured output (constrained decoding), which this proxy refuses; "
            "use 'text/plain'",
            param=at,
        )
    for name in STRUCTURED_OUTPUT:
        if get_field(config, name) is not None:
            at = f"generationConfig.{name}"
            raise DialectError(
                f"{at}: structured output is constrained decoding, which this proxy refuses", param=at
            )
    modalities = get_field(config, "responseModalities")
    if modalities is not None and (not isinstance(modalities, list) or set(modalities) - {"TEXT"}):
        at = "generationConfig.responseModalities"
        raise DialectError(f"{at}: only TEXT output is supported by this proxy", param=at)


def _system(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if isinstance(raw, str):
        text = raw
    else:
        content = _object(raw, "systemInstruction")
        texts = [_text_part(part, at) for part, at in _parts(content, "systemInstruction")]
        text = TEXT_JOIN.join(texts)
    return [{"role": "system", "content": text}] if text else []


def _contents(body: dict[str, Any]) -> list[dict[str, Any]]:
    raw = get_field(body, "contents")
    if not isinstance(raw, list) or not raw:
        raise DialectError("contents: required, a non-empty list", param="contents")
    messages: list[dict[str, Any]] = []
    pending: list[tuple[str, str]] = []  # (id, name) of the last model turn's calls not yet answered
    for i, content in enumerate(raw):
        where = f"contents[{i}]"
        content = _object(content, where)
        role = content.get("role")
        if role == "model":
            message = _model_turn(content, i, where)
            pending = [(c["id"], c["function"]["name"]) for c in message.get("tool_calls", [])]
            messages.append(message)
        elif role in USER_ROLES:
            messages.extend(_user_turn(content, pending, where))
        else:
            raise DialectError(f"{where}.role: must be 'user' or 'model', got {role!r}", param=where)
    if raw[-1].get("role") == "model":
        where = f"contents[{len(raw) - 1}]"
        raise DialectError(
            f"{where}: a trailing model turn (prefill) is not supported by this proxy", param=where
        )
    return messages


def _parts(content: dict[str, Any], where: str) -> Iterator[tuple[dict[str, Any], str]]:
    parts = content.get("parts", [])
    if not isinstance(parts, list):
        raise DialectError(f"{where}.parts: must be a list", param=f"{where}.parts")
    for j, part in enumerate(parts):
        at = f"{where}.parts[{j}]"
        yield _object(part, at), at


def _text_part(part: dict[str, Any], at: str) -> str:
    if "text" not in part:
        _refuse_part(part, at)
    return required_string(part, "text", at)


def _model_turn(content: dict[str, Any], turn: int, where: str) -> dict[str, Any]:
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for part, at in _parts(content, where):
        call = get_field(part, "functionCall")
        if call is not None:
            call = _object(call, f"{at}.functionCall")
            args = _object(call.get("args"), f"{at}.functionCall.args")
            given = call.get("id")
            if given is not None and not isinstance(given, str):
                raise DialectError(f"{at}.functionCall.id: must be a string", param=f"{at}.functionCall.id")
            call_id = given or CALL_ID.format(turn=turn, index=len(calls))
            name = required_string(call, "name", f"{at}.functionCall")
            function = {"name": name, "arguments": tool_arguments(args)}
            calls.append({"id": call_id, "type": "function", "function": function})
        elif "text" in part:
            (thoughts if part.get("thought") is True else texts).append(_text_part(part, at))
        elif set(part) - {"thoughtSignature", "thought_signature", "thought"}:
            _refuse_part(part, at)
        # else: a bare thought signature, opaque to the engine (see the module docstring)
    message: dict[str, Any] = {"role": "assistant", "content": TEXT_JOIN.join(texts) if texts else None}
    if thoughts:
        message["reasoning"] = TEXT_JOIN.join(thoughts)
    if calls:
        message["tool_calls"] = calls
    elif message["content"] is None:
        message["content"] = ""
    return message


def _user_turn(content: dict[str, Any], pending: list[tuple[str, str]], where: str) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    texts: list[str] = []
    for part, at in _parts(content, where):
        response = get_field(part, "functionResponse")
        if response is None:
            texts.append(_text_part(part, at))
            continue
        at = f"{at}.functionResponse"
        response = _object(response, at)
        if response.get("parts"):
            raise DialectError(f"{at}.parts: media in a function response is not supported", param=at)
        call_id = _match_call(response, pending, at)
        output = json.dumps(_object(response.get("response"), f"{at}.response"), ensure_ascii=False)
        results.append({"role": "tool", "tool_call_id": call_id, "content": output})
    if texts or not results:
        results.append({"role": "user", "content": TEXT_JOIN.join(texts)})
    return results


def _match_call(response: dict[str, Any], pending: list[tuple[str, str]], at: str) -> str:
    """The upstream id of the call ``response`` answers (taken off ``pending``); see the module docstring."""
    name = required_string(response, "name", at)
    given = response.get("id")
    match = next((c for c in pending if c[0] == given), None) if given else None
    match = match or next((c for c in pending if c[1] == name), None)
    if match is not None:
        pending.remove(match)
        return match[0]
    if isinstance(given, str) and given:
        return given  # answers no call the proxy saw; its own id is all there is
    raise DialectError(f"{at}: answers no functionCall of the model turn before it, and has no id", param=at)


def _refuse_part(part: dict[str, Any], at: str) -> None:
    kinds = sorted(set(part) - {"thought", "thoughtSignature", "thought_signature"}) or ["(empty)"]
    kind = camel(kinds[0])
    if kind in ("inlineData", "fileData"):
        raise DialectError(f"{at}: {kind} parts are not supported by this proxy (text only)", param=at)
    raise DialectError(f"{at}: part kind {kind!r} is not supported here", param=at)


def _tools(raw: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(optional_list(raw, "tools")):
        at = f"tools[{i}]"
        tool = _object(tool, at)
        for key in tool:
            if camel(key) != "functionDeclarations":
                raise DialectError(
                    f"{at}.{camel(key)}: server tools are not supported by this proxy "
                    "(functionDeclarations only)",
                    param=at,
                )
        declarations = get_field(tool, "functionDeclarations") or []
        if not isinstance(declarations, list):
            raise DialectError(f"{at}.functionDeclarations: must be a list", param=at)
        for j, declaration in enumerate(declarations):
            path = f"{at}.functionDeclarations[{j}]"
            out.append(_function(_object(declaration, path), path))
    return out


def _function(declaration: dict[str, Any], at: str) -> dict[str, Any]:
    function: dict[str, Any] = {"name": required_string(declaration, "name", at)}
    if isinstance(declaration.get("description"), str):
        function["description"] = declaration["description"]
    schema = get_field(declaration, "parametersJsonSchema")
    if schema is not None:
        function["parameters"] = schema
    elif declaration.get("parameters") is not None:
        function["parameters"] = json_schema(declaration["parameters"])
    return {"type": "function", "function": function}


def _tool_choice(tool_config: dict[str, Any]) -> str | None:
    config = _object(get_field(tool_config, "functionCallingConfig"), "toolConfig.functionCallingConfig")
    at = "toolConfig.functionCallingConfig"
    if get_field(config, "allowedFunctionNames"):
        raise DialectError(
            f"{at}.allowedFunctionNames: constrains which tool is called (constrained decoding), which this "
            "proxy refuses",
            param=at,
        )
    mode = config.get("mode")
    if mode in (None, "MODE_UNSPECIFIED", "AUTO"):
        return None if mode is None else "auto"
    if mode == "NONE":
        return "none"
    if mode in FORCED_MODES:
        raise DialectError(
            f"{at}.mode: {mode!r} forces a tool call (constrained decoding), which this proxy refuses; "
            "use 'AUTO'",
            param=at,
        )
    raise DialectError(f"{at}.mode: must be 'AUTO' or 'NONE', got {mode!r}", param=at)


# ----------------------------------------------------------------------------------------------- replies


def _call_part(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"functionCall": {"id": call_id, "name": name, "args": tool_input(arguments)}}


def _reply_parts(reply: Reply) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    if reply.reasoning:
        parts.append({"text": reply.reasoning, "thought": True})
    if reply.content:
        parts.append({"text": reply.content})
    parts.extend(_call_part(c.id, c.name, c.arguments) for c in reply.tool_calls)
    return parts


def _response(reply: Reply, call: ChatCall, parts: list[dict[str, Any]], final: bool) -> dict[str, Any]:
    candidate: dict[str, Any] = {"content": {"role": "model", "parts": parts}, "index": 0}
    response: dict[str, Any] = {"candidates": [candidate]}
    if final:
        candidate["finishReason"] = "MAX_TOKENS" if reply.finish_reason == "length" else "STOP"
        response["usageMetadata"] = {
            "promptTokenCount": reply.prompt_tokens,
            "candidatesTokenCount": reply.completion_tokens,
            "totalTokenCount": reply.prompt_tokens + reply.completion_tokens,
        }
    response["modelVersion"] = call.model or reply.model
    response["responseId"] = reply.id.removeprefix("chatcmpl-")
    return response


def _status(status: int) -> str:
    if status in STATUSES:
        return STATUSES[status]
    return "INTERNAL" if status >= 500 else "INVALID_ARGUMENT"


def _chunks(text: str) -> list[str]:
    return [text[i : i + DELTA_CHARS] for i in range(0, len(text), DELTA_CHARS)]


def _frame(data: dict[str, Any]) -> bytes:
    payload = orjson.dumps(data)
    for raw, escaped in _JS_LINE_BREAKS:
        payload = payload.replace(raw, escaped)
    return b"data: " + payload + b"\n\n"
