"""The rollout server's capture client across a proxy restart: calls that start work give up after
``reconnect_s``; the calls that finish a rollout (its summary, trace and delete) wait up to
``finish_reconnect_s`` for the proxy to come back, and then find the session it reloaded from disk."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from capture_proxy.admin_client import CaptureClient, CaptureError, NothingTrainable
from harness_trainer.net import free_port
from tests.hardening.faults import ProxyProcess

ADMIN_KEY = "capture-client-test-key"


@pytest.mark.slow
def test_finishing_calls_wait_longer_for_a_restarting_proxy_than_calls_that_start_work(tmp_path) -> None:
    # No engine: nothing here makes a model call, and the proxy does not need one to manage sessions.
    proxy = ProxyProcess("http://127.0.0.1:9", tmp_path / "capture", free_port(), ADMIN_KEY, tmp_path / "log")
    proxy.start()
    restarter: threading.Thread | None = None
    try:

        async def scenario() -> tuple[float, str, str]:
            client = CaptureClient(proxy.url, ADMIN_KEY, reconnect_s=1.0, finish_reconnect_s=60.0)
            try:
                session = await client.mint(None, None, {"task": "t"})
                proxy.kill()
                started = time.monotonic()
                with pytest.raises(CaptureError, match="unreachable") as refused:
                    await client.mint(None, None, {"task": "u"})
                assert refused.value.status is None
                gave_up_after = time.monotonic() - started

                nonlocal restarter  # back in 3 s: well past reconnect_s, well within finish_reconnect_s
                restarter = threading.Thread(target=lambda: (time.sleep(3.0), proxy.start()))
                restarter.start()
                summary = await client.summary(session.session_id)
                with pytest.raises(NothingTrainable) as nothing:  # reached: the session has no calls
                    await client.trace(session.session_id)
                await client.delete(session.session_id)
                return gave_up_after, summary["session_id"], nothing.value.reason
            finally:
                await client.aclose()

        gave_up_after, summary_id, reason = asyncio.run(scenario())
        assert gave_up_after < 3.0
        assert summary_id.startswith("cs") and reason
        assert proxy.starts == 2 and proxy.open_sessions() == []
    finally:
        if restarter is not None:
            restarter.join(60)
        proxy.stop()
