"""What the Docker backend adds to the sandbox contract (test_contract.py runs that against it too), against
the real daemon: images built once per content from the task's Dockerfile with a missing base mapped (or
refused), build failures named, resource limits, no network without ``allow_internet`` while the capture
proxy's loopback URL still works, and leftovers of dead processes removed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
from types import SimpleNamespace

import pytest

from harness_trainer.sandboxes.base import SandboxError, SandboxStartError
from harness_trainer.sandboxes.docker import BASE_IMAGE, LABEL, DockerSandboxBackend, remove_leftovers
from harness_trainer.sandboxes.docker_images import DockerImages, _missing_command_hint
from tests.sandboxes.conftest import TaskFactory

pytestmark = pytest.mark.docker

DOCKERFILE = """FROM python:3.11-slim
ARG GREETING=hi
ENV GREETING=$GREETING PATH=/opt/tools:$PATH
WORKDIR /srv/work
COPY data.txt ./
RUN echo built > /built.txt
"""
FETCH = (
    'python3 -c "import sys, urllib.request as u; print(u.urlopen(sys.argv[1], timeout=5).read().decode())" '
)


@pytest.fixture
def backend(docker_backend: DockerSandboxBackend) -> DockerSandboxBackend:
    return docker_backend


async def test_the_image_is_built_once_per_content_from_the_dockerfile_with_a_missing_base_mapped(
    backend: DockerSandboxBackend, make_task: TaskFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    task = make_task(DOCKERFILE, files={"data.txt": "payload\n"})
    sandbox = await backend.start(task, lifetime_s=60)
    try:
        result = await sandbox.exec('pwd; echo "$GREETING"; cat data.txt /built.txt; python3 -c "print(1)"')
        assert result.stdout == "/srv/work\nhi\npayload\nbuilt\n1\n", result.stderr
        assert sandbox.workdir == "/srv/work" and not sandbox.shares_host_filesystem
        assert (await sandbox.exec('echo "$PATH"')).stdout.startswith(
            "/opt/tools:"
        )  # the login shell kept it
    finally:
        await sandbox.close()
    assert "FROM image python:3.11-slim is not on this Docker daemon: using ht-debian:bookworm" in caplog.text
    twin = make_task(DOCKERFILE, files={"data.txt": "payload\n"})
    changed = make_task(DOCKERFILE, files={"data.txt": "other\n"})
    resolve = backend.images.resolve
    assert await resolve(twin) == await resolve(task) != await resolve(changed)


async def test_a_python_image_is_stood_in_for_by_one_with_python_and_pip(
    backend: DockerSandboxBackend, make_task: TaskFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """What a real Harbor task's Dockerfile does with a ``python:*-slim`` base (digest-pinned, as they are):
    ``python``, ``pip install`` into the system Python. The stand-in gives both; the pip install reaches
    PyPI through the host's trust (test_host_trust.py)."""
    caplog.set_level(logging.WARNING)
    pinned = "python:3.12-slim@sha256:" + "ab" * 32
    task = make_task(
        f"FROM {pinned}\nRUN python --version && pip --version\n"
        "RUN pip install --no-deps --quiet six==1.16.0\n"
        "RUN python -c 'import six; print(six.__version__)' > /v\n"
    )
    sandbox = await backend.start(task, lifetime_s=120)
    try:
        assert (await sandbox.exec("cat /v; command -v python python3 pip")).stdout.split() == [
            "1.16.0",
            "/usr/bin/python",
            "/usr/bin/python3",
            "/usr/bin/pip",
        ]
    finally:
        await sandbox.close()
    assert (
        f"FROM image {pinned} is not on this Docker daemon: using ht-debian:bookworm with python and pip"
        in (caplog.text)
    )
    ubuntu = make_task("FROM ubuntu:24.04\nRUN true\n")  # not a python image: the plain base, no pip
    sandbox = await backend.start(ubuntu, lifetime_s=60)
    try:
        assert (await sandbox.exec("command -v pip || echo none")).stdout == "none\n"
    finally:
        await sandbox.close()


