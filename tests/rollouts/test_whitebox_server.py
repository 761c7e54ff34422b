"""White-box sessions on the rollout server (issue 23): a real ``harness-trainer serve`` process on loopback
with real local sandboxes; the test is the trainer, calling the session's tools over HTTP through
:class:`WhiteBoxSession`. No engine is contacted (``--served-model`` names one that is never called)."""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from aiohttp.test_utils import TestClient, TestServer

pytest.importorskip("openenv.core.harness")  # white-box sessions speak OpenEnv's types: the `openenv` extra

from openenv.core.harness import HarnessRunLimits, MCPHarnessAdapter, ModelStepResult, ResourceSession
from openenv.core.llm_client import LLMResponse, ToolCall

from harness_trainer.net import free_port, wait_until_healthy
from harness_trainer.rollouts.client.factory import RolloutServerError
from harness_trainer.rollouts.client.whitebox_session import WhiteBoxSession, WhiteBoxSessionFactory
from harness_trainer.rollouts.errors import RolloutConfigError, RolloutUnscorable
from harness_trainer.rollouts.server.routes import RolloutServer
from harness_trainer.rollouts.server.runtime import RolloutRuntime, RuntimeConfig
from harness_trainer.sandboxes.base import SandboxStartError
from harness_trainer.sandboxes.tools import ToolLimits
from harness_trainer.tasks.sources import LocalTaskSource
from tests.rollouts.conftest import EXAMPLES
from tests.rollouts.test_server import Server as ServeProcess

HELLO = "hello-file"


