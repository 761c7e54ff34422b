"""vLLM's control routes as :class:`~harness_trainer.engines.vllm.VLLMEngine` calls them: one HTTP call
each, retried while the server cannot be reached, any other failure an ``EngineUnavailable`` naming the
route and vLLM's own reason.

The routes exist only with ``VLLM_SERVER_DEV_MODE=1`` (the LoRA ones only with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``); a missing route answers 404 without vLLM's error object, so a 404's
error names the flag to start vLLM with (:data:`DEV_MODE_HINT`, :data:`LORA_HINT`).
"""

from __future__ import annotations

from typing import Any

import httpx

from harness_trainer.engines.base import EngineUnavailable, RetryPolicy, retry_unreachable

DEV_MODE_HINT = "start vLLM with VLLM_SERVER_DEV_MODE=1 (and --weight-transfer-config for weight pushes)"
LORA_HINT = "start vLLM with --enable-lora, --max-lora-rank R and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"


class ControlRoutes:
    """The control routes of the vLLM at ``base_url`` (its root, without ``/v1``).

    Args:
        base_url: the server's root URL.
        timeout: seconds for a call that names no timeout of its own.
        retry: how calls that cannot connect are retried.
    """

    def __init__(self, base_url: str, *, timeout: float, retry: RetryPolicy) -> None:
        self.base_url = base_url
        self._timeout = timeout
        self._retry = retry

    async def call(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, str] | None = None,
        timeout: float | None = None,
        retry: bool = True,
    ) -> httpx.Response:
        """One control call; non-200 and transport failures become ``EngineUnavailable`` naming the route.
        ``retry=False``: one attempt, even when the server cannot be reached."""
        route = f"{method} {path}"

        async def send() -> httpx.Response:
            async with httpx.AsyncClient(base_url=self.base_url, timeout=timeout or self._timeout) as client:
                return await client.request(method, path, json=json, params=params)

        policy = self._retry if retry else RetryPolicy(attempts=1)
        try:
            reply = await retry_unreachable(send, policy, f"vLLM {self.base_url} {route}")
        except httpx.TransportError as exc:
            raise EngineUnavailable(f"vLLM {self.base_url} {route} failed: {exc!r}") from exc
        if reply.status_code != 200:
            raise EngineUnavailable(
                f"vLLM {self.base_url} refused {route} ({reply.status_code}): {_reason(reply, path)}"
            )
        return reply


def _reason(reply: httpx.Response, path: str) -> str:
    """vLLM's error message, from whichever of its error shapes the route used, plus a setup hint on 404."""
    try:
        body = reply.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(error := body.get("error"), dict):
        return str(error.get("message", error))
    reason = str(body.get("error", body.get("detail"))) if isinstance(body, dict) else reply.text[:500]
    if reply.status_code == 404:
        # Not vLLM's error object: the route itself is missing, which is how a flag left off shows.
        reason += f"; {LORA_HINT if 'lora_adapter' in path else DEV_MODE_HINT}"
    return reason
