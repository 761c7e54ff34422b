"""The engine, as the proxy calls it: one pooled non-streaming Chat Completions POST, with bounded retries.

Retried: connection errors, timeouts, a body cut off mid-way, and statuses 408, 429 and 5xx; at most
``attempts`` tries with exponential backoff, honouring ``Retry-After`` (capped). Anything else is final.
A context-length refusal (a 400 whose message says the prompt exceeds the model's context) is told apart
so the proxy can end the agent's episode instead of failing it.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from capture_proxy.config import engine_root
from capture_proxy.reply import LogprobEntry, loads, read_reply

RETRY_STATUSES = frozenset({408, 429}) | frozenset(range(500, 600))
_CONTEXT = re.compile(
    r"maximum context length|max_model_len|longer than the maximum model length|context length|"
    r"too many tokens|prompt is too long",
    re.IGNORECASE,
)


@dataclass
class UpstreamResult:
    """What came back: a parsed reply, or a failure with the status and reason to surface."""

    reply: dict[str, Any] | None
    status: int
    error: str | None = None
    prompt_text: bytes | None = None  # ``prompt_token_ids`` as raw JSON text, cut out of the reply
    logprobs: list[LogprobEntry] | None = None  # ``choices[0].logprobs.content``, cut out of the reply
    context_exhausted: bool = False
    unreachable: bool = False
    """The last attempt got no answer from the engine (refused, reset, timed out, dropped mid-reply)."""
    attempts: int = 1
    upstream_ms: float = 0.0
    attempt_errors: list[str] = field(default_factory=list)


class Upstream:
    """A pooled client for one engine base URL (``http://host:port``, with or without ``/v1``)."""

    def __init__(
        self,
        base_url: str,
        timeout_s: float = 600.0,
        attempts: int = 3,
        backoff_s: float = 0.5,
        max_retry_after_s: float = 10.0,
        pool_size: int = 256,
        api_key: str | None = None,
    ) -> None:
        self.root = engine_root(base_url)
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.max_retry_after_s = max_retry_after_s
        self.pool_size = pool_size
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=self.pool_size, keepalive_timeout=30.0)
        # No cookie jar: one pool serves every session, and nothing of one call may ride on another's.
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=self.timeout, cookie_jar=aiohttp.DummyCookieJar()
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("Upstream.start() was not called")
        return self._session

    async def models(self, timeout_s: float | None = None) -> list[str]:
        """The served model names (``GET /v1/models``), within ``timeout_s`` if given."""
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s is not None else None
        url = self.root + "/v1/models"
        async with self.session.get(url, headers=self.headers, timeout=timeout) as response:
            response.raise_for_status()
            data = loads(await response.read())
        return [str(entry["id"]) for entry in data.get("data", [])]

    async def start_time(self, timeout_s: float | None = None) -> float | None:
        """The engine process's start (``process_start_time_seconds`` on its Prometheus ``/metrics``, unix
        seconds), or None when its page has no such line. Raises, as :meth:`models` does, when it does not
        answer."""
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s is not None else None
        url = self.root + "/metrics"
        async with self.session.get(url, headers=self.headers, timeout=timeout) as response:
            response.raise_for_status()
            return process_start_time(await response.text())

    async def chat(self, body: dict[str, Any], headers: dict[str, str] | None = None) -> UpstreamResult:
        """POST ``body`` to ``/v1/chat/completions`` with retries; never raises for engine failures.

        ``headers`` (a session's own engine credential) are sent on top of the pool's."""
        payload = orjson.dumps(body)
        sent = {**self.headers, **headers} if headers else self.headers
        started = time.perf_counter()
        errors: list[str] = []
        result = UpstreamResult(None, 502)
        for attempt in range(1, self.attempts + 1):
            result, retry_after = await self._attempt(payload, sent)
            result.attempts = attempt
            if result.reply is not None or result.status not in RETRY_STATUSES:
                break
            errors.append(f"attempt {attempt}: {result.error}")
            if attempt < self.attempts:
                delay = self.backoff_s * 2 ** (attempt - 1)
                if retry_after is not None:
                    delay = min(max(retry_after, 0.0), self.max_retry_after_s)
                await asyncio.sleep(delay)
        result.attempt_errors = errors
        result.upstream_ms = (time.perf_counter() - started) * 1000
        if result.reply is None and result.status in RETRY_STATUSES:
            result.error = f"the engine failed after {result.attempts} attempts: {result.error}"
        return result

    async def _attempt(self, payload: bytes, headers: dict[str, str]) -> tuple[UpstreamResult, float | None]:
        url = self.root + "/v1/chat/completions"
        try:
            async with self.session.post(url, data=payload, headers=headers) as response:
                raw = await response.read()
                status = response.status
                retry_after = _retry_after(response.headers.get("Retry-After"))
        except TimeoutError:
            return UpstreamResult(None, 504, "timed out waiting for the engine", unreachable=True), None
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
            error = f"the engine dropped the connection mid-reply ({exc})"
            return UpstreamResult(None, 502, error, unreachable=True), None
        except aiohttp.ClientError as exc:
            return UpstreamResult(None, 502, f"cannot reach the engine: {exc}", unreachable=True), None
        if status != 200:
            message = _error_message(raw)
            exhausted = status == 400 and bool(_CONTEXT.search(message))
            error = f"engine answered {status}: {message}"
            return UpstreamResult(None, status, error, context_exhausted=exhausted), retry_after
        try:
            reply = read_reply(raw)
        except ValueError as exc:
            return UpstreamResult(None, 502, str(exc)), None
        return UpstreamResult(reply.body, 200, prompt_text=reply.prompt_text, logprobs=reply.logprobs), None


START_TIME = "process_start_time_seconds"


def process_start_time(page: str) -> float | None:
    """``process_start_time_seconds`` from a Prometheus text page (labelled or not), or None."""
    for line in page.splitlines():
        if not line.startswith(START_TIME):
            continue
        name, _, rest = line.partition(" ")
        if name.split("{", 1)[0] != START_TIME:
            continue
        if "}" in line:  # labels may hold spaces: the value follows the closing brace
            rest = line.rsplit("}", 1)[1]
        try:
            return float(rest.split()[0])
        except (IndexError, ValueError):
            return None
    return None


def _retry_after(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return None


def _error_message(raw: bytes) -> str:
    try:
        body = loads(raw)
    except ValueError:
        return raw[:500].decode("utf-8", "replace")
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(body.get("message"), str):
            return body["message"]
    return raw[:500].decode("utf-8", "replace")