class Server(ServeProcess):
    """``harness-trainer serve`` whose local sandboxes live under ``tmp`` (its ``TMPDIR``), with an
    engine it never calls; stopped as :class:`tests.rollouts.test_server.Server` is."""

    def __init__(self, root: Path, limit: int = 4) -> None:
        self.port, self.tmp = free_port(), root / "tmp"
        self.tmp.mkdir(parents=True)
        command = [sys.executable, "-m", "harness_trainer.cli", "serve", "--dataset", str(EXAMPLES)]
        command += ["--upstream", f"http://127.0.0.1:{free_port()}", "--served-model", "never-called"]
        command += ["--port", str(self.port), "--capture-port", str(free_port())]
        command += ["--data-dir", str(root / "capture"), "--max-concurrent-envs", str(limit)]
        environ = {k: v for k, v in os.environ.items() if k != "E2B_API_KEY"}
        self.process = subprocess.Popen(command, env={**environ, "TMPDIR": str(self.tmp)})
        self.url = f"http://127.0.0.1:{self.port}"
        try:
            wait_until_healthy(self.url, self.process)
        except BaseException:
            self.stop()
            raise

    def sandbox_roots(self) -> list[str]:
        """Local sandbox roots still on disk (each open sandbox has one)."""
        return sorted(p.name for p in self.tmp.glob("ht-*"))

    def open_sessions(self) -> int:
        return httpx.get(self.url + "/health").json()["sessions"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = Server(tmp_path_factory.mktemp("whitebox"))
    yield running
    running.stop()


@pytest.fixture
def factory(server: Server) -> Iterator[WhiteBoxSessionFactory]:
    yield WhiteBoxSessionFactory(server.url, split="train", sandbox="local")
    assert server.open_sessions() == 0, "a session was left open"
    assert server.sandbox_roots() == [], "a sandbox was left open"


def hello_row(factory: WhiteBoxSessionFactory) -> dict:
    return next(row for row in factory.prompt_rows() if row["task_name"] == HELLO)


def sleeping(marker: str) -> bool:
    """Whether a ``sleep MARKER`` runs on this machine (started in a sandbox, in the background)."""
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes() == f"sleep\0{marker}\0".encode():
                return True
        except OSError:
            continue
    return False


def wait_for(condition, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


@pytest.mark.slow
def test_a_solution_written_through_the_tools_is_verified_with_reward_1(
    factory: WhiteBoxSessionFactory, server: Server
) -> None:
    row = hello_row(factory)
    with factory.create(row) as session:
        assert isinstance(session, ResourceSession)
        assert session.initial_messages() == row["prompt"]
        assert session.task["name"] == HELLO
        names = [tool.name for tool in session.list_tools()]
        assert names == ["bash", "read_file", "write_file", "list_dir", "submit"]
        assert session.list_tools()[0].input_schema["required"] == ["command"]
        assert len(server.sandbox_roots()) == 1
        written = session.call_tool("write_file", {"path": "hello.txt", "content": "Hello, Harbor!\n"})
        assert written.error is None and "/app/hello.txt" in written.data
        assert session.call_tool("read_file", {"path": "/app/hello.txt"}).data == "Hello, Harbor!\n"
        submitted = session.call_tool("submit", {"summary": "wrote it"})
        assert submitted.done and submitted.error is None
        verdict = session.verify([])
        assert verdict.env_reward == 1.0 and verdict.done
        assert verdict.metrics["tool_calls_by_name"] == {"write_file": 1, "read_file": 1, "submit": 1}
        assert verdict.metrics["tool_failure_count"] == 0 and verdict.metrics["submitted"]
        assert verdict.artifacts["summary"] == "wrote it"
        assert set(verdict.metrics["phase_seconds"]) == {"sandbox_start", "tools", "upload", "verifier"}
        assert verdict.metrics["phase_seconds"]["tools"] > 0  # the three calls, summed
        assert server.sandbox_roots() == [], "verify ends the episode: its sandbox is closed"
        assert session.verify([]).env_reward == 1.0  # again: the same verdict
        with pytest.raises(RolloutServerError, match=r"409.*verified"):
            session.call_tool("bash", {"command": "true"})


@pytest.mark.slow
def test_an_untouched_sandbox_is_verified_with_reward_0(factory: WhiteBoxSessionFactory) -> None:
    session = factory.create(HELLO_INSTRUCTION)
    try:
        verdict = session.verify([])
        assert verdict.env_reward == 0.0 and verdict.metrics["tool_calls_by_name"] == {}
    finally:
        session.close()
    session.close()  # idempotent


HELLO_INSTRUCTION = (EXAMPLES / "train" / HELLO / "instruction.md").read_text().strip()


def test_the_models_mistakes_come_back_as_error_results_and_are_counted(
    factory: WhiteBoxSessionFactory,
) -> None:
    with factory.create(hello_row(factory)) as session:
        unknown = session.call_tool("nope", {})
        assert unknown.error is not None and "unknown tool 'nope'" in unknown.error
        bad = session.call_tool("write_file", {"path": "x"})
        assert bad.error is not None and "content" in bad.error and bad.data.endswith(bad.error)
        missing = session.call_tool("read_file", {"path": "/app/missing.txt"})
        assert missing.error == "no such file: /app/missing.txt"
        not_an_object = session.call_tool("bash", ["ls"])  # type: ignore[arg-type]
        assert not_an_object.error is not None
        failing = session.call_tool("bash", {"command": "echo out; exit 3"})
        assert failing.error is None and failing.metadata["exit_code"] == 3  # a command's own failure
        metrics = session.verify([]).metrics
        assert metrics["tool_calls_by_name"] == {"nope": 1, "write_file": 1, "read_file": 1, "bash": 2}
        assert metrics["tool_failure_count"] == 4
        assert metrics["tool_failures_by_name"] == {"nope": 1, "write_file": 1, "read_file": 1, "bash": 1}


def test_tool_limits_reach_the_sandbox_tools(factory: WhiteBoxSessionFactory, server: Server) -> None:
    limits = ToolLimits(default_timeout_s=1.0, max_timeout_s=2.0, max_output_chars=100)
    session = WhiteBoxSession.start(
        server.url, index=hello_row(factory)["task_index"], sandbox="local", tool_limits=limits
    )
    with session:
        assert session.list_tools()[0].input_schema["properties"]["timeout"]["maximum"] == 2.0
        slow = session.call_tool("bash", {"command": "sleep 5"})
        assert slow.error is not None and "timeout" in slow.error and slow.metadata["timed_out"]
        long = session.call_tool("bash", {"command": "seq 1 1000"})
        assert long.metadata["cut_chars"] > 0


def test_bad_requests_get_clear_http_errors(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    # Refusals come at once, but on two busy cores a reply can take longer than httpx's 5 s default.
    for verb in ("get", "post", "delete", "request"):
        monkeypatch.setattr(httpx, verb, functools.partial(getattr(httpx, verb), timeout=60))
    url = server.url
    assert httpx.get(f"{url}/sessions/nope/tools").status_code == 404
    assert httpx.post(f"{url}/sessions/nope/tools/call", json={"name": "bash"}).status_code == 404
    assert httpx.post(f"{url}/sessions/nope/verify").status_code == 404
    session_id = httpx.post(f"{url}/sessions").json()["session_id"]
    try:
        for method, path in [("GET", "tools"), ("POST", "tools/call"), ("POST", "verify")]:
            reply = httpx.request(method, f"{url}/sessions/{session_id}/{path}", json={"name": "bash"})
            assert reply.status_code == 409 and "no environment" in reply.json()["error"]["message"]
        start = f"{url}/sessions/{session_id}/environment"
        for body, status, says in [
            ({"split": "train", "index": 99}, 404, "no such task"),
            ({"split": "train", "instruction": "no task says this"}, 404, "no such task"),
            ({"split": "train"}, 400, "say which task"),
            ({"split": "train", "index": 0, "harness": "toy"}, 400, "harness"),
            ({"split": "train", "index": 0, "sandbox": "nope"}, 400, "known: docker, e2b, hf, local"),
            ({"split": "train", "index": 0, "sandbox": "e2b"}, 400, "needs E2B_API_KEY"),
            ({"split": "train", "index": 0, "tool_limits": {"max_output_chars": 0}}, 400, "max_output_chars"),
            ({"split": "train", "index": 0, "tool_limits": {"bogus": 1}}, 400, "bogus"),
        ]:
            reply = httpx.post(start, json=body)
            message = reply.json()["error"]["message"]
            assert reply.status_code == status and says in message, (body, reply.text)
        assert server.sandbox_roots() == []
        assert httpx.post(start, json={"split": "train", "index": 0}).status_code == 201
        again = httpx.post(start, json={"split": "train", "index": 0})
        assert again.status_code == 409 and "already started" in again.json()["error"]["message"]
        rollout = httpx.post(f"{url}/sessions/{session_id}/rollout", json={"split": "train", "index": 0})
        assert rollout.status_code == 409
        call = f"{url}/sessions/{session_id}/tools/call"
        for body in [{"arguments": {}}, {"name": 3}, {"name": "bash", "arguments": {}, "extra": 1}]:
            assert httpx.post(call, json=body).status_code == 400, body
        assert httpx.post(call, content=b"not json").status_code == 400
        assert httpx.get(f"{url}/sessions/{session_id}/trace").status_code == 409
        status = httpx.get(f"{url}/sessions/{session_id}").json()
        assert status["status"] == "ready" and status["environment"]["error"] is None
    finally:
        assert httpx.delete(f"{url}/sessions/{session_id}").status_code == 200
    assert httpx.get(f"{url}/sessions/{session_id}/tools").status_code == 404
    assert server.sandbox_roots() == []


def test_delete_closes_the_sandbox_and_kills_what_runs_in_it(
    factory: WhiteBoxSessionFactory, server: Server
) -> None:
    marker = f"{random.randint(100_000, 999_999)}"
    session = factory.create(hello_row(factory))
    started = session.call_tool("bash", {"command": f"nohup sleep {marker} >/dev/null 2>&1 &"})
    assert started.error is None
    assert wait_for(lambda: sleeping(marker))
    assert len(server.sandbox_roots()) == 1
    session.close()
    assert wait_for(lambda: not sleeping(marker)), "the sandbox's processes outlived its session"
    assert server.sandbox_roots() == []
    with pytest.raises(RolloutServerError, match="closed"):
        session.call_tool("bash", {"command": "true"})


def test_delete_during_a_tool_call_cancels_it_and_closes_the_sandbox(
    factory: WhiteBoxSessionFactory, server: Server
) -> None:
    marker = f"{random.randint(100_000, 999_999)}"
    session = factory.create(hello_row(factory))
    url = f"{server.url}/sessions/{session.session_id}"
    with httpx.Client(timeout=60) as client:
        replies: list[httpx.Response] = []
        sleep = {"name": "bash", "arguments": {"command": f"sleep {marker}"}}
        call = threading.Thread(target=lambda: replies.append(client.post(f"{url}/tools/call", json=sleep)))
        call.start()
        assert wait_for(lambda: sleeping(marker))
        assert httpx.delete(url).status_code == 200
        call.join(30)
    assert replies and replies[0].status_code == 410, replies
    assert wait_for(lambda: not sleeping(marker))
    assert server.sandbox_roots() == []
    session.close()


def test_an_openenv_harness_adapter_drives_an_episode_through_the_server(
    factory: WhiteBoxSessionFactory,
) -> None:
    """OpenEnv's own MCP loop, the trainer's sampling scripted: write the file, then answer."""
    replies = iter(
        [
            LLMResponse(
                content="",
                tool_calls=[
                    ToolCall("1", "no_such_tool", {}),
                    ToolCall("2", "write_file", {"path": "/app/hello.txt", "content": "Hello, Harbor!"}),
                ],
            ),
            LLMResponse(content="Done."),
        ]
    )
    seen_tools: list[list[str]] = []

    def model_step(messages, tools, sampling) -> ModelStepResult:
        seen_tools.append([tool.name for tool in tools])
        return ModelStepResult(response=next(replies))

    with factory.create(hello_row(factory)) as session:
        rollout = MCPHarnessAdapter().run_white_box(model_step, session, HarnessRunLimits(max_turns=4))
        assert rollout.done and seen_tools[0][0] == "bash"
        tool_messages = [m for m in rollout.messages if m["role"] == "tool"]
        assert "unknown tool" in tool_messages[0]["content"]  # the model reads its mistake
        verdict = session.verify(rollout.messages)
        assert verdict.env_reward == 1.0 and verdict.metrics["tool_failure_count"] == 1


def test_a_refused_start_leaves_no_session_open(factory: WhiteBoxSessionFactory, server: Server) -> None:
    with pytest.raises(RolloutServerError, match=r"404.*no such task"):
        WhiteBoxSession.start(server.url, index=99, sandbox="local")
    with pytest.raises(RolloutServerError, match=r"400.*episode_timeout_sec"):
        WhiteBoxSession.start(server.url, index=0, sandbox="local", episode_timeout_sec=-1)
    assert server.open_sessions() == 0


@pytest.mark.slow
def test_server_shutdown_closes_open_environments(tmp_path: Path) -> None:
    running = Server(tmp_path)
    try:
        session = WhiteBoxSession.start(running.url, index=0, sandbox="local")
        assert len(running.sandbox_roots()) == 1
    finally:
        running.stop()
    assert running.process.returncode is not None
    assert running.sandbox_roots() == [], "shutdown left a sandbox behind"
    with pytest.raises(RolloutServerError, match="unreachable"):
        session.call_tool("bash", {"command": "true"})
    session.close()


# In process (the server's app on a test client, no capture proxy: white-box sessions need none), where a
# test can reach the sandbox behind a session and close it as its lifetime running out would.


class ToolsOnlyRuntime(RolloutRuntime):
    """The runtime without its capture proxy: sandbox backends only."""

    async def start(self) -> None:
        return None

    async def open_capture_sessions(self) -> int:
        return 0


def in_process(tmp_path: Path, idle_timeout_s: float | None = None) -> RolloutServer:
    config = RuntimeConfig(
        upstream="http://127.0.0.1:9",
        data_dir=tmp_path / "capture",
        served_model="never-called",
        sandbox_options={"local": {"base_dir": str(tmp_path / "sandboxes")}},
    )
    return RolloutServer(ToolsOnlyRuntime(config), LocalTaskSource(EXAMPLES), idle_timeout_s=idle_timeout_s)


def roots(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "sandboxes").glob("ht-*"))


async def test_a_sandbox_that_dies_answers_410_from_then_on_and_its_session_can_be_deleted(
    tmp_path: Path,
) -> None:
    server = in_process(tmp_path)
    async with TestClient(TestServer(server.app())) as client:
        session_id = (await (await client.post("/sessions")).json())["session_id"]
        started = await client.post(
            f"/sessions/{session_id}/environment", json={"split": "train", "index": 0}
        )
        assert started.status == 201 and len(roots(tmp_path)) == 1
        environment = server.slots[session_id].environment
        assert environment is not None and environment.sandbox is not None
        await environment.sandbox.close()  # as its lifetime running out would
        call = {"name": "bash", "arguments": {"command": "true"}}
        for path, body in [("tools/call", call), ("tools/call", call), ("verify", {})]:
            reply = await client.post(f"/sessions/{session_id}/{path}", json=body)
            assert reply.status == 410, path
            assert "sandbox is gone" in (await reply.json())["error"]["message"]
        status = await (await client.get(f"/sessions/{session_id}")).json()
        assert status["status"] == "done" and "closed" in status["environment"]["error"]
        assert (await client.delete(f"/sessions/{session_id}")).status == 200
    assert roots(tmp_path) == []


async def test_an_abandoned_environment_is_reaped_and_its_sandbox_closed(tmp_path: Path) -> None:
    server = in_process(tmp_path, idle_timeout_s=0.4)
    async with TestClient(TestServer(server.app())) as client:
        session_id = (await (await client.post("/sessions")).json())["session_id"]
        started = await client.post(
            f"/sessions/{session_id}/environment", json={"split": "train", "index": 0}
        )
        assert started.status == 201 and len(roots(tmp_path)) == 1
        deadline = time.monotonic() + 10
        while roots(tmp_path) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert session_id not in server.slots and server.reaped == 1
        assert roots(tmp_path) == []


def test_a_dead_sandbox_makes_the_client_session_unscorable() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        if request.method == "DELETE":
            return httpx.Response(200, json={"closed": True})
        return httpx.Response(
            410, json={"error": {"message": "the session's sandbox is gone: died", "code": 410}}
        )

    client = httpx.Client(base_url="http://rollouts", transport=httpx.MockTransport(answer))
    started = {"task": {"name": "t", "split": "train", "index": 0, "instruction": "do it"}, "tools": []}
    with WhiteBoxSession(client, "s", started) as session:
        for call in (lambda: session.call_tool("bash", {"command": "true"}), lambda: session.verify([])):
            with pytest.raises(RolloutUnscorable, match="sandbox is gone") as raised:
                call()
            assert raised.value.kind == "sandbox"


def test_a_factory_checks_its_keywords_and_split_when_built(server: Server) -> None:
    with pytest.raises(TypeError, match="harness"):
        WhiteBoxSessionFactory(server.url, harness="toy")
    with pytest.raises(TypeError, match="create"):
        WhiteBoxSessionFactory(server.url, index=0)
    with pytest.raises(RolloutConfigError, match="nope"):
        WhiteBoxSessionFactory(server.url, split="nope")


class FailingBackend:
    """A sandbox backend whose every start fails, as a provider's outage would."""

    name = "local"

    async def start(self, task, *, lifetime_s: float, env=None):
        raise SandboxStartError(f"{task.name}: the provider is down")

    async def aclose(self) -> None:
        return None


async def test_a_sandbox_that_fails_to_start_answers_410_and_its_session_can_be_deleted(
    tmp_path: Path,
) -> None:
    server = in_process(tmp_path)
    server.runtime.backend = lambda name: FailingBackend()  # type: ignore[method-assign,assignment,return-value]
    async with TestClient(TestServer(server.app())) as client:
        session_id = (await (await client.post("/sessions")).json())["session_id"]
        started = await client.post(
            f"/sessions/{session_id}/environment", json={"split": "train", "index": 0}
        )
        assert started.status == 410 and "provider is down" in (await started.json())["error"]["message"]
        status = await (await client.get(f"/sessions/{session_id}")).json()
        assert status["status"] == "done" and "SandboxStartError" in status["environment"]["error"]
        call = await client.post(f"/sessions/{session_id}/tools/call", json={"name": "bash"})
        assert call.status == 410
        assert (await client.delete(f"/sessions/{session_id}")).status == 200


async def test_calls_on_one_session_run_one_at_a_time_and_bad_bodies_never_get_a_5xx(tmp_path: Path) -> None:
    server = in_process(tmp_path)
    async with TestClient(TestServer(server.app())) as client:
        session_id = (await (await client.post("/sessions")).json())["session_id"]
        for path in ("environment", "tools/call", "verify"):
            for raw in (b"", b"[1]", b"{", b"\xff\xfe", b"[" * 2000 + b"]" * 2000, b'{"name": null}'):
                reply = await client.post(f"/sessions/{session_id}/{path}", data=raw)
                assert 400 <= reply.status < 500, (path, raw[:20], reply.status)
        started = await client.post(
            f"/sessions/{session_id}/environment", json={"split": "train", "index": 0}
        )
        assert started.status == 201
        timed = {"name": "bash", "arguments": {"command": "date +%s.%N; sleep 0.3; date +%s.%N"}}
        replies = await asyncio.gather(
            *(client.post(f"/sessions/{session_id}/tools/call", json=timed) for _ in range(3))
        )
        outputs = [(await reply.json())["data"] for reply in replies]
        spans = sorted(tuple(float(line) for line in output.splitlines()[:2]) for output in outputs)
        assert all(earlier[1] <= later[0] for earlier, later in itertools.pairwise(spans)), spans
        assert (await client.delete(f"/sessions/{session_id}")).status == 200
    assert roots(tmp_path) == []
