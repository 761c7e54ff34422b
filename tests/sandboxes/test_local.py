"""What only the local backend promises: the Dockerfile subset applied for real, a scrubbed
environment, private mounts that never touch the host's mount table, and nothing left after close."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import harness_trainer.sandboxes.local as local
from harness_trainer.sandboxes import unix_relay
from harness_trainer.sandboxes.base import SandboxError, SandboxStartError
from harness_trainer.sandboxes.local import LocalSandboxBackend
from harness_trainer.sandboxes.rootless import probe
from harness_trainer.sandboxes.unix_relay import loopback_target
from tests.sandboxes.conftest import TaskFactory, wait_until_gone, wait_until_present


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[LocalSandboxBackend]:
    started = LocalSandboxBackend(tmp_path / "sandboxes", kill_grace_s=0.5)
    yield started
    leaked = started.live
    await started.aclose()
    assert not leaked


def _tarball(name: str, content: bytes) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        info = tarfile.TarInfo(name)
        info.size = len(content)
        archive.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


DOCKERFILE = """\
# a task image
ARG GREETING=hello
FROM python:3.11-slim
WORKDIR /workspace
ENV APP_MODE=test \\
    PATH=/workspace/bin:$PATH
ENV LEGACY value with spaces
COPY --chown=1000:1000 main.py ./
COPY pkg/ ./pkg/
COPY --chmod=755 tool.sh bin/tool
ADD vendor.tar.gz /workspace/vendor/
RUN echo "$GREETING from $(pwd)" > built.txt
RUN ["/bin/sh", "-c", "echo exec-form >> built.txt"]
"""


async def test_the_dockerfile_subset_is_applied(backend: LocalSandboxBackend, make_task: TaskFactory) -> None:
    files = {
        "main.py": "print('main')\n",
        "pkg/__init__.py": "",
        "pkg/mod.py": "X = 1\n",
        "tool.sh": "#!/bin/sh\necho tool ran\n",
        "vendor.tar.gz": _tarball("lib/v.txt", b"vendored\n"),
    }
    sandbox = await backend.start(make_task(DOCKERFILE, files=files), lifetime_s=60)
    try:
        assert sandbox.workdir == "/workspace"
        listing = await sandbox.exec("find . -type f | sort")
        expected = ["./bin/tool", "./built.txt", "./main.py", "./pkg/__init__.py", "./pkg/mod.py"]
        assert listing.stdout.split() == [*expected, "./vendor/lib/v.txt"]
        assert await sandbox.read_file("built.txt") == b"hello from /workspace\nexec-form\n"
        env = await sandbox.exec('echo "$APP_MODE|$LEGACY|${GREETING-unset}"; tool')
        assert env.stdout == "test|value with spaces|unset\ntool ran\n"
    finally:
        await sandbox.close()


async def test_no_dockerfile_gives_an_empty_workspace_at_app(
    backend: LocalSandboxBackend, make_task: TaskFactory
) -> None:
    sandbox = await backend.start(make_task(None), lifetime_s=60)
    try:
        result = await sandbox.exec("pwd; ls -A")
        assert result.stdout == "/app\n"
    finally:
        await sandbox.close()


@pytest.mark.parametrize(
    ("dockerfile", "needle"),
    [
        ("FROM x\nWORKDIR /app\nEXPOSE 8080\n", "line 3: EXPOSE is not supported"),
        ('FROM x\nCMD ["python", "main.py"]\n', "line 2: CMD is not supported"),
        ("FROM x\nCOPY missing.txt /app/\n", "'missing.txt' does not exist"),
        ("FROM x\nCOPY ../secret /app/\n", "outside the build context"),
        ("FROM x\nWORKDIR /usr/local/thing\n", "cannot make /usr/local/thing private"),
        ("FROM x\nCOPY tool.sh /usr/local/bin/tool\n", "it is a system directory"),
    ],
)
async def test_a_dockerfile_it_cannot_apply_is_refused_clearly(
    backend: LocalSandboxBackend, make_task: TaskFactory, dockerfile: str, needle: str
) -> None:
    with pytest.raises(SandboxStartError, match=needle):
        await backend.start(make_task(dockerfile, files={"tool.sh": "x"}), lifetime_s=60)
    assert not backend.live
    assert not list((backend.base_dir).glob("ht-*")), "a refused start left its root behind"


async def test_a_failing_run_step_reports_its_line_and_output(
    backend: LocalSandboxBackend, make_task: TaskFactory
) -> None:
    dockerfile = (
        "FROM x\nRUN echo preparing\nRUN echo 'boom: no such package' >&2 && exit 4\nRUN echo never\n"
    )
    with pytest.raises(
        SandboxStartError, match=r"line 3: RUN exited with code 4[\s\S]*boom: no such package"
    ):
        await backend.start(make_task(dockerfile), lifetime_s=60)
    assert not backend.live
    assert not list(backend.base_dir.glob("ht-*"))


async def test_run_steps_share_the_build_timeout(tmp_path: Path, make_task: TaskFactory) -> None:
    backend = LocalSandboxBackend(tmp_path / "sandboxes", build_timeout_s=0.5, kill_grace_s=0.2)
    started = time.monotonic()
    with pytest.raises(SandboxStartError, match="line 2: RUN ran past the build timeout"):
        await backend.start(make_task("FROM x\nRUN sleep 60\n"), lifetime_s=60)
    assert time.monotonic() - started < 5
    assert not backend.live


async def test_the_environment_is_scrubbed(
    tmp_path: Path, make_task: TaskFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SECRET_X", "do-not-leak")
    monkeypatch.setenv("HF_TOKEN", "hf_passed")
    backend = LocalSandboxBackend(tmp_path / "sandboxes", passthrough_env=("HF_TOKEN",))
    sandbox = await backend.start(make_task("FROM x\nENV FROM_IMAGE=1\n"), lifetime_s=60, env={"GIVEN": "2"})
    try:
        names = set((await sandbox.exec("env", env={"PER_COMMAND": "3"})).stdout.split("\n"))
        keys = {line.split("=", 1)[0] for line in names if line}
        assert "SECRET_X" not in keys
        assert {"PATH", "HOME", "LANG", "FROM_IMAGE", "GIVEN", "PER_COMMAND", "HF_TOKEN"} <= keys
        assert keys <= {
            "PATH",
            "HOME",
            "LANG",
            "LC_ALL",
            "TERM",
            "FROM_IMAGE",
            "GIVEN",
            "PER_COMMAND",
            "HF_TOKEN",
            *backend.trust.env("-"),  # the host's CA bundle and proxies (test_host_trust.py)
        } | {"PWD", "SHLVL", "_", "OLDPWD"}  # fmt: skip (the last ones are bash's own)
        path = (await sandbox.exec('echo "$PATH"')).stdout.strip()
        assert path.startswith("/home/user/.local/bin:"), "the login shell's /etc/profile must not reset PATH"
    finally:
        await sandbox.close()


async def test_processes_see_only_their_own_sandbox(
    backend: LocalSandboxBackend, make_task: TaskFactory
) -> None:
    sandbox = await backend.start(make_task(), lifetime_s=60)
    try:
        pids = (await sandbox.exec("ls /proc | grep -E '^[0-9]+$' | wc -l")).stdout.strip()
        assert int(pids) < 10, "the sandbox should have its own PID namespace"
    finally:
        await sandbox.close()


async def test_nothing_is_mounted_on_the_host_and_nothing_is_left_after_close(
    backend: LocalSandboxBackend, make_task: TaskFactory
) -> None:
    host_mounts = Path("/proc/self/mountinfo").read_text()
    sandbox = await backend.start(make_task(), lifetime_s=60)
    namespace = os.readlink(f"/proc/{sandbox.pid}/ns/mnt")
    await sandbox.exec("nohup setsid sleep 424242 >/dev/null 2>&1 &")
    assert Path("/proc/self/mountinfo").read_text() == host_mounts
    assert wait_until_present("sleep 424242")
    await sandbox.close()
    assert not wait_until_gone("sleep 424242"), "a setsid'd process escaped close"
    assert not sandbox.root.exists()
    in_namespace = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.readlink(entry / "ns" / "mnt") == namespace:
                in_namespace.append(entry.name)
        except OSError:
            continue
    assert not in_namespace


async def test_roots_left_by_a_dead_owner_are_swept_but_live_ones_kept(
    tmp_path: Path, make_task: TaskFactory
) -> None:
    base = tmp_path / "sandboxes"
    (base / "ht-0123456789ab" / "fs" / "app").mkdir(parents=True)
    (base / "ht-0123456789ab" / ".lock").touch()  # nobody holds it: its owner is gone
    (base / "ht-unrelated").mkdir()
    first = LocalSandboxBackend(base)
    alive = await first.start(make_task(), lifetime_s=60)
    second = LocalSandboxBackend(base)
    other = await second.start(make_task(), lifetime_s=60)
    try:
        assert not (base / "ht-0123456789ab").exists()
        assert alive.root.exists() and (base / "ht-unrelated").exists()
    finally:
        await asyncio.gather(alive.close(), other.close())


async def test_a_sweep_that_runs_while_a_root_is_being_made_leaves_it_alone(
    tmp_path: Path, make_task: TaskFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another start's (or another process's) sweep may run at any moment of a start: here it runs at the
    worst one, just before the new root is locked. It must not see that root as dead (CI once lost a
    root that way when three sandboxes started at once)."""
    base = tmp_path / "sandboxes"
    base.mkdir()
    real_flock = local.fcntl.flock
    swept: list[list[Path]] = []

    def flock_after_a_sweep(fd: int, operation: int) -> None:
        if not swept:
            swept.append([])  # the sweep takes locks too: sweep once, before the first lock only
            swept[0] = local.sweep_stale_roots(base)
        real_flock(fd, operation)

    backend = LocalSandboxBackend(base)
    backend._swept = True  # the first start's own sweep is not the one under test
    monkeypatch.setattr(local.fcntl, "flock", flock_after_a_sweep)
    sandbox = await backend.start(make_task(), lifetime_s=60)
    monkeypatch.undo()
    try:
        assert swept == [[]], "the sweep took a root that was being made for a dead one"
        assert (sandbox.root / ".lock").exists() and local.sweep_stale_roots(base) == []
        assert sorted(p.name for p in base.iterdir()) == [sandbox.root.name]
    finally:
        await sandbox.close()


