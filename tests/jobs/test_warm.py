"""The warm-up sandbox, against the fake E2B SDK and the fake Hugging Face Hub (its sandbox jobs' commands
really run, on this machine's network)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
from e2b import AuthenticationException
from huggingface_hub import constants

from harness_trainer.jobs.warm import DEFAULT_IMAGE, WarmupError, main, warm_sandbox
from harness_trainer.net import free_port
from tests.jobs.fake_process import Health
from tests.sandboxes.fake_e2b import FakeE2BCloud
from tests.sandboxes.fake_hf import FakeHub

pytestmark = pytest.mark.docker  # the fake E2B cloud runs images exported from the Docker daemon


@pytest.fixture
def fake_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """The fake Hub that ``huggingface_hub`` talks to; no token stored by a login on this machine."""
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-login" / "token"))
    with FakeHub(tmp_path / "hf") as hub, hub.use(monkeypatch):
        yield hub
    assert not hub.unknown, f"the library called routes the fake lacks: {hub.unknown}"


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


async def test_with_hf_the_warm_up_checks_the_token_and_reaches_the_proxy_from_a_dedicated_sandbox(
    fake_hub: FakeHub, proxy_url: str
) -> None:
    answer = await warm_sandbox(proxy_url, sandbox="hf")
    assert answer == '{"status": "ok"}'
    assert fake_hub.requests.index(("GET", "/api/whoami-v2")) < fake_hub.requests.index(
        ("POST", "/api/jobs/fake-user")
    ), "the token is checked before a sandbox is asked for"
    (job,) = fake_hub.jobs.values()
    assert job.spec["dockerImage"] == DEFAULT_IMAGE and job.spec["flavor"] == "cpu-basic"
    assert fake_hub.running() == [], "the warm-up sandbox's job is gone again"


async def test_with_hf_a_token_without_jobs_rights_is_one_line_and_starts_nothing(
    fake_hub: FakeHub, proxy_url: str
) -> None:
    fake_hub.forbidden = True
    with pytest.raises(
        WarmupError, match=r"^no hf sandbox: the hf backend: HF_TOKEN may not run Hugging Face Jobs"
    ) as raised:
        await warm_sandbox(proxy_url, sandbox="hf")
    assert "\n" not in str(raised.value) and fake_hub.jobs == {}


def test_with_hf_and_no_token_at_all_the_warm_up_exits_1_naming_what_is_missing(
    fake_hub: FakeHub, proxy_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    assert main(["--public-url", proxy_url, "--sandbox", "hf"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "error: no hf sandbox: the hf backend needs HF_TOKEN (a Hugging Face token that may run Jobs) in the "
        "environment, or a token stored by `hf auth login`"
    ]
    assert fake_hub.requests == [] and fake_hub.jobs == {}
