"""E2B sandboxes and snapshots labelled with their run, so that a run's orphans can be found and removed.

Every sandbox the E2B backend creates carries E2B metadata: :data:`RUN_KEY` (the run id, ``serve
--run-id``), :data:`OWNER_KEY` (one id per backend object, i.e. per server process) and the task's name.
E2B reaps a sandbox only at its timeout (the agent and verifier timeouts plus a margin: up to hours), so a
server that was SIGKILLed leaves its sandboxes running and billed until then. A snapshot (one GRPO group's
prepared sandbox, :mod:`.e2b_snapshots`) has no timeout at all: it is kept, and stored, until deleted.
Snapshots carry no metadata, so their name says the same: :func:`snapshot_name`, ``ht-snap-<run>-<owner>-<n>``
(``<run>`` is the run id itself when it is a valid E2B name, else a slug of it and a digest of the exact id:
:func:`run_tag`). Two ways to end them:

- the next backend of the same run kills, before its first start, every sandbox of the run that another
  owner made and deletes every such snapshot (:func:`kill_run` with ``keep_owner``): restart ``serve``
  with the same ``--run-id``. One server per run id: two live servers sharing one would kill each other's
  sandboxes;
- ``harness-trainer e2b cleanup --run ID`` removes them all by hand.

Both list with the SDK's ``AsyncSandbox.list(query=SandboxQuery(metadata=...))`` and kill by id with
``AsyncSandbox.kill(sandbox_id)``, and list every snapshot of the account with
``AsyncSandbox.list_snapshots()`` (its ``name`` filter matches one name exactly, not a run's prefix) and
delete by id with ``AsyncSandbox.delete_snapshot(snapshot_id)``; the SDK boundary is the same
``sandbox_class`` as the backend's.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import uuid
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

RUN_KEY = "harness_trainer_run"
OWNER_KEY = "harness_trainer_owner"
TASK_KEY = "harness_trainer_task"
SNAPSHOT_PREFIX = "ht-snap-"
_NAME = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")  # what every E2B template (snapshot) name may be
_MAX_RUN_TAG = 40  # E2B's names are short; the owner and the counter follow


def new_owner() -> str:
    """A fresh owner id: one per backend object."""
    return uuid.uuid4().hex[:16]


def sandbox_metadata(task_name: str, run_id: str | None, owner: str) -> dict[str, str]:
    """The metadata a sandbox is created with (no run key without a run id)."""
    metadata = {TASK_KEY: task_name, OWNER_KEY: owner}
    if run_id:
        metadata[RUN_KEY] = run_id
    return metadata


def run_tag(run_id: str) -> str:
    """``run_id`` as a piece of a snapshot name: itself when it is a valid, short E2B name, else a slug of it
    and a digest of the exact id (so two run ids with one slug never share a tag)."""
    if _NAME.fullmatch(run_id) and len(run_id) <= _MAX_RUN_TAG:
        return run_id
    slug = re.sub(r"[^a-z0-9]+", "-", run_id.lower())[: _MAX_RUN_TAG - 9].strip("-")
    digest = hashlib.sha256(run_id.encode()).hexdigest()[:8]
    return f"{slug}-{digest}" if slug else digest


def snapshot_name(run_id: str | None, owner: str, number: int) -> str:
    """The name of ``owner``'s ``number``-th snapshot: ``ht-snap-<run>-<owner>-<number>`` (no ``<run>-``
    without a run id: such a snapshot belongs to no run, and only its backend's ``aclose`` deletes it)."""
    run = f"{run_tag(run_id)}-" if run_id else ""
    return f"{SNAPSHOT_PREFIX}{run}{owner}-{number}"


def snapshot_owner(name: str, run_id: str) -> str | None:
    """The owner of the snapshot that E2B lists under ``name`` (``[project/]name[:tag]``) when
    :func:`snapshot_name` named it for ``run_id``; None when it is no snapshot of that run."""
    bare = name.rsplit("/", 1)[-1].split(":", 1)[0]
    head, _, number = bare.rpartition("-")
    run, _, owner = head.rpartition("-")
    return owner if run == SNAPSHOT_PREFIX + run_tag(run_id) and number.isdigit() and owner else None


