"""The fake E2B cloud's snapshots (:mod:`tests.sandboxes.fake_e2b`): one account's, as the SDK sees them.

``sandbox.create_snapshot(name=None, *, mode=None)`` freezes the sandbox's filesystem as it is now: its own
(upper) overlay layer is copied (``cp -a``: overlayfs whiteouts and opaque directories included) under the
snapshot, whose filesystem is that copy over the sandbox's lower layers, so later writes of the sandbox are
not in it; running processes are not carried (the fake snapshots files only, like ``mode="filesystem"``).
The sandbox keeps running. ``AsyncSandbox.create(<snapshot id>)`` starts a sandbox whose filesystem is an
overlay over the snapshot's (its writes its own) with the snapshot's environment.

Names and ids, as E2B has them: a snapshot is a template build. A name (E2B's template name) that exists
gets a new build; the snapshot id is ``<template id>:<tag>`` and its names ``<project>/<name>:<tag>``.
``list_snapshots(sandbox_id=None, limit=None, next_token=None, name=None)`` filters by the source sandbox
and by one name or id (bare, project-qualified or tag-qualified), as the SDK documents;
``delete_snapshot(snapshot_id)`` deletes the template the id names (the API's ``DELETE /templates/{id}``:
every build of it) and answers True, or False when there is no such template, as the SDK does for a 404. A
create from a deleted snapshot is refused with E2B's 404. A snapshot's files stay until the cloud's folder
is removed: sandboxes started from it keep running after it is deleted, as in E2B.

``failures`` scripts the next ``create_snapshot`` calls (each raises its exception); ``FakeLatency``'s
``snapshot_s`` delays each snapshot (the source is paused meanwhile in E2B) and ``create_from_snapshot_s``
replaces ``create_s`` for a create from a snapshot.
"""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from e2b import SandboxNotFoundException, SnapshotInfo

if TYPE_CHECKING:
    from tests.sandboxes.fake_e2b import FakeAsyncSandbox

PROJECT = "fake-project"


@dataclass
class FakeSnapshot:
    """One snapshot (a build of a snapshot template): the frozen filesystem and environment of ``source``."""

    snapshot_id: str
    template_id: str
    name: str | None
    tag: str
    source: str
    layers: list[Path]
    """Its filesystem: the source's upper layer as it was, over the source's lower layers (topmost first)."""
    env: dict[str, str]

    def info(self) -> SnapshotInfo:
        names = [f"{PROJECT}/{self.name}:{self.tag}"] if self.name else []
        return SnapshotInfo(snapshot_id=self.snapshot_id, names=names)

    def answers_to(self, wanted: str) -> bool:
        """Whether ``list_snapshots(name=wanted)`` lists it: its id, or its name, bare or qualified."""
        names = {self.snapshot_id, self.template_id}
        if self.name:
            names |= {self.name, f"{PROJECT}/{self.name}"}
            names |= {f"{name}:{self.tag}" for name in (self.name, f"{PROJECT}/{self.name}")}
        return wanted in names


class FakeSnapshots:
    """The account's snapshots: ``live`` by id, the ``deleted`` ids, and the recorded class-level calls
    (``list_calls``, ``delete_calls``; ``create_snapshot`` is recorded on its sandbox's ``calls``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.live: dict[str, FakeSnapshot] = {}
        self.deleted: set[str] = set()
        self.failures: list[Exception] = []
        self.list_calls: list[dict[str, Any]] = []
        self.delete_calls: list[dict[str, Any]] = []
        self._templates: dict[str, str] = {}  # name -> template id: a name that exists gets a new build
        self._builds = itertools.count(1)

    async def take(self, sandbox: FakeAsyncSandbox, name: str | None, delay_s: float) -> SnapshotInfo:
        """Freeze ``sandbox``'s files under a new snapshot (see the module docstring)."""
        if self.failures:
            raise self.failures.pop(0)
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        if sandbox.killed:
            raise SandboxNotFoundException(f"Sandbox {sandbox.sandbox_id} not found")  # the SDK's 404
        template_id = self._templates.get(name or "") or f"snap{uuid.uuid4().hex[:12]}"
        if name:
            self._templates[name] = template_id
        tag = f"v{next(self._builds)}"
        frozen = self.root / f"{template_id}-{tag}"
        frozen.mkdir(parents=True)
        copy = ["cp", "-a", f"{sandbox.rootfs.upper}/.", str(frozen)]
        copied = await asyncio.to_thread(subprocess.run, copy, capture_output=True, text=True)
        if copied.returncode != 0:
            raise RuntimeError(f"fake E2B: cannot copy {sandbox.sandbox_id}'s files: {copied.stderr[-2000:]}")
        snapshot = FakeSnapshot(
            snapshot_id=f"{template_id}:{tag}",
            template_id=template_id,
            name=name,
            tag=tag,
            source=sandbox.sandbox_id,
            layers=[frozen, *sandbox.rootfs.layers],
            env=dict(sandbox.envs),
        )
        self.live[snapshot.snapshot_id] = snapshot
        return snapshot.info()

    def find(self, template: str | None) -> FakeSnapshot | None:
        """The live snapshot a create's ``template`` names (its id, or its name for the latest build)."""
        if template in self.live:
            return self.live[template]
        named = [s for s in self.live.values() if s.name and s.answers_to(template or "")]
        return named[-1] if named else None

    def listed(self, sandbox_id: str | None, name: str | None) -> list[SnapshotInfo]:
        return [
            snapshot.info()
            for snapshot in self.live.values()
            if sandbox_id in (None, snapshot.source) and (not name or snapshot.answers_to(name))
        ]

    def delete(self, snapshot_id: str) -> bool:
        """Delete every build of the template ``snapshot_id`` names; False when there is none."""
        template_id = snapshot_id.split(":", 1)[0]
        doomed = [s for s in self.live.values() if template_id in (s.template_id, s.name)]
        for snapshot in doomed:
            del self.live[snapshot.snapshot_id]
            self.deleted.add(snapshot.snapshot_id)
            if snapshot.name:
                self._templates.pop(snapshot.name, None)
        return bool(doomed)