async def test_a_missing_image_can_be_refused_and_a_failed_build_names_its_step(
    make_task: TaskFactory,
) -> None:
    strict = DockerSandboxBackend(map_missing_images=False)
    with pytest.raises(
        SandboxStartError, match=re.escape("FROM image python:3.11-slim is not on this Docker daemon")
    ):
        await strict.start(make_task("FROM python:3.11-slim\n"), lifetime_s=60)
    broken = make_task("FROM ht-debian:bookworm\nRUN echo boom-$((40 + 2)); exit 3\n")
    with pytest.raises(SandboxStartError, match=r"(?s)image build failed.*RUN echo boom.*boom-42.*code: 3"):
        await strict.start(broken, lifetime_s=60)
    assert not strict.live


async def test_a_command_the_stand_in_lacks_fails_the_build_naming_it_and_the_stand_in(
    backend: DockerSandboxBackend, make_task: TaskFactory
) -> None:
    """ubuntu's minimal image has no ``file`` either, but a build that needs it should say why it failed
    here: the image it asked for was stood in for."""
    task = make_task("FROM ubuntu:24.04\nWORKDIR /app\nRUN file --version\n")
    with pytest.raises(SandboxStartError) as raised:
        await backend.start(task, lifetime_s=60)
    message = str(raised.value)
    assert "image build failed" in message and "file: not found" in message
    assert (
        "`file` is not in the stand-in this build ran on (ubuntu:24.04 stood in for by ht-debian:bookworm"
        in (message)
    )
    with pytest.raises(SandboxStartError) as plain:  # a failure of another kind gets no such line
        await backend.start(make_task("FROM ubuntu:24.04\nRUN exit 4\n"), lifetime_s=60)
    assert "stand-in" not in str(plain.value)


async def test_every_start_waiting_on_one_failed_build_gets_its_log(make_task: TaskFactory) -> None:
    backend = DockerSandboxBackend()
    broken = make_task("FROM ht-debian:bookworm\nRUN sleep 1; echo shared-$((40 + 2)); exit 5\n")
    results = await asyncio.gather(
        *(backend.start(broken, lifetime_s=60) for _ in range(3)), return_exceptions=True
    )
    for result in results:  # one build, three waiters: each gets the build's log, none a KeyError
        assert isinstance(result, SandboxStartError), result
        assert re.search(r"(?s)image build failed.*shared-42.*code: 5", str(result)), str(result)
    assert not backend.live


async def test_limits_apply_and_without_internet_only_the_capture_proxy_is_reachable(
    make_task: TaskFactory,
) -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: 7\r\n\r\nproxied")
        await writer.drain()
        writer.close()

    proxy = await asyncio.start_server(answer, "127.0.0.1", 0)
    engine = await asyncio.start_server(answer, "127.0.0.1", 0)  # any other loopback service of the host
    proxy_port, engine_port = (s.sockets[0].getsockname()[1] for s in (proxy, engine))
    backend = DockerSandboxBackend(proxy_url=f"http://127.0.0.1:{proxy_port}/v1", kill_grace_s=0.5)
    sandbox = await backend.start(make_task(allow_internet=False, cpus=0.5, memory_mb=128), lifetime_s=60)
    try:
        reached = await sandbox.exec(FETCH + f"http://127.0.0.1:{proxy_port}/v1/models")
        assert reached.stdout == "proxied\n", reached.stderr
        assert (await sandbox.exec(FETCH + f"http://127.0.0.1:{engine_port}/")).exit_code != 0
        assert (await sandbox.exec("ls /sys/class/net")).stdout.split() == ["lo"]
        hog = await sandbox.exec('python3 -c "b = bytearray(400 << 20); print(len(b))"', timeout_s=30)
        assert hog.exit_code != 0 and hog.stdout == ""
        limits = (await backend.call(backend.client.api.inspect_container, sandbox.container))["HostConfig"]
        assert (limits["NanoCpus"], limits["Memory"], limits["NetworkMode"]) == (
            500_000_000,
            128 << 20,
            "none",
        )
    finally:
        await backend.aclose()
        proxy.close()
        engine.close()


async def test_a_command_running_when_its_sandbox_closes_is_a_sandbox_error(
    backend: DockerSandboxBackend, make_task: TaskFactory
) -> None:
    sandbox = await backend.start(make_task(), lifetime_s=60)
    running = asyncio.ensure_future(sandbox.exec("sleep 300"))
    await asyncio.sleep(0.5)
    await sandbox.close()
    with pytest.raises(SandboxError, match="closed while"):
        await asyncio.wait_for(running, 10)