async def test_file_methods_refuse_paths_outside_the_sandbox(
    backend: LocalSandboxBackend, make_task: TaskFactory
) -> None:
    sandbox = await backend.start(make_task(), lifetime_s=60)
    try:
        with pytest.raises(SandboxError, match="outside the local sandbox's private paths"):
            await sandbox.write_file("/etc/evil.conf", "x")
        await sandbox.write_file("~/.config/tool.json", "{}")
        assert (await sandbox.exec("cat /home/user/.config/tool.json")).stdout == "{}"
    finally:
        await sandbox.close()


async def test_file_methods_refuse_a_closed_sandbox_and_recreate_nothing(
    backend: LocalSandboxBackend, make_task: TaskFactory, tmp_path: Path
) -> None:
    sandbox = await backend.start(make_task(), lifetime_s=60)
    await sandbox.close()
    (tmp_path / "upload").mkdir()
    for call in (
        sandbox.write_file("notes.txt", "x"),
        sandbox.read_file("notes.txt"),
        sandbox.upload_dir(tmp_path / "upload", "/app/up"),
    ):
        with pytest.raises(SandboxError, match="closed"):
            await call
    assert not sandbox.root.exists()


async def test_a_sandbox_closes_itself_when_its_lifetime_runs_out(
    tmp_path: Path, make_task: TaskFactory
) -> None:
    backend = LocalSandboxBackend(tmp_path / "sandboxes", lifetime_margin_s=0.3)
    sandbox = await backend.start(make_task(agent_timeout_sec=0, verifier_timeout_sec=0), lifetime_s=0)
    await asyncio.sleep(1.0)
    assert sandbox.closed and not backend.live


