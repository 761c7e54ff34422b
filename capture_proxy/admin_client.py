"""The rollout side's client of the capture proxy's admin API (mint, read, export, delete sessions)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx


class CaptureError(Exception):
    """The capture proxy could not be reached (``status`` None) or refused an admin call (its status)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class NothingTrainable(CaptureError):
    """The session has no trainable capture (the proxy's 409); ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason, status=409)
        self.reason = reason


@dataclass
class CaptureSession:
    session_id: str
    root_url: str  # the proxy as agents reach it (no /v1)


class CaptureClient:
    """Admin calls to one capture proxy. ``public_url`` is what agents are told (may differ from ``url``).

    A proxy that is restarting refuses connections for a while; calls wait for it. ``reconnect_s`` bounds
    the wait of calls that start work (mint, policy, listings): failing them early loses nothing.
    ``finish_reconnect_s`` bounds the wait of the calls that finish a rollout (its summary, trace and
    delete): they carry a whole agent run, so they wait longer, long enough for a supervisor or a
    redeploy to bring the proxy back."""

    def __init__(
        self,
        url: str,
        admin_key: str | None,
        public_url: str | None = None,
        timeout_s: float = 60.0,
        reconnect_s: float = 20.0,
        finish_reconnect_s: float = 120.0,
    ):
        self.url = url.rstrip("/")
        self.reconnect_s, self.finish_reconnect_s = reconnect_s, finish_reconnect_s
        self.public_url = (public_url or url).rstrip("/")
        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        # No connection cap: hundreds of rollouts finish together, and httpcore's wait queue for a free
        # connection degrades badly when long (encode/httpcore#1035).
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self._client = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout_s, limits=limits)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _call(self, method: str, path: str, finishing: bool = False, **kwargs: Any) -> httpx.Response:
        # A proxy that is restarting (crashed, redeployed) reloads its sessions from disk once it is up:
        # keep trying rather than fail the rollout's export or leak its session on a failed delete. Only
        # failures where the proxy cannot have acted twice are retried: the connection was refused, or the
        # call reads or deletes.
        deadline = time.monotonic() + (self.finish_reconnect_s if finishing else self.reconnect_s)
        delay = 0.25
        while True:
            try:
                response = await self._client.request(method, path, **kwargs)
                break
            except httpx.HTTPError as exc:
                safe = isinstance(exc, httpx.ConnectError) or (
                    method in ("GET", "DELETE") and isinstance(exc, httpx.TransportError)
                )
                if not safe or time.monotonic() + delay > deadline:
                    raise CaptureError(f"capture proxy at {self.url} unreachable: {exc!r}") from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        if response.status_code == 409:
            raise NothingTrainable(_message(response))
        if response.status_code >= 400:
            message = f"capture proxy {method} {path}: {response.status_code} {_message(response)}"
            raise CaptureError(message, status=response.status_code)
        return response

    async def mint(
        self,
        sampling: dict[str, Any] | None,
        max_model_calls: int | None,
        metadata: dict[str, Any],
        engine: dict[str, Any] | None = None,
    ) -> CaptureSession:
        """A new session. ``engine``: its own engine fields of the proxy's session spec (``upstream``,
        ``model``, ``engine_headers``), where it does not use the proxy's default engine."""
        body: dict[str, Any] = {"metadata": metadata, **(engine or {})}
        if sampling:
            body["sampling"] = sampling
        if max_model_calls:
            body["max_model_calls"] = max_model_calls
        response = await self._call("POST", "/sessions", json=body)
        return CaptureSession(response.json()["session_id"], self.public_url)

    async def sessions(self) -> list[dict[str, Any]]:
        """Every open session's summary."""
        return (await self._call("GET", "/sessions")).json()["sessions"]

    async def replicas(self) -> list[dict[str, Any]]:
        """The proxy's engine replicas (``GET /replicas``; a :class:`CaptureError` with status 404 when it
        was started without ``--replicas``)."""
        return (await self._call("GET", "/replicas")).json()["replicas"]

    async def replica_action(self, index: int, action: str) -> None:
        """``POST /replicas/{index}/{action}``: ``drain`` takes replica ``index`` out of rotation, ``enable``
        puts it back (in rotation again once healthy)."""
        if action not in ("drain", "enable"):
            raise ValueError(f"replica action {action!r}: drain or enable")
        await self._call("POST", f"/replicas/{index}/{action}")

    async def summary(self, session_id: str) -> dict[str, Any]:
        return (await self._call("GET", f"/sessions/{session_id}", finishing=True)).json()

    async def trace(self, session_id: str) -> dict[str, Any]:
        """The session's TrainingTrace JSON; :class:`NothingTrainable` when there is none."""
        return (await self._call("GET", f"/sessions/{session_id}/trace", finishing=True)).json()

    async def set_policy(self, model: str | None, version: int) -> None:
        """Send every model call from now on to served model ``model`` (None: the model it names), recording
        ``version`` on its turn (``PUT /policy``)."""
        await self._call("PUT", "/policy", json={"model": model, "version": version})

    async def delete(self, session_id: str) -> None:
        try:
            await self._call("DELETE", f"/sessions/{session_id}", finishing=True)
        except CaptureError as exc:
            if exc.status != 404:  # already gone is what we wanted
                raise


def _message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:300]
    error = body.get("error") if isinstance(body, dict) else None
    return str(error.get("message") if isinstance(error, dict) else body)[:500]
