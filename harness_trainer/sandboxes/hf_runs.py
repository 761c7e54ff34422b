"""HF sandbox jobs labelled with their run, so that a run's orphans can be found and cancelled (the E2B
reaper's rule, :mod:`.e2b_runs`, for the hf backend).

Every job the hf backend makes says which run made it: a dedicated sandbox's job carries the label
:data:`~.hf_sdk.RUN_LABEL` (and :data:`~.hf_sdk.OWNER_LABEL`: one id per backend object, i.e. per server
process); a pool host job carries only the labels ``SandboxPool`` sets, so its pool's name
(``hf-sandbox-pool``, :func:`~.hf_sdk.pool_name`) carries the run id. A sandbox job runs until its idle
timeout (the agent and verifier timeouts plus a margin) and a pool host until it has been empty for
``host_idle_timeout``, so a server that was SIGKILLed leaves jobs billing until then. Two ways to end them:

- the next backend of the same run cancels, before its first create, every running or scheduling sandbox
  job of the run that another owner made (:func:`cancel_run` with ``keep_owner``): restart ``serve`` with
  the same ``--run-id``. One server per run id: two live servers sharing one would cancel each other's;
- ``harness-trainer hf cleanup --run ID`` cancels them all by hand.

Both list with ``HfApi.list_jobs(status=…, labels=…)``, filtered as the library filters its own sandbox jobs
(``hf-sandbox=1``, so that no other job of the namespace, such as the training job labelled with the same
run, is ever touched), and cancel by id with ``HfApi.cancel_job``. Tested against the fake Hub only.
"""

from __future__ import annotations

import logging
from typing import Any

from harness_trainer.sandboxes.hf_sdk import OWNER_LABEL, RUN_LABEL, hub, is_run_pool

log = logging.getLogger(__name__)

LIVE_STAGES = ["SCHEDULING", "RUNNING"]
"""The stages of a job that still bills (the others are ended)."""


def run_jobs(api: Any, run_id: str, namespace: str) -> list[Any]:
    """Every sandbox job of ``run_id`` in ``namespace`` still scheduling or running (the library's
    ``JobInfo`` objects): its dedicated sandboxes, then its pool hosts."""
    from huggingface_hub._sandbox import MODE_LABEL, MODE_POOL, POOL_LABEL, SANDBOX_LABEL

    dedicated = api.list_jobs(
        status=LIVE_STAGES, labels={SANDBOX_LABEL: "1", RUN_LABEL: run_id}, namespace=namespace
    )
    pooled = api.list_jobs(
        status=LIVE_STAGES, labels={SANDBOX_LABEL: "1", MODE_LABEL: MODE_POOL}, namespace=namespace
    )
    hosts = [job for job in pooled if is_run_pool((job.labels or {}).get(POOL_LABEL), run_id)]
    return [*dedicated, *hosts]


def cancel_run(
    run_id: str, *, token: str | None, namespace: str | None = None, keep_owner: str | None = None
) -> list[str]:
    """Cancel the sandbox jobs of ``run_id`` (except the dedicated ones ``keep_owner`` made) under
    ``namespace`` (default: the token's own); the ids cancelled. A listing that fails raises what the Hub
    answered; a cancel that fails is logged and left to the job's idle timeout. Blocking: the library is."""
    api = hub().HfApi(token=token)
    namespace = namespace or api.whoami()["name"]
    doomed = [
        job.id
        for job in run_jobs(api, run_id, namespace)
        if not keep_owner or (job.labels or {}).get(OWNER_LABEL) != keep_owner
    ]
    cancelled = []
    for job_id in doomed:
        try:
            api.cancel_job(job_id=job_id, namespace=namespace)
        except Exception as exc:  # one job's refusal must not spare the others; its idle timeout ends it
            log.warning("HF sandbox job %s of run %s: cancel failed (its idle timeout ends it): %s",
                        job_id, run_id, exc)  # fmt: skip
        else:
            cancelled.append(job_id)
    return cancelled