async def test_start_and_close_are_cheap(backend: LocalSandboxBackend, make_task: TaskFactory) -> None:
    task = make_task("FROM x\nWORKDIR /app\nCOPY main.py ./\n", files={"main.py": "print(1)\n"})
    timings = []
    for _ in range(5):
        began = time.perf_counter()
        sandbox = await backend.start(task, lifetime_s=60)
        await sandbox.close()
        timings.append(time.perf_counter() - began)
    print(f"local sandbox start+close: median {sorted(timings)[2] * 1000:.1f} ms")
    assert sorted(timings)[2] < 0.5


def test_a_hard_killed_owner_takes_its_sandboxes_with_it(make_task: TaskFactory, tmp_path: Path) -> None:
    task = make_task()
    script = textwrap.dedent(
        f"""
        import asyncio, pathlib, sys
        from harness_trainer.sandboxes.local import LocalSandboxBackend
        from harness_trainer.tasks.task import EnvironmentSpec, HarborTask

        async def main():
            task = HarborTask(name="t", path=pathlib.Path({str(task.path)!r}), instruction="", config={{}},
                              agent_timeout_sec=60, verifier_timeout_sec=60, environment=EnvironmentSpec())
            sandbox = await LocalSandboxBackend({str(tmp_path / "owner")!r}).start(task, lifetime_s=60)
            await sandbox.exec("nohup sleep 535353 >/dev/null 2>&1 &")
            print("ready", flush=True)
            await asyncio.sleep(60)

        asyncio.run(main())
        """
    )
    (tmp_path / "owner.py").write_text(script)  # not `-c`: its command line would match the marker
    owner = subprocess.Popen([sys.executable, tmp_path / "owner.py"], stdout=subprocess.PIPE, cwd=Path.cwd())
    try:
        assert owner.stdout is not None and owner.stdout.readline() == b"ready\n"
        assert wait_until_present("sleep 535353")
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
        assert not wait_until_gone("sleep 535353"), "the sandbox outlived its owner"
    finally:
        owner.kill()
        owner.wait()
        assert owner.stdout is not None
        owner.stdout.close()


