"""The E2B backend's snapshots: its side of :class:`~.base.ForkingBackend` (one setup per GRPO group).

:meth:`E2BSnapshots.snapshot` calls the sandbox's ``create_snapshot(name=…)``: E2B pauses the sandbox while
it takes the snapshot, then lets it run on. The snapshot is E2B's default kind (memory and filesystem: a
sandbox started from it resumes, which is faster than the cold boot of a filesystem-only one, and which
every E2B team may take); the contract promises files only, and a member may find the source's background
processes still running. Its name carries the run and this backend's owner (:func:`~.e2b_runs.snapshot_name`)
because a snapshot, unlike a sandbox, has no timeout: one that a SIGKILLed server left is deleted by the next
backend of the same run before its first start and by ``harness-trainer e2b cleanup --run ID``
(:func:`~.e2b_runs.kill_run`). :meth:`~E2BSnapshots.start_from` creates a sandbox with the snapshot's id
where a template goes (``AsyncSandbox.create(snapshot_id)``), through the backend's own create path: its
retries (:mod:`.create_retry`), lifetime, env, metadata and live set. :meth:`~E2BSnapshots.drop` deletes it
with ``AsyncSandbox.delete_snapshot``; a snapshot whose caller was cancelled while E2B took it is deleted
once taken, and the backend's ``aclose`` drops every snapshot still held.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from harness_trainer.sandboxes.base import Sandbox, SandboxError, SandboxSnapshot, SandboxStartError
from harness_trainer.sandboxes.e2b_runs import snapshot_name
from harness_trainer.sandboxes.e2b_sdk import sdk
from harness_trainer.tasks.task import HarborTask

if TYPE_CHECKING:
    from harness_trainer.sandboxes.e2b import E2BSandbox

log = logging.getLogger(__name__)


class E2BSnapshots:
    """:class:`~.base.ForkingBackend`'s methods, mixed into :class:`~.e2b.E2BSandboxBackend`, with the SDK
    boundary and the background cleanups that its create path shares; it uses the backend's ``run_id``,
    ``owner``, ``api_key`` and create path (``_launch``)."""

    if TYPE_CHECKING:
        run_id: str | None
        owner: str
        api_key: str | None

        async def _launch(
            self, task: HarborTask, template: str, *, lifetime_s: float, env: dict[str, str] | None
        ) -> E2BSandbox: ...

    def __init__(self, sandbox_class: Any = None) -> None:
        self._sandbox_class = sandbox_class
        self._held: dict[str, SandboxSnapshot] = {}
        self._numbers = itertools.count(1)
        self._unclaimed: set[asyncio.Future[None]] = set()  # cleanups of what cancelled calls left in E2B

    def _sdk_class(self) -> Any:
        """The SDK boundary: ``sandbox_class``, else ``e2b.AsyncSandbox``."""
        return self._sandbox_class or sdk().AsyncSandbox

    def _in_background(self, work: Coroutine[Any, Any, None]) -> asyncio.Future[None]:
        """``work`` run on its own, and awaited by the backend's ``aclose`` (a cleanup a cancelled caller
        left: the sandbox its create made, the snapshot E2B took)."""
        task = asyncio.ensure_future(work)
        self._unclaimed.add(task)
        task.add_done_callback(self._unclaimed.discard)
        return task

    @property
    def snapshots(self) -> list[SandboxSnapshot]:
        """The snapshots it made that are not dropped yet."""
        return list(self._held.values())

    async def snapshot(self, sandbox: Sandbox) -> SandboxSnapshot:
        """An E2B snapshot of ``sandbox`` (one this backend started), named for the run; the sandbox runs on.
        Raises :class:`SandboxError` with E2B's answer when E2B refuses or fails it."""
        from harness_trainer.sandboxes.e2b import E2BSandbox  # the backend's module imports this one

        if not isinstance(sandbox, E2BSandbox) or sandbox.closed:
            raise SandboxError(f"cannot snapshot {sandbox.id}: not an open sandbox of the e2b backend")
        name = snapshot_name(self.run_id, self.owner, next(self._numbers))
        taking = asyncio.ensure_future(sandbox.sdk_sandbox.create_snapshot(name=name))
        try:
            # Shielded, as a create is: E2B takes a snapshot whose caller stopped waiting all the same.
            info = await asyncio.shield(taking)
        except asyncio.CancelledError:
            self._in_background(self._delete_when_taken(taking))
            raise
        except Exception as exc:  # the SDK's API errors, and transport errors, which it lets through
            raise SandboxError(
                f"E2B could not snapshot sandbox {sandbox.id} (as {name}): {type(exc).__name__}: {exc}"
            ) from exc
        snapshot = SandboxSnapshot(id=info.snapshot_id, source=sandbox.id, task_name=sandbox.task_name)
        self._held[snapshot.id] = snapshot
        return snapshot

    async def start_from(
        self,
        snapshot: SandboxSnapshot,
        task: HarborTask,
        *,
        lifetime_s: float,
        env: dict[str, str] | None = None,
    ) -> E2BSandbox:
        """A sandbox created from ``snapshot`` as ``start`` creates one from a template (tries, lifetime,
        env, run metadata); raises :class:`SandboxStartError`, at once for a snapshot this backend does not
        hold (dropped, or not its own)."""
        if self._held.get(snapshot.id) != snapshot:
            raise SandboxStartError(
                f"{task.name}: E2B snapshot {snapshot.id} is not this backend's to start from (dropped, or "
                "never taken by it)"
            )
        return await self._launch(task, snapshot.id, lifetime_s=lifetime_s, env=env)

    async def drop(self, snapshot: SandboxSnapshot) -> None:
        """Delete ``snapshot`` in E2B; idempotent, never raises (a failed delete is logged: the run's next
        backend or its cleanup deletes it). The delete runs to its end even if the caller is cancelled."""
        if self._held.pop(snapshot.id, None) is None:
            return
        await asyncio.shield(self._in_background(self._delete(snapshot.id)))

    async def drop_all(self) -> None:
        """Drop every snapshot still held (the backend's ``aclose``)."""
        await asyncio.gather(*(self.drop(snapshot) for snapshot in self.snapshots))

    async def _delete(self, snapshot_id: str) -> None:
        options = {"api_key": self.api_key} if self.api_key else {}
        try:
            await self._sdk_class().delete_snapshot(snapshot_id, **options)  # False: already gone
        except Exception as exc:  # drop never raises; the snapshot's name lets the run's reaping find it
            log.warning(
                "E2B snapshot %s: delete failed (the run's next server or `harness-trainer e2b cleanup "
                "--run ID` deletes it): %s",
                snapshot_id,
                exc,
            )

    async def _delete_when_taken(self, taking: asyncio.Future[Any]) -> None:
        """Once a snapshot whose caller was cancelled is taken, delete it, if it was taken."""
        try:
            info = await taking
        except Exception:
            return  # it took nothing
        await self._delete(info.snapshot_id)
