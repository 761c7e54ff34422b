"""The supervisor: rate-limited starts, and every live sandbox closed on shutdown and on SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from harness_trainer.sandboxes import SANDBOXES, make_backend
from harness_trainer.sandboxes.base import Capabilities, ExecResult, Isolation, SandboxStartError
from harness_trainer.sandboxes.local import LocalSandboxBackend
from harness_trainer.sandboxes.supervisor import SandboxSupervisor, StartRateLimiter
from harness_trainer.tasks.task import HarborTask
from tests.sandboxes.conftest import TaskFactory, live_processes, wait_until_gone, wait_until_present


class StubSandbox:
    """A sandbox that only counts closes; ``hang`` makes close never return."""

    def __init__(self, number: int, hang: bool = False) -> None:
        self.id = f"stub-{number}"
        self.workdir, self.home = "/app", "/root"
        self.closes = 0
        self.hang = hang

    @property
    def closed(self) -> bool:
        return self.closes > 0

    async def exec(self, command: str, **_: object) -> ExecResult:
        return ExecResult(0, "", "")

    async def close(self) -> None:
        self.closes += 1
        if self.hang:
            await asyncio.sleep(3600)


class StubBackend:
    name = "stub"
    capabilities = Capabilities(summary="stub", isolation=Isolation(False, False, False, False))

    def __init__(self, start_delay_s: float = 0.0, hang_on_close: bool = False) -> None:
        self.started: list[StubSandbox] = []
        self.start_times: list[float] = []
        self.start_delay_s = start_delay_s
        self.hang_on_close = hang_on_close
        self.aclosed = False
        self.prepared: list[str] = []

    async def prepare(self, task: HarborTask) -> None:
        self.prepared.append(task.name)

    async def start(
        self, task: HarborTask, *, lifetime_s: float, env: dict[str, str] | None = None
    ) -> StubSandbox:
        self.start_times.append(time.monotonic())
        await asyncio.sleep(self.start_delay_s)
        sandbox = StubSandbox(len(self.started), hang=self.hang_on_close)
        self.started.append(sandbox)
        return sandbox

    async def aclose(self) -> None:
        self.aclosed = True


async def test_the_limiter_spaces_starts_after_the_burst() -> None:
    limiter = StartRateLimiter(rate_per_s=20, burst=2)
    began = time.monotonic()
    for _ in range(6):
        await limiter.acquire()
    elapsed = time.monotonic() - began
    assert 0.18 <= elapsed < 0.6  # 2 at once, then 4 at 50 ms each


def test_the_limiter_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="rate_per_s > 0"):
        StartRateLimiter(0)


async def test_supervised_starts_are_rate_limited(make_task: TaskFactory) -> None:
    backend = StubBackend()
    supervisor = SandboxSupervisor(backend, max_starts_per_s=25, burst=1)
    task = make_task()
    await asyncio.gather(*(supervisor.start(task, lifetime_s=60) for _ in range(5)))
    gaps = [b - a for a, b in zip(backend.start_times, backend.start_times[1:], strict=False)]
    assert min(gaps) >= 0.035
    await supervisor.aclose()


async def test_at_most_max_starts_in_flight_creates_run_at_once(make_task: TaskFactory) -> None:
    backend = StubBackend(start_delay_s=0.05)
    in_flight, peak = 0, 0
    start = backend.start

    async def counted(task: HarborTask, **options: object) -> StubSandbox:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            return await start(task, **options)  # type: ignore[arg-type]
        finally:
            in_flight -= 1

    backend.start = counted  # type: ignore[method-assign]
    supervisor = SandboxSupervisor(backend, max_starts_in_flight=3)
    task = make_task()
    await asyncio.gather(*(supervisor.start(task, lifetime_s=60) for _ in range(12)))
    assert peak == 3 and len(backend.started) == 12
    await supervisor.aclose()


async def test_a_start_waiting_for_its_environments_build_holds_no_slot_nor_token(
    make_task: TaskFactory,
) -> None:
    """One slot, one start a second: a start whose environment is still building (``prepare``) lets the
    start of a built one go first, then takes the slot itself once its build is done."""
    backend = StubBackend()
    building = asyncio.Event()
    prepare = backend.prepare

    async def slow_build(task: HarborTask) -> None:
        await prepare(task)
        if task.name == "building":
            await building.wait()

    backend.prepare = slow_build  # type: ignore[method-assign]
    supervisor = SandboxSupervisor(backend, max_starts_in_flight=1, max_starts_per_s=1.0)
    slow = asyncio.ensure_future(supervisor.start(make_task(name="building"), lifetime_s=60))
    await asyncio.sleep(0.05)
    built = await asyncio.wait_for(supervisor.start(make_task(name="built"), lifetime_s=60), 0.5)
    assert [s.id for s in backend.started] == [built.id] and not slow.done()
    building.set()
    await asyncio.wait_for(slow, 5)  # after its build, it waits for the next token like any start
    assert backend.prepared == ["building", "built"] and len(backend.started) == 2
    await supervisor.aclose()


async def test_jittered_starts_spread_over_the_jitter_window(make_task: TaskFactory) -> None:
    backend = StubBackend()
    supervisor = SandboxSupervisor(backend, start_jitter_s=0.3)
    task = make_task()
    began = time.monotonic()
    await asyncio.gather(*(supervisor.start(task, lifetime_s=60) for _ in range(16)))
    offsets = sorted(t - began for t in backend.start_times)
    assert offsets[-1] <= 0.3 + 0.2 and offsets[-1] - offsets[0] >= 0.05  # not all at once
    await supervisor.aclose()
    with pytest.raises(ValueError, match="max_starts_in_flight must be at least 1"):
        SandboxSupervisor(backend, max_starts_in_flight=0)
    with pytest.raises(ValueError, match="start_jitter_s must be >= 0"):
        SandboxSupervisor(backend, start_jitter_s=-1)


async def test_aclose_closes_every_live_sandbox_and_the_backend(make_task: TaskFactory) -> None:
    backend = StubBackend()
    supervisor = SandboxSupervisor(backend)
    task = make_task()
    sandboxes = [await supervisor.start(task, lifetime_s=60) for _ in range(4)]
    await sandboxes[0].close()
    assert len(supervisor.live) == 3
    await supervisor.aclose()
    assert [s.closes for s in backend.started] == [1, 1, 1, 1]
    assert backend.aclosed and not supervisor.live
    with pytest.raises(SandboxStartError, match="shutting down"):
        await supervisor.start(task, lifetime_s=60)


async def test_a_close_that_hangs_is_bounded(make_task: TaskFactory) -> None:
    supervisor = SandboxSupervisor(StubBackend(hang_on_close=True), close_timeout_s=0.2)
    await asyncio.gather(*(supervisor.start(make_task(), lifetime_s=60) for _ in range(3)))
    began = time.monotonic()
    await supervisor.aclose()
    assert time.monotonic() - began < 1.0  # concurrently, each bounded


async def test_a_sandbox_that_finishes_starting_during_shutdown_is_closed(make_task: TaskFactory) -> None:
    backend = StubBackend(start_delay_s=0.2)
    supervisor = SandboxSupervisor(backend)
    starting = asyncio.ensure_future(supervisor.start(make_task(), lifetime_s=60))
    await asyncio.sleep(0.05)
    await supervisor.aclose()
    with pytest.raises(SandboxStartError, match="shut down while this sandbox started"):
        await starting
    assert backend.started[0].closes == 1


async def test_the_supervisor_is_a_backend_over_real_local_sandboxes(
    make_task: TaskFactory, tmp_path: Path
) -> None:
    supervisor = SandboxSupervisor(LocalSandboxBackend(tmp_path / "sandboxes"), max_starts_per_s=50, burst=4)
    try:  # closed on every path: a failed start must not leave the others running into later tests
        sandboxes = await asyncio.gather(*(supervisor.start(make_task(), lifetime_s=60) for _ in range(3)))
        await sandboxes[1].exec("nohup sleep 616161 >/dev/null 2>&1 &")
        assert supervisor.name == "local" and len(supervisor.live) == 3
    finally:
        await supervisor.aclose()
    assert not wait_until_gone("sleep 616161")


def test_the_registry_builds_backends_by_name(tmp_path: Path) -> None:
    assert set(SANDBOXES) == {"local", "e2b", "docker", "hf"}
    local = make_backend("local", base_dir=tmp_path, kill_grace_s=1.0)
    assert isinstance(local, LocalSandboxBackend) and local.kill_grace_s == 1.0
    assert make_backend("e2b", template="base").name == "e2b"
    assert make_backend("docker", kill_grace_s=1.0).kill_grace_s == 1.0  # no daemon is asked until a start
    hf = make_backend("hf", flavor="cpu-upgrade")  # no Hub is asked until a start
    assert (hf.name, hf.flavor) == ("hf", "cpu-upgrade")
    with pytest.raises(ValueError, match="unknown sandbox backend 'docker2'; known: docker, e2b, hf, local"):
        make_backend("docker2")


def test_sigterm_closes_every_sandbox_before_the_process_exits(
    make_task: TaskFactory, tmp_path: Path
) -> None:
    task = make_task()
    roots = tmp_path / "roots"
    script = textwrap.dedent(
        f"""
        import asyncio, pathlib
        from harness_trainer.sandboxes.local import LocalSandboxBackend
        from harness_trainer.sandboxes.supervisor import SandboxSupervisor
        from harness_trainer.tasks.task import EnvironmentSpec, HarborTask

        async def main():
            task = HarborTask(name="t", path=pathlib.Path({str(task.path)!r}), instruction="", config={{}},
                              agent_timeout_sec=60, verifier_timeout_sec=60, environment=EnvironmentSpec())
            supervisor = SandboxSupervisor(LocalSandboxBackend({str(roots)!r}))
            supervisor.install_signal_handlers()
            for _ in range(2):
                sandbox = await supervisor.start(task, lifetime_s=60)
                await sandbox.exec("nohup sleep 727272 >/dev/null 2>&1 &")
            print("ready", flush=True)
            await asyncio.sleep(60)

        asyncio.run(main())
        """
    )
    (tmp_path / "owner.py").write_text(script)  # not `-c`: its command line would match the marker
    owner = subprocess.Popen([sys.executable, tmp_path / "owner.py"], stdout=subprocess.PIPE, cwd=Path.cwd())
    try:
        assert owner.stdout is not None and owner.stdout.readline() == b"ready\n"
        assert len(wait_until_present("sleep 727272", count=2)) == 2
        owner.send_signal(signal.SIGTERM)
        assert owner.wait(timeout=20) == -signal.SIGTERM
        assert not live_processes("sleep 727272"), "SIGTERM left sandbox processes running"
        assert not list(roots.glob("ht-*")), "SIGTERM left sandbox roots behind"
    finally:
        owner.kill()
        owner.wait()
        assert owner.stdout is not None
        owner.stdout.close()