# Fetches argv[1] and prints the body; ignores the host's proxy variables (which the sandbox inherits).
FETCH = (
    f"{sys.executable} -c 'import sys, urllib.request as u; opener = u.build_opener(u.ProxyHandler({{}})); "
    "print(opener.open(sys.argv[1], timeout=5).read().decode())' "
)
CONNECT = (
    f"{sys.executable} -c 'import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 3)' "
)


@pytest.fixture
async def loopback_services() -> AsyncIterator[tuple[int, int]]:
    """Two tiny HTTP servers on this machine's loopback: the capture proxy's stand-in and another service
    (an engine, say); yields their ports."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: 7\r\n\r\nproxied")
            await writer.drain()
        except asyncio.IncompleteReadError:
            pass  # a bare connect (CONNECT): nothing to answer
        writer.close()

    servers = [await asyncio.start_server(answer, "127.0.0.1", 0) for _ in range(2)]
    yield servers[0].sockets[0].getsockname()[1], servers[1].sockets[0].getsockname()[1]
    for server in servers:
        server.close()


def _mode_or_skip(mode: str) -> str:
    if (why := probe(next(m for m in LocalSandboxBackend.modes if m.name == mode))) is not None:
        pytest.skip(f"no {mode} mode here: {why}")
    return mode


@pytest.mark.parametrize("mode", ["root", "rootless"])
async def test_without_internet_only_the_capture_proxy_is_reachable_at_its_own_url(
    tmp_path: Path, make_task: TaskFactory, loopback_services: tuple[int, int], mode: str
) -> None:
    proxy_port, engine_port = loopback_services
    backend = LocalSandboxBackend(
        tmp_path / "sandboxes", mode=_mode_or_skip(mode), proxy_url=f"http://127.0.0.1:{proxy_port}/v1"
    )
    # RUN steps build the environment with the host's network, as Docker builds an image.
    task = make_task(f"FROM x\nRUN {CONNECT}127.0.0.1 {engine_port}\n", allow_internet=False)
    sandbox = await backend.start(task, lifetime_s=60)
    try:
        reached = await sandbox.exec(FETCH + f"http://127.0.0.1:{proxy_port}/v1/models")
        assert (reached.exit_code, reached.stdout) == (0, "proxied\n"), reached.stderr
        engine = await sandbox.exec(CONNECT + f"127.0.0.1 {engine_port}")
        assert engine.exit_code != 0 and "Connection refused" in engine.stderr
        outside = await sandbox.exec(CONNECT + "1.1.1.1 443", timeout_s=10)
        assert outside.exit_code != 0 and "Network is unreachable" in outside.stderr
        interfaces = await sandbox.exec("tail -n +3 /proc/net/dev | cut -d: -f1")
        assert interfaces.stdout.split() == ["lo"]
    finally:
        await backend.aclose()


async def test_with_internet_the_host_network_is_shared_as_before(
    tmp_path: Path, make_task: TaskFactory, loopback_services: tuple[int, int]
) -> None:
    proxy_port, engine_port = loopback_services
    backend = LocalSandboxBackend(tmp_path / "sandboxes", proxy_url=f"http://127.0.0.1:{proxy_port}/v1")
    sandbox = await backend.start(make_task(), lifetime_s=60)
    try:
        assert (await sandbox.exec(CONNECT + f"127.0.0.1 {engine_port}")).exit_code == 0
        own = (await sandbox.exec("readlink /proc/self/ns/net")).stdout.strip()
        assert own == os.readlink("/proc/self/ns/net")
        assert sandbox.relay is None and not (sandbox.root / "proxy.sock").exists()
    finally:
        await backend.aclose()


@pytest.mark.parametrize("mode", ["root", "rootless"])
async def test_the_proxy_relay_leaves_nothing_after_close_or_a_failed_start(
    tmp_path: Path, make_task: TaskFactory, loopback_services: tuple[int, int], mode: str
) -> None:
    proxy_port, _ = loopback_services
    backend = LocalSandboxBackend(
        tmp_path / "sandboxes", mode=_mode_or_skip(mode), proxy_url=f"http://localhost:{proxy_port}"
    )
    sandbox = await backend.start(make_task(allow_internet=False), lifetime_s=60)
    assert sandbox.relay is not None
    socket_path, relay = sandbox.relay.socket_path, f"ht-proxy-relay {sandbox.root} "
    assert socket_path.is_socket() and len(wait_until_present(relay, count=2)) == 2  # nsenter, its child
    assert (await sandbox.exec(FETCH + f"http://localhost:{proxy_port}/")).stdout == "proxied\n"
    await sandbox.close()
    assert not wait_until_gone(relay) and not socket_path.exists() and not sandbox.root.exists()

    failing = make_task("FROM x\nRUN exit 3\n", allow_internet=False, name="offline-fails")
    with pytest.raises(SandboxStartError, match="offline-fails: Dockerfile line 2: RUN exited with code 3"):
        await backend.start(failing, lifetime_s=60)
    assert not wait_until_gone("ht-proxy-relay " + str(tmp_path)) and not backend.live
    assert not list((tmp_path / "sandboxes").iterdir())


async def test_a_relay_that_does_not_start_fails_the_start_naming_the_task_and_the_field(
    tmp_path: Path, make_task: TaskFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(unix_relay, "INSIDE", "import sys; sys.exit('no listener today')")
    backend = LocalSandboxBackend(tmp_path / "sandboxes", proxy_url="http://127.0.0.1:9")
    with pytest.raises(SandboxStartError) as raised:
        await backend.start(make_task(allow_internet=False, name="offline"), lifetime_s=60)
    assert str(raised.value).startswith("offline: [environment] allow_internet = false")
    assert "the proxy relay did not start in the sandbox" in str(raised.value)
    assert str(raised.value).endswith(": no listener today")
    assert not backend.live and not list((tmp_path / "sandboxes").iterdir())
    assert not wait_until_gone("ht-proxy-relay " + str(tmp_path))


def test_only_a_loopback_proxy_url_is_relayed() -> None:
    assert loopback_target("http://127.0.0.1:8300/v1") == ("127.0.0.1", 8300)
    assert loopback_target("https://localhost/v1") == ("localhost", 443)
    assert loopback_target("http://[::1]:9") == ("::1", 9)
    assert loopback_target("http://127.0.0.2") == ("127.0.0.2", 80)
    assert loopback_target("https://proxy.example") is None
    assert loopback_target("http://10.0.0.1:8300") is None
    assert loopback_target(None) is None
