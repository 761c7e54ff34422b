"""Snapshots of docker sandboxes (:class:`~harness_trainer.sandboxes.base.ForkingBackend`): a container
committed to an image that other containers of the same task start from.

Contract of :class:`DockerSnapshots`:

- ``take(sandbox)``: the container committed to ``ht-snapshot:<sandbox id>-<8 hex>`` (the daemon pauses it
  for the commit; it runs on after), labelled like the backend's containers (``LABEL``/``RUN_ID`` of
  :mod:`.docker_daemon`, plus ``SNAPSHOT_LABEL``: the source), so that the snapshots of a process that died
  are removed with its containers (:func:`~.docker_daemon.remove_leftovers`). The image holds the
  container's own files only: the agents' bundles are bind mounts (:mod:`.docker_agents`), not part of it,
  and a container started from it gets the mounts a cold start gets. Its config is the container's, so it
  carries the source's start ``env`` (a group's setup starts with none). A commit whose caller is cancelled
  still completes and is held, so that ``drop_all`` deletes it.
- ``image(snapshot, task)``: the image to start ``task`` from; a :class:`SandboxStartError` for a snapshot
  not held (dropped, or another backend's).
- ``drop(snapshot)``: the image removed (forced: a container of it not yet removed does not keep it);
  idempotent, never raises. ``drop_all`` drops every snapshot still held (the backend's ``aclose``).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import TYPE_CHECKING

from harness_trainer.sandboxes.base import Sandbox, SandboxError, SandboxSnapshot, SandboxStartError
from harness_trainer.sandboxes.docker_daemon import LABEL, RUN_ID, SNAPSHOT_LABEL
from harness_trainer.tasks.task import HarborTask

if TYPE_CHECKING:
    from harness_trainer.sandboxes.docker import DockerSandbox, DockerSandboxBackend

log = logging.getLogger(__name__)

REPOSITORY = "ht-snapshot"


class DockerSnapshots:
    """The snapshots one :class:`~harness_trainer.sandboxes.docker.DockerSandboxBackend` made and holds."""

    def __init__(self, backend: DockerSandboxBackend) -> None:
        self.backend = backend
        self._held: dict[str, SandboxSnapshot] = {}

    @property
    def held(self) -> list[SandboxSnapshot]:
        return list(self._held.values())

    async def take(self, sandbox: Sandbox) -> SandboxSnapshot:
        """``sandbox``'s container committed to an image, held from then on; raises :class:`SandboxError`
        for a sandbox that is not an open one of this backend, or a failed commit."""
        mine = next((live for live in self.backend.live if live is sandbox), None)
        if mine is None:
            raise SandboxError(f"sandbox {sandbox.id} is not an open sandbox of this docker backend")
        made = SandboxSnapshot(f"{REPOSITORY}:{mine.id}-{uuid.uuid4().hex[:8]}", mine.id, mine.task_name)
        # Shielded: a cancelled caller must not leave an image that nothing holds (and so nothing drops).
        commit = asyncio.ensure_future(self._commit(mine, made))
        commit.add_done_callback(lambda done: done.cancelled() or done.exception())  # retrieved
        return await asyncio.shield(commit)

    async def _commit(self, sandbox: DockerSandbox, made: SandboxSnapshot) -> SandboxSnapshot:
        repository, _, tag = made.id.partition(":")
        labels = {LABEL: RUN_ID, SNAPSHOT_LABEL: sandbox.id}
        try:  # the streaming client: a large container's commit may outlast the short calls' read timeout
            await self.backend.call(
                self.backend.stream_api.commit, sandbox.container, repository=repository, tag=tag,
                conf={"Labels": labels}, long=True,
            )  # fmt: skip
        except Exception as exc:
            raise SandboxError(f"sandbox {sandbox.id}: cannot snapshot it: {exc}") from exc
        self._held[made.id] = made
        return made

    def image(self, snapshot: SandboxSnapshot, task: HarborTask) -> str:
        """The image to start ``task`` from; raises :class:`SandboxStartError` for a snapshot not held."""
        if snapshot.id not in self._held:
            raise SandboxStartError(
                f"{task.name}: snapshot {snapshot.id} (of sandbox {snapshot.source}) is not held by this "
                "docker backend: it was dropped, or another backend made it"
            )
        return snapshot.id

    async def drop(self, snapshot: SandboxSnapshot) -> None:
        """Remove ``snapshot``'s image; idempotent, never raises."""
        if self._held.pop(snapshot.id, None) is None:
            return
        try:
            await self.backend.call(self.backend.client.api.remove_image, snapshot.id, force=True)
        except Exception as exc:
            if "No such image" not in str(exc):  # left for remove_leftovers once this process is gone
                log.warning("docker: could not remove snapshot %s: %s", snapshot.id, exc)

    async def drop_all(self) -> None:
        """Drop every snapshot still held."""
        await asyncio.gather(*(self.drop(snapshot) for snapshot in self.held))
