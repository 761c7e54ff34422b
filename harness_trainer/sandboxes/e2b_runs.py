"""E2B sandboxes labelled with their run, so that a run's orphans can be found and killed.

Every sandbox the E2B backend creates carries E2B metadata: :data:`RUN_KEY` (the run id, ``serve
--run-id``), :data:`OWNER_KEY` (one id per backend object, i.e. per server process) and the task's name.
E2B reaps a sandbox only at its timeout (the agent and verifier timeouts plus a margin: up to hours), so a
server that was SIGKILLed leaves its sandboxes running and billed until then. Two ways to end them:

- the next backend of the same run kills, before its first start, every sandbox of the run that another
  owner made (:func:`kill_run` with ``keep_owner``): restart ``serve`` with the same ``--run-id``. One
  server per run id: two live servers sharing one would kill each other's sandboxes;
- ``harness-trainer e2b cleanup --run ID`` kills them all by hand.

Both list with the SDK's ``AsyncSandbox.list(query=SandboxQuery(metadata=...))`` and kill by id with
``AsyncSandbox.kill(sandbox_id)``; the SDK boundary is the same ``sandbox_class`` as the backend's.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

log = logging.getLogger(__name__)

RUN_KEY = "harness_trainer_run"
OWNER_KEY = "harness_trainer_owner"
TASK_KEY = "harness_trainer_task"


def new_owner() -> str:
    """A fresh owner id: one per backend object."""
    return uuid.uuid4().hex[:16]


def sandbox_metadata(task_name: str, run_id: str | None, owner: str) -> dict[str, str]:
    """The metadata a sandbox is created with (no run key without a run id)."""
    metadata = {TASK_KEY: task_name, OWNER_KEY: owner}
    if run_id:
        metadata[RUN_KEY] = run_id
    return metadata


async def run_sandboxes(sandbox_class: Any, run_id: str, *, api_key: str | None = None) -> list[Any]:
    """Every running or paused sandbox labelled with ``run_id`` (the SDK's ``SandboxInfo`` objects)."""
    from e2b import SandboxQuery

    options = {"api_key": api_key} if api_key else {}
    paginator = sandbox_class.list(query=SandboxQuery(metadata={RUN_KEY: run_id}), **options)
    found: list[Any] = []
    while paginator.has_next:
        found.extend(await paginator.next_items())
    return found


async def kill_run(
    sandbox_class: Any, run_id: str, *, keep_owner: str | None = None, api_key: str | None = None
) -> list[str]:
    """Kill the sandboxes of ``run_id`` (except ``keep_owner``'s); the ids killed. A kill that fails is
    logged and left to E2B's timeout."""
    infos = await run_sandboxes(sandbox_class, run_id, api_key=api_key)
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
    return killed
