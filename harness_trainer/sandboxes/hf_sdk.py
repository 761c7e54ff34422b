"""The calls into ``huggingface_hub`` (an optional extra, ``harness-trainer[hf]``) that the hf backend makes.

The library is synchronous (``httpx2`` under it): the backend runs each of these in its own thread pool. The
library reads the Hub's address from ``huggingface_hub.constants.ENDPOINT`` (``HF_ENDPOINT`` at import),
which is how the tests point it at a fake Hub; the sandboxes' own servers are reached at the URL each job
exposes (``job.status.expose_urls``).
"""

from __future__ import annotations

import hashlib
import re
import tarfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from harness_trainer.sandboxes.base import SandboxStartError

RUN_LABEL = "harness_trainer_run"
OWNER_LABEL = "harness_trainer_owner"
TASK_LABEL = "harness_trainer_task"


def hub() -> Any:
    """The ``huggingface_hub`` module; raises SandboxStartError naming the extra when it lacks sandboxes."""
    try:
        import huggingface_hub
    except ImportError as exc:
        raise SandboxStartError(
            "the hf backend needs huggingface_hub: pip install 'harness-trainer[hf]'"
        ) from exc
    if not hasattr(huggingface_hub, "SandboxPool"):
        raise SandboxStartError(
            f"the hf backend needs huggingface_hub >= 2.4 (Sandbox, SandboxPool); this is "
            f"{huggingface_hub.__version__}: pip install 'harness-trainer[hf]'"
        )
    return huggingface_hub


def check_access(token: str | None, namespace: str | None) -> str:
    """The namespace the sandboxes run under (``namespace``, else the token's own), after one ``whoami``
    and one page of that namespace's Jobs: raises what the Hub answered when the token is not valid (401)
    or may not use Jobs there (403). Passing the namespace on keeps the library from asking ``whoami`` again
    (and from asking it through its module-level ``HfApi``, made with the address of its first import)."""
    api = hub().HfApi(token=token)
    namespace = namespace or api.whoami()["name"]
    next(iter(api.list_jobs(namespace=namespace, labels={RUN_LABEL: "access-check"})), None)
    return namespace


def pool_name(run: str, image: str) -> str:
    """The ``hf-sandbox-pool`` label of the run's pool for ``image``: a pool host job carries no label of
    ours (``SandboxPool`` sets its own), so its pool name says which run made it."""
    return f"ht-{run}-{hashlib.sha256(image.encode()).hexdigest()[:8]}"


def is_run_pool(name: str | None, run: str) -> bool:
    """Whether ``name`` is a :func:`pool_name` of ``run`` (of any image), and of no other run: the digest is
    exactly the last eight hex digits, so run ``a`` does not claim run ``a-0123abcd``'s pools."""
    prefix = f"ht-{run}-"
    digest = (name or "").removeprefix(prefix)
    return bool(name) and name != digest and bool(re.fullmatch(r"[0-9a-f]{8}", digest))


def dedicated_labels(task: str, run: str | None, owner: str) -> dict[str, str]:
    """The labels of a dedicated sandbox's job (no run label without a run id)."""
    labels = {TASK_LABEL: task[:128], OWNER_LABEL: owner}
    if run:
        labels[RUN_LABEL] = run
    return labels


def pack(folder: Path, archive: Path, *, skip: Iterable[str] = ()) -> Path:
    """``folder``'s contents as an uncompressed tar at ``archive`` (modes kept, symlinks as links), leaving
    out entries whose top-level name is in ``skip``: one upload and one ``tar -x`` instead of one request
    per file."""
    left_out = set(skip)
    with tarfile.open(archive, "w") as tar:
        for entry in sorted(folder.iterdir()):
            if entry.name not in left_out:
                tar.add(entry, arcname=entry.name)
    return archive