async def run_sandboxes(sandbox_class: Any, run_id: str, *, api_key: str | None = None) -> list[Any]:
    """Every running or paused sandbox labelled with ``run_id`` (the SDK's ``SandboxInfo`` objects)."""
    from e2b import SandboxQuery

    options = {"api_key": api_key} if api_key else {}
    paginator = sandbox_class.list(query=SandboxQuery(metadata={RUN_KEY: run_id}), **options)
    found: list[Any] = []
    while paginator.has_next:
        found.extend(await paginator.next_items())
    return found


async def run_snapshots(sandbox_class: Any, run_id: str, *, api_key: str | None = None) -> dict[str, str]:
    """Every snapshot named for ``run_id`` (:func:`snapshot_name`): its owner, by snapshot id."""
    options = {"api_key": api_key} if api_key else {}
    paginator = sandbox_class.list_snapshots(**options)
    found: dict[str, str] = {}
    while paginator.has_next:
        for info in await paginator.next_items():
            owners = {snapshot_owner(name, run_id) for name in [info.snapshot_id, *info.names]} - {None}
            if owners:
                found[info.snapshot_id] = owners.pop()
    return found


@dataclass(frozen=True)
class Removed:
    """What :func:`kill_run` removed: the ids of the sandboxes it killed and of the snapshots it deleted."""

    sandboxes: list[str]
    snapshots: list[str]

    def __bool__(self) -> bool:
        return bool(self.sandboxes or self.snapshots)

    def describe(self) -> str:
        """``2 sandboxes (a, b) and 1 snapshot (c)``."""

        def part(ids: list[str], one: str, many: str) -> str:
            listed = f" ({', '.join(ids)})" if ids else ""
            return f"{len(ids)} {one if len(ids) == 1 else many}{listed}"

        sandboxes = part(self.sandboxes, "sandbox", "sandboxes")
        return f"{sandboxes} and {part(self.snapshots, 'snapshot', 'snapshots')}"


async def kill_run(
    sandbox_class: Any, run_id: str, *, keep_owner: str | None = None, api_key: str | None = None
) -> Removed:
    """Kill the sandboxes of ``run_id`` and delete its snapshots (except ``keep_owner``'s). Both are listed
    before anything is removed (a failed listing raises); a kill or delete that fails is logged (E2B reaps a
    sandbox at its timeout; a snapshot waits for the next cleanup)."""
    infos, snapshots = await asyncio.gather(
        run_sandboxes(sandbox_class, run_id, api_key=api_key),
        run_snapshots(sandbox_class, run_id, api_key=api_key),
    )
    mine = [
        info.sandbox_id for info in infos if keep_owner and (info.metadata or {}).get(OWNER_KEY) == keep_owner
    ]
    doomed = [info.sandbox_id for info in infos if info.sandbox_id not in mine]
    options = {"api_key": api_key} if api_key else {}
    results = await asyncio.gather(
        *(sandbox_class.kill(sandbox_id, **options) for sandbox_id in doomed), return_exceptions=True
    )
    killed = []
    for sandbox_id, result in zip(doomed, results, strict=True):
        if isinstance(result, BaseException):
            log.warning("E2B sandbox %s of run %s: kill failed (E2B reaps it at its timeout): %s",
                        sandbox_id, run_id, result)  # fmt: skip
        else:
            killed.append(sandbox_id)
    doomed = [
        snapshot_id for snapshot_id, owner in snapshots.items() if not keep_owner or owner != keep_owner
    ]
    results = await asyncio.gather(
        *(sandbox_class.delete_snapshot(snapshot_id, **options) for snapshot_id in doomed),
        return_exceptions=True,
    )
    deleted = []
    for snapshot_id, result in zip(doomed, results, strict=True):
        if isinstance(result, BaseException):
            log.warning("E2B snapshot %s of run %s: delete failed (the run's next cleanup retries): %s",
                        snapshot_id, run_id, result)  # fmt: skip
        else:  # True, or False when it went meanwhile: gone either way
            deleted.append(snapshot_id)
    return Removed(killed, deleted)
