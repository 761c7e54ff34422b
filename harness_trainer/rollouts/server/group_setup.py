"""One setup per GRPO group: a group's members start from one prepared sandbox's snapshot (issue 42).

The G members of a GRPO group run the same task with the same harness. On a backend that can snapshot
(``capabilities.forks``: :class:`~harness_trainer.sandboxes.base.ForkingBackend`), preparing the environment
(the backend's start: on the local backend the Dockerfile's ``RUN`` steps, on every backend the agent's
install) once for the group and starting each member from a snapshot of it saves G - 1 setups. Contract of
:class:`GroupSetups`:

1. Only a rollout whose episode id names a trainer's group (``group{G}-member{M}``) on a forking backend
   takes part, keyed by the group, the task, the harness (and its options) and the backend; every other
   rollout starts cold, exactly as before.
2. The group's first member to arrive starts the setup, a task of its own (a member that is cancelled
   does not cancel it for the others): a sandbox from ``start``, the harness installed in it, ``snapshot``,
   the sandbox closed. Members wait for it, then each starts its own sandbox with ``start_from`` and skips
   the install: their files are the snapshot's, their writes their own.
3. A setup that fails (start, install or snapshot) makes every member of that group start cold, its reason
   logged once and kept on each member's start (:attr:`Start.note`); a member whose own ``start_from``
   fails starts cold too, with that reason. Members already started from the snapshot go on: they are
   independent of each other.
4. The snapshot is dropped once no sandbox started from it is open and no member came for ``linger_s``
   (a group's members normally arrive together; a late one within the linger still uses it); :meth:`aclose`
   drops every one left. A snapshot's name or label carries the run (the backend's rule), so one that a
   killed server left behind is found by the next start or the backend's cleanup.
5. Sandbox-seconds: the setup sandbox's time is counted on the meter of the member that started the setup,
   so a step's ``sandbox/seconds_per_rollout`` still shows what the run costs.
6. Only where it pays: a member never starts sooner from a snapshot (it waits for the setup), so what one
   setup saves is work, G - 1 setups, against what it adds, a snapshot and G starts from it. Each is timed
   per task, harness and backend (:class:`Costs`); once a group of that kind has shown that its setup is
   cheaper than that (``(G - 1) * setup <= snapshot + starts``: a task with nothing to set up, as the toy
   tasks on the local sandbox), its later groups start cold, with that note. A snapshot that paid keeps
   being used.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, cast

from harness_trainer.harnesses.base import Harness
from harness_trainer.rollouts.client.servers import group_of
from harness_trainer.rollouts.result import RolloutOptions
from harness_trainer.rollouts.server.sandbox_meter import SandboxMeter
from harness_trainer.sandboxes.base import (
    ForkingBackend,
    Sandbox,
    SandboxBackend,
    SandboxSnapshot,
)
from harness_trainer.tasks.task import HarborTask

log = logging.getLogger(__name__)

SETUP_LIFETIME_S = 1800.0
"""The setup sandbox's lifetime: it lives only to be installed into and snapshotted."""


@dataclass
class Start:
    """A member's sandbox and how it was made: ``snapshot`` is the snapshot's id when it started from one
    (its agent then already installed), ``note`` why it started cold when it could have forked."""

    sandbox: Sandbox
    snapshot: str | None = None
    note: str | None = None
    setup_seconds: float = 0.0
    """How long the member waited for its group's setup (0 for a cold start that waited for none)."""

    @property
    def installed(self) -> bool:
        return self.snapshot is not None


@dataclass
class _Setup:
    backend: ForkingBackend
    done: asyncio.Future[SandboxSnapshot | str]  # the snapshot, or why there is none
    open: int = 0
    linger: asyncio.TimerHandle | None = None


@dataclass
class Costs:
    """What one setup per group cost and saved, last measured, for one kind of group (rule 6)."""

    setup_s: float = 0.0
    """The setup sandbox's start and install: what each member would pay cold."""
    snapshot_s: float = 0.0
    starts_s: list[float] = field(default_factory=list)
    """Each member's start from the last snapshot."""

    def pays(self) -> bool | None:
        """Whether the last group saved more than it added; None until two members started from it."""
        if len(self.starts_s) < 2:
            return None
        return (len(self.starts_s) - 1) * self.setup_s > self.snapshot_s + sum(self.starts_s)

    def describe(self) -> str:
        return (
            f"one setup per group does not pay for this task (setup {self.setup_s:.2f} s; a snapshot "
            f"{self.snapshot_s:.2f} s and {len(self.starts_s)} starts from it {sum(self.starts_s):.2f} s)"
        )


def group_key(task: HarborTask, options: RolloutOptions) -> tuple[str, ...] | None:
    """What makes members share a setup, or None when the rollout is no trainer group's member."""
    group = group_of(options.episode_id)
    if group is None:
        return None
    harness_options = json.dumps(options.harness_options, sort_keys=True, default=str)
    return (group, task.name, options.harness, harness_options, options.sandbox)


