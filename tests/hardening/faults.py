"""Shared pieces of the fault-injection scenarios: small real training runs with one fault injected.

- process bookkeeping for leak checks (:func:`descendants`, :func:`alive`, :func:`wait_until`);
- :func:`training_config` / :func:`local_builder`: a 1–3 step run of the toy agent on ``hello-file``;
- :class:`FlakyStartBackend`: a local sandbox backend whose starts fail with a seeded probability
  (:func:`drawn_failures`: which ones);
- :class:`FaultyUpstream`: an aiohttp pass-through between the capture proxy and the engine that answers
  5xx, drops the connection or rewrites the engine's reply (:func:`out_of_vocabulary`) for the next N
  chat calls;
- :class:`ProxyProcess`: the capture proxy as its own process, to SIGKILL and restart on the same data dir.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from copy import deepcopy
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
from aiohttp import ClientSession, ClientTimeout, web

from harness_trainer import AsyncGRPOConfig, LocalSessionFactory
from harness_trainer.sandboxes.base import SandboxStartError
from harness_trainer.sandboxes.local import LocalSandbox, LocalSandboxBackend
from harness_trainer.tasks.task import HarborTask
from tests.rollouts.conftest import EXAMPLES, bash_call

ROOT = Path(__file__).resolve().parents[2]
SOLVE_CMD = "printf 'Hello, Harbor!\\n' > /app/hello.txt"
SOLVE = [bash_call(SOLVE_CMD), {"content": "Done."}]
GIVE_UP = [{"content": "I cannot do this."}]
INJECTED = "injected fault"


# -- processes -------------------------------------------------------------------------------------------


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (children, their children…), from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pids: set[int]) -> set[int]:
    """The ``pids`` still running (zombies count as gone: they hold nothing but a table entry)."""
    running = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            running.add(pid)
    return running


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def new_processes(before: set[int], timeout: float = 15.0) -> set[int]:
    """Descendants of this test process that were not there in ``before`` and are still running after
    ``timeout`` (polled: closing takes a moment). Should be empty after a run."""
    leaked: set[int] = set()

    def settled() -> bool:
        leaked.clear()
        leaked.update(alive(descendants(os.getpid()) - before))
        return not leaked

    wait_until(settled, timeout, interval=0.2)
    return leaked


def describe(pids: set[int]) -> list[str]:
    described = []
    for pid in sorted(pids):
        try:
            described.append(f"{pid} {Path(f'/proc/{pid}/cmdline').read_bytes().replace(bytes(1), b' ')!r}")
        except OSError:
            described.append(str(pid))
    return described


# -- a small training run -----------------------------------------------------------------------------------


def hello_rows() -> list[dict[str, Any]]:
    """The dataset: the ``hello-file`` toy task only, so every group rolls the same task out."""
    from harness_trainer.tasks.sources import LocalTaskSource

    return [r for r in LocalTaskSource(EXAMPLES).prompt_rows("train") if r["task_name"] == "hello-file"]


def training_config(out: Path, engine_url: str, **overrides: Any) -> AsyncGRPOConfig:
    """A tiny run: groups of 2, one rollout at a time (scripted replies then go out in a fixed order)."""
    settings: dict[str, Any] = dict(
        output_dir=str(out), engine="dev", vllm_server_base_url=engine_url, num_generations=2,
        max_concurrent_rollouts=1, max_staleness=0, max_steps=2, learning_rate=1e-4, disable_tqdm=True,
        rollout_timeout=120, token_budget=4096, seed=7,
        # Faults, not filtering, are tested: a group whose scripted members all pass (or all fail) trains.
        drop_zero_variance_groups=False,
    )  # fmt: skip
    settings.update(overrides)
    return AsyncGRPOConfig(**settings)


def local_builder(upstream: str, **options: Any) -> Callable[..., LocalSessionFactory]:
    """The in-process session factory on the example tasks with the toy agent, as a trainer builder."""
    return partial(
        LocalSessionFactory, str(EXAMPLES), upstream=upstream, split="train", harness="toy", **options
    )


class RecordingFactory(LocalSessionFactory):
    """The in-process factory, keeping every session it made so a test can read their results after."""

    def __init__(self, *args: Any, made: list[Any], **options: Any) -> None:
        super().__init__(*args, **options)
        self.made = made

    def create(
        self, task: Any, seed: int | None = None, episode_id: str | None = None, *, harness: str | None = None
    ) -> Any:
        session = super().create(task, seed=seed, episode_id=episode_id, harness=harness)
        self.made.append(session)
        return session


def recording_builder(upstream: str, made: list[Any], **options: Any) -> Callable[..., RecordingFactory]:
    return partial(
        RecordingFactory, str(EXAMPLES), upstream=upstream, split="train", harness="toy", made=made, **options
    )


def metrics_lines(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def leftover_sandbox_roots(base_dir: Path) -> list[str]:
    """Sandbox roots (``ht-*``) still on disk under ``base_dir``."""
    return sorted(p.name for p in base_dir.glob("ht-*")) if base_dir.exists() else []


def leftover_capture_sessions(data_dir: Path) -> list[str]:
    """Capture session journals still on disk (a deleted session's directory is removed)."""
    root = data_dir / "sessions"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def assert_trained_around_group_1(trainer: Any, out: Path) -> list[Any]:
    """The run trained its 2 steps on groups 0 and 2 (reward 0.5 each) while both members of group 1 were
    unscorable, counted and logged without a trace or reward; returns those two rollout log records."""
    from harness_trainer.trainer.feed.rollout_log import read_rollout_log

    lines = metrics_lines(out)
    assert [line["step"] for line in lines] == [1, 2]
    assert trainer.trained_groups == [0, 2]
    assert [line["reward"] for line in lines] == [0.5, 0.5]
    assert lines[-1]["rollout/unscorable_total"] == 2 and lines[-1]["rollout/dropped_groups_total"] == 1
    failed = [r for r in read_rollout_log(out) if r.step is not None and r.unscorable is not None]
    assert [(r.group, r.member) for r in failed] == [(1, 0), (1, 1)]
    assert all(r.trace is None and r.reward is None for r in failed)
    return failed


# -- sandbox starts that fail ------------------------------------------------------------------------------


@dataclass
class StartLedger:
    """What :class:`FlakyStartBackend` did, shared with the test (the runtime builds the backend itself)."""

    starts: int = 0
    failures: int = 0
    started: list[LocalSandbox] = field(default_factory=list)


def drawn_failures(starts: int, failure_rate: float, seed: int) -> list[int]:
    """The starts (numbered from 1) among the first ``starts`` that fail under ``failure_rate`` and ``seed``:
    the draws :class:`FlakyStartBackend` makes, one per start in start order."""
    draws = random.Random(seed)
    return [start for start in range(1, starts + 1) if draws.random() < failure_rate]


class FlakyStartBackend(LocalSandboxBackend):
    """The local backend, except that each start fails (``SandboxStartError``) with probability
    ``failure_rate``, drawn from ``random.Random(seed)`` in start order. It does not fork: every member
    starts cold, so each rollout's start is one draw (one setup per group is tested on its own:
    tests/rollouts/test_group_setup.py)."""

    name = "flaky"
    capabilities = dataclasses.replace(LocalSandboxBackend.capabilities, forks=False)

    def __init__(self, *, failure_rate: float, seed: int, ledger: StartLedger, **local: Any) -> None:
        super().__init__(**local)
        self.failure_rate = failure_rate
        self.ledger = ledger
        self._draws = random.Random(seed)

    async def start(
        self, task: HarborTask, *, lifetime_s: float, env: dict[str, str] | None = None
    ) -> LocalSandbox:
        self.ledger.starts += 1
        if self._draws.random() < self.failure_rate:
            self.ledger.failures += 1
            raise SandboxStartError(f"{INJECTED}: sandbox start {self.ledger.starts} refused")
        sandbox = await super().start(task, lifetime_s=lifetime_s, env=env)
        self.ledger.started.append(sandbox)
        return sandbox


# -- an engine that fails for a while --------------------------------------------------------------------


class FaultyUpstream:
    """A pass-through to ``target`` (the engine) on its own thread and event loop.

    Every request is forwarded unchanged, except chat completions while faults are queued
    (:meth:`fail_next`): each such call takes the next fault, ``"5xx"`` (a 503 answer) or ``"drop"`` (the
    connection is closed with no answer), and never reaches the engine; or a :data:`Rewrite`, and the
    engine's JSON reply is passed through it on the way back (``injected`` then holds its name).
    """

    def __init__(self, target: str) -> None:
        from harness_trainer.net import free_port

        self.target = target.rstrip("/")
        self.port = free_port()
        self.faults: list[str | Rewrite] = []
        self.injected: list[str] = []
        self.rewritten: list[dict[str, Any]] = []  # each rewritten reply, as the proxy got it
        self.forwarded_chats = 0
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="faulty-upstream", daemon=True)
        self._runner: web.AppRunner | None = None
        self._client: ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def fail_next(self, *faults: str | Rewrite) -> None:
        with self._lock:
            self.faults.extend(faults)

    def start(self) -> FaultyUpstream:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self

    async def _start(self) -> None:
        self._client = ClientSession(timeout=ClientTimeout(total=300))
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.path.endswith("/chat/completions"):
            with self._lock:
                fault = self.faults.pop(0) if self.faults else None
                if fault is not None:
                    self.injected.append(fault if isinstance(fault, str) else fault.__name__)
                else:
                    self.forwarded_chats += 1
            if fault == "5xx":
                error = {"error": {"message": f"{INJECTED}: engine overloaded", "code": 503}}
                return web.json_response(error, status=503)
            if fault == "drop":
                assert request.transport is not None
                request.transport.abort()  # no status line, no body: the caller sees a dropped connection
                return web.Response(status=204)  # never written: the transport is gone
        assert self._client is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "authorization")}
        async with self._client.request(
            request.method, self.target + request.path_qs, data=body, headers=headers
        ) as upstream:
            payload = await upstream.read()
            if callable(fault) and upstream.status == 200:
                reply = fault(json.loads(payload))
                self.rewritten.append(reply)
                payload = json.dumps(reply).encode()
            return web.Response(
                body=payload, status=upstream.status, content_type=upstream.content_type or None
            )

    def stop(self) -> None:
        async def _stop() -> None:
            if self._runner is not None:
                await self._runner.cleanup()
            if self._client is not None:
                await self._client.close()

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(_stop(), self._loop).result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop.close()


