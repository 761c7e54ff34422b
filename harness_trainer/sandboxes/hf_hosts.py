"""Jobs that end under the hf backend's sandboxes: why a job ended, and a pool's ended hosts forgotten.

A sandbox's job (a dedicated sandbox's own, or a pooled sandbox's host) can end while sandboxes run on it:
its VM fails (``ERROR``), its 24 h run out or it idles out (``COMPLETED``), someone cancels it. Its server
then stops answering, and the backend names that reason (:func:`job_ended`) in the ``SandboxError`` of
every operation of those sandboxes, so a rollout in one is unscorable with it and the run goes on.

``SandboxPool`` (``huggingface_hub`` 2.4) does not replace such a host by itself: a host it booted in this
process stays in its list (``_hosts``) with its free slots, and each later ``create()`` reserves a slot
there first and raises the failed request (only a host rebuilt from its cache, not yet ``verified``, is
dropped on failure), so every start would fail on the dead host until ``close()``, which then tries to
cancel it. :func:`drop_ended_hosts` does what the library does for a dead cached host
(``SandboxPool._drop_host``: forgotten, marked for its cache's pruning), for the hosts the Jobs API no
longer lists as live; the next ``create()`` then places the sandbox on another host or boots a new one
(``max_hosts`` counts only the hosts the Jobs API lists as running). Both reach into the library's private
state (``_hosts``, ``_drop_host``), pinned by the version the backend needs; blocking, as the library is.
"""

from __future__ import annotations

import logging
from typing import Any

from harness_trainer.sandboxes.hf_runs import LIVE_STAGES
from harness_trainer.sandboxes.hf_sdk import hub

log = logging.getLogger(__name__)


def job_ended(job_id: str, *, token: str | None, namespace: str | None) -> str | None:
    """Why job ``job_id`` ended (its stage, then the Hub's message if it gave one), or None while it still
    runs. Raises what the Hub answered when it cannot say."""
    status = hub().HfApi(token=token).inspect_job(job_id=job_id, namespace=namespace).status
    if status.stage in LIVE_STAGES:
        return None
    return f"{status.stage}: {status.message}" if status.message else str(status.stage)


def drop_host(pool: Any, job_id: str) -> bool:
    """Forget ``pool``'s host ``job_id`` (its job ended), so that no later ``create()`` reserves a slot on
    it; whether the pool had it."""
    hosts = [host for host in list(pool._hosts) if host.job_id == job_id]
    for host in hosts:
        pool._drop_host(host)
    return bool(hosts)


def drop_ended_hosts(pool: Any, *, token: str | None, namespace: str | None) -> list[str]:
    """Forget every host of ``pool`` that the Jobs API no longer lists as scheduling or running (one
    listing, by the pool's labels); the job ids forgotten. Raises what the Hub answered when it cannot
    list them, forgetting none."""
    from huggingface_hub._sandbox import MODE_LABEL, MODE_POOL, POOL_LABEL

    api = hub().HfApi(token=token)
    labels = {MODE_LABEL: MODE_POOL, POOL_LABEL: pool.name}
    live = {job.id for job in api.list_jobs(status=LIVE_STAGES, labels=labels, namespace=namespace)}
    ended = [host.job_id for host in list(pool._hosts) if host.job_id not in live]
    for job_id in ended:
        drop_host(pool, job_id)
        log.warning("HF sandbox pool %s: host job %s has ended; its sandboxes are lost", pool.name, job_id)
    return ended