class GroupSetups:
    """The setups of the groups in flight on one rollout runtime; see the module docstring."""

    def __init__(self, *, linger_s: float = 60.0) -> None:
        self.linger_s = linger_s
        self._setups: dict[tuple[str, ...], _Setup] = {}
        self._members: dict[int, tuple[tuple[str, ...], _Setup]] = {}  # id(sandbox) -> its group's setup
        self._tasks: set[asyncio.Task[Any]] = set()
        self.costs: dict[tuple[str, ...], Costs] = {}
        """By kind of group (the key without the group): rule 6's measurements."""

    async def start(
        self,
        backend: SandboxBackend,
        task: HarborTask,
        options: RolloutOptions,
        harness: Harness,
        meter: SandboxMeter,
        *,
        lifetime_s: float,
    ) -> Start:
        """A member's sandbox: from its group's snapshot when it can (rule 2), else cold and installed
        (rule 3). Raises what a cold start or install raises."""
        key = group_key(task, options)
        if key is None or not backend.capabilities.forks:
            return await _cold(backend, task, meter, lifetime_s)
        forking = cast(ForkingBackend, backend)
        setup = self._setups.get(key)
        costs = self.costs.get(key[1:])
        if setup is None and costs is not None and costs.pays() is False:  # rule 6
            cold = await _cold(backend, task, meter, lifetime_s)
            cold.note = costs.describe()
            return cold
        if setup is None:
            setup = self._setups[key] = _Setup(forking, asyncio.get_running_loop().create_future())
            self._own(self._set_up(setup, task, harness, meter, key[1:]))
        if setup.linger is not None:
            setup.linger.cancel()
            setup.linger = None
        setup.open += 1  # held while this member waits and runs: the snapshot is not dropped under it
        started = time.monotonic()
        try:
            made = await asyncio.shield(setup.done)
            waited = round(time.monotonic() - started, 4)
            if isinstance(made, str):
                cold = await _cold(backend, task, meter, lifetime_s)
                cold.note, cold.setup_seconds = made, waited
                return cold
            try:
                began = time.monotonic()
                sandbox = await meter.start_from(forking, made, task, lifetime_s=lifetime_s)
                self.costs[key[1:]].starts_s.append(time.monotonic() - began)
            except Exception as exc:  # rule 3: this member starts cold
                reason = f"starting from snapshot {made.id} failed: {type(exc).__name__}: {exc}"
                log.warning("%s: %s; this member starts cold", task.name, reason)
                cold = await _cold(backend, task, meter, lifetime_s)
                cold.note, cold.setup_seconds = reason, waited
                return cold
            self._members[id(sandbox)] = (key, setup)
            setup.open += 1  # the sandbox's own hold, released by :meth:`closed`
            return Start(sandbox, snapshot=made.id, setup_seconds=waited)
        finally:
            self._release(key, setup)

    def closed(self, sandbox: Sandbox) -> None:
        """A member's sandbox was closed: its hold on its snapshot is released (rule 4)."""
        if (held := self._members.pop(id(sandbox), None)) is not None:
            self._release(*held)

    async def aclose(self) -> None:
        """Cancel setups in flight and drop every snapshot still held (rule 4)."""
        for setup in self._setups.values():
            if setup.linger is not None:
                setup.linger.cancel()
        for running in list(self._tasks):
            running.cancel()
        if self._tasks:
            await asyncio.wait(set(self._tasks))
        setups, self._setups = list(self._setups.values()), {}
        self._members.clear()
        for setup in setups:
            await _drop(setup)

    def _release(self, key: tuple[str, ...], setup: _Setup) -> None:
        setup.open -= 1
        if setup.open > 0 or self._setups.get(key) is not setup:
            return
        loop = asyncio.get_running_loop()
        setup.linger = loop.call_later(self.linger_s, self._expire, key, setup)

    def _expire(self, key: tuple[str, ...], setup: _Setup) -> None:
        if setup.open > 0 or self._setups.get(key) is not setup:
            return
        del self._setups[key]
        self._own(_drop(setup))

    async def _set_up(
        self, setup: _Setup, task: HarborTask, harness: Harness, meter: SandboxMeter, kind: tuple[str, ...]
    ) -> None:
        sandbox: Sandbox | None = None
        try:
            began = time.monotonic()
            sandbox = await meter.start(setup.backend, task, lifetime_s=SETUP_LIFETIME_S)
            await harness.install(sandbox)
            installed = time.monotonic()
            snapshot = await setup.backend.snapshot(sandbox)
            self.costs[kind] = Costs(installed - began, time.monotonic() - installed)
        except asyncio.CancelledError:
            if not setup.done.done():
                setup.done.set_result("the server is shutting down")
            raise
        except Exception as exc:  # rule 3: the whole group starts cold
            reason = f"the group's setup failed: {type(exc).__name__}: {exc}"
            log.warning("%s: %s; its members start cold", task.name, reason)
            setup.done.set_result(reason)
        else:
            setup.done.set_result(snapshot)
        finally:
            if sandbox is not None:
                with contextlib.suppress(Exception):
                    await meter.close(sandbox)

    def _own(self, work: Any) -> None:
        running = asyncio.ensure_future(work)
        self._tasks.add(running)
        running.add_done_callback(self._tasks.discard)


async def _cold(backend: SandboxBackend, task: HarborTask, meter: SandboxMeter, lifetime_s: float) -> Start:
    """A sandbox started as without this module (the caller installs the agent: :attr:`Start.installed`)."""
    sandbox = await meter.start(backend, task, lifetime_s=lifetime_s)
    return Start(sandbox)


async def _drop(setup: _Setup) -> None:
    if not setup.done.done():
        return
    made = setup.done.result()
    if isinstance(made, SandboxSnapshot):
        await setup.backend.drop(made)