Rewrite = Callable[[dict[str, Any]], dict[str, Any]]
"""A change to an engine reply (a Chat Completions body with vLLM's ids and logprobs)."""


def out_of_vocabulary(vocab_size: int, position: int = 0) -> Rewrite:
    """A rewrite making the sampled id at ``position`` ``vocab_size + 5``, in ``choices[0].token_ids`` and in
    the matching ``logprobs.content[position].token`` (``"token_id:N"``): ids and logprobs still pair up,
    so the capture proxy records the call as trainable, but no model of that vocabulary sampled it."""
    bad = vocab_size + 5

    def out_of_vocabulary(reply: dict[str, Any]) -> dict[str, Any]:
        reply = deepcopy(reply)
        choice = reply["choices"][0]
        choice["token_ids"][position] = bad
        choice["logprobs"]["content"][position]["token"] = f"token_id:{bad}"
        return reply

    return out_of_vocabulary


# -- the capture proxy as its own process --------------------------------------------------------------


class ProxyProcess:
    """``python -m capture_proxy`` on a fixed port and data dir, to SIGKILL and restart in place."""

    def __init__(self, upstream: str, data_dir: Path, port: int, admin_key: str, log: Path) -> None:
        self.upstream, self.data_dir, self.port, self.admin_key, self.log = (
            upstream,
            data_dir,
            port,
            admin_key,
            log,
        )
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> None:
        self.starts += 1
        argv = [
            sys.executable, "-m", "capture_proxy", "--upstream", self.upstream, "--port", str(self.port),
            "--data-dir", str(self.data_dir), "--admin-key", self.admin_key, "--upstream-attempts", "2",
        ]  # fmt: skip
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        if not wait_until(self.ready, timeout, interval=0.1):
            self.stop()
            raise RuntimeError(f"the capture proxy did not come up:\n{self.log.read_text()[-3000:]}")

    def ready(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise RuntimeError(f"the capture proxy exited:\n{self.log.read_text()[-3000:]}")
        return self.open_sessions() is not None

    def open_sessions(self) -> list[dict[str, Any]] | None:
        """The proxy's open sessions, or None when it does not answer."""
        try:
            response = httpx.get(
                self.url + "/sessions", headers={"Authorization": f"Bearer {self.admin_key}"}, timeout=5
            )
        except httpx.HTTPError:
            return None
        return response.json()["sessions"] if response.status_code == 200 else None

    def kill(self) -> None:
        """SIGKILL: no shutdown path runs, whatever was not fsync'd is lost."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)


def journal_lines(data_dir: Path) -> int:
    """Complete journal lines (calls) across every session under ``data_dir``, right now."""
    total = 0
    for journal in (data_dir / "sessions").glob("*/calls.jsonl"):
        try:
            total += journal.read_bytes().count(b"\n")
        except OSError:
            continue  # deleted meanwhile
    return total


def answered_steps(log: str) -> int:
    """How many model answers the toy agent received, from its own JSON lines: one ``step`` per answer
    (a tool line or a final line); an ``error`` line is a call that got no answer."""
    steps = set()
    for line in log.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if (
            isinstance(record, dict)
            and "step" in record
            and "error" not in record
            and not record.get("step_limit")
        ):
            steps.add(record["step"])
    return len(steps)


@dataclass
class ServeProcess:
    """``harness-trainer serve`` against an external capture proxy (``--capture-url``)."""

    argv: list[str]
    log: Path
    url: str
    process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 90.0) -> None:
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                self.argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

        def up() -> bool:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"serve exited:\n{self.log.read_text()[-3000:]}")
            try:
                return httpx.get(self.url + "/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        if not wait_until(up, timeout, interval=0.2):
            self.stop()
            raise RuntimeError(f"serve did not come up:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(30)


def iter_json_lines(path: Path) -> Iterator[dict[str, Any]]:
    for line in path.read_text().splitlines():
        if line.strip():
            yield json.loads(line)