async def test_containers_left_by_a_dead_process_are_removed(backend: DockerSandboxBackend) -> None:
    api = backend.client.api
    created = await backend.call(
        api.create_container, "ht-debian:bookworm", ["true"], labels={LABEL: "nowhere:1:0"}
    )
    try:
        owner = api.inspect_container(created["Id"])["Config"]["Labels"][LABEL]
        assert owner == "nowhere:1:0"  # another host's: left alone
        assert created["Id"] not in await backend.call(remove_leftovers, backend.client)
        api.remove_container(created["Id"], force=True)
        dead = f"{socket.gethostname()}:999999999:0"
        created = await backend.call(
            api.create_container, "ht-debian:bookworm", ["true"], labels={LABEL: dead}
        )
        await backend.call(api.create_network, "ht-leftover-test", labels={LABEL: dead})
        await backend.call(remove_leftovers, backend.client)
        # Gone, not necessarily reported by this call: any backend starting meanwhile (another test worker)
        # removes this host's leftovers too, and a leftover another remover got first is not in our list.
        assert not api.containers(all=True, filters={"id": created["Id"]})
        assert not api.networks(names=["ht-leftover-test"])  # a compose sandbox's network too
    finally:
        await backend.remove(created["Id"])
        with contextlib.suppress(Exception):
            api.remove_network("ht-leftover-test")


async def test_the_sandbox_tools_work_in_a_docker_sandbox(
    backend: DockerSandboxBackend, make_task: TaskFactory
) -> None:
    """White-box mode's tools need only the sandbox protocol: in a container as in the local sandbox (a hung
    command killed at its timeout, errors as results)."""
    pytest.importorskip("openenv")
    from harness_trainer.sandboxes.tools import SandboxTools
    from tests.sandboxes.test_tools import assert_error, marker

    sandbox = await backend.start(make_task(), lifetime_s=60)
    tag = marker()
    try:
        tools = SandboxTools(sandbox)
        written = await tools.call_tool("write_file", {"path": "src/a.py", "content": "print(1)\n"})
        assert written.error is None, written.error
        assert (await tools.call_tool("read_file", {"path": "src/a.py"})).data == "print(1)\n"
        assert (await tools.call_tool("list_dir", {"path": "src"})).data == "a.py\n"
        assert (await tools.call_tool("bash", {"command": "python3 src/a.py"})).data == "1\n[exit code: 0]"
        hung = await tools.call_tool("bash", {"command": f"sleep {tag}", "timeout": 0.5})
        assert_error(hung, "timeout and was killed")
        assert (await sandbox.exec(f"pgrep -f 'sleep {tag}' || echo none")).stdout.strip() == "none"
        assert_error(await tools.call_tool("read_file", {"path": "nope"}), "no such file")
        assert tools.metrics()["tool_failures_by_name"] == {"bash": 1, "read_file": 1}
    finally:
        await sandbox.close()


def test_a_line_the_daemon_streams_in_two_events_is_one_line_of_the_builds_log() -> None:
    """The daemon's build events cut its output anywhere (seen under load: ``/bin/sh: 1: `` in one event,
    ``file: not found`` in the next), each stderr chunk in colour codes; the log's tail, and the
    missing-command hint read from it, see the line whole and plain. The events are the daemon's shapes
    (``stream``, then ``error``)."""
    events = [
        {"stream": "Step 3/3 : RUN file --version\n"},
        {"stream": " ---> Running in 0123456789ab\n"},
        {"stream": "\x1b[91m/bin/sh: 1: \x1b[0m"},
        {"stream": "\x1b[91mfile: not found\n\x1b[0m"},
        {"error": "The command '/bin/sh -c file --version' returned a non-zero code: 127"},
    ]
    client = SimpleNamespace(api=SimpleNamespace(build=lambda **_: iter(events)))
    images = DockerImages(
        lambda: client, None, base_image=BASE_IMAGE, map_missing_images=True, build_network=None,  # type: ignore[arg-type]
        build_timeout_s=10.0,
    )  # fmt: skip
    tail = images._run_build(b"", "ht-env:test", 10.0)
    assert tail is not None and "/bin/sh: 1: file: not found\n" in tail
    assert "`file` is not in the stand-in" in _missing_command_hint(("ubuntu:24.04 stood in for by x",), tail)
