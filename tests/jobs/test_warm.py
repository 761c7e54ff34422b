"""The warm-up sandbox, against the fake E2B SDK (commands really run, on this machine's network)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
from e2b import AuthenticationException

from harness_trainer.jobs.warm import WarmupError, warm_sandbox
from harness_trainer.net import free_port
from tests.jobs.fake_process import Health
from tests.sandboxes.fake_e2b import FakeE2BCloud

pytestmark = pytest.mark.docker  # the fake E2B cloud runs images exported from the Docker daemon


@pytest.fixture
def proxy_url() -> Iterator[str]:
    """A stand-in for the capture proxy's public URL: ``/health`` answers 200."""
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


async def test_the_warm_up_starts_a_sandbox_reaches_the_proxy_from_inside_and_closes_it(
    tmp_path: Path, proxy_url: str
) -> None:
    cloud = FakeE2BCloud(tmp_path / "e2b")
    answer = await warm_sandbox(proxy_url + "/", template="base", sandbox_class=cloud)
    assert answer == '{"status": "ok"}'
    (created,) = cloud.create_calls
    assert created["template"] == "base" and created["envs"] == {}
    assert all(sandbox.killed for sandbox in cloud.sandboxes)


async def test_an_unreachable_proxy_is_an_error_naming_its_url(tmp_path: Path) -> None:
    cloud = FakeE2BCloud(tmp_path / "e2b")
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(WarmupError, match=f"the e2b sandbox cannot reach the capture proxy at {url}/health"):
        await warm_sandbox(url, sandbox_class=cloud)
    assert all(sandbox.killed for sandbox in cloud.sandboxes)


async def test_a_refused_e2b_key_is_an_error_saying_no_sandbox(tmp_path: Path, proxy_url: str) -> None:
    cloud = FakeE2BCloud(tmp_path / "e2b", fail_creates=1, failure=AuthenticationException("bad key"))
    with pytest.raises(WarmupError, match="no e2b sandbox: E2B refused to create a sandbox"):
        await warm_sandbox(proxy_url, sandbox_class=cloud)
