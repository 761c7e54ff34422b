"""The Docker daemon as the docker sandbox meets it: the SDK (an optional extra), whether a daemon answers,
the label that marks this process's containers and the sweep of dead processes' leftovers, and the tar
archives the daemon takes files in.

Every container the backend creates is labelled ``harness-trainer.run=<host>:<pid>:<start time>``: a
container whose process on this host is no longer running (the pid is gone, or reused by a process that
started at another time) is a leftover, removed by :func:`remove_leftovers`; so is a snapshot image
(:mod:`.docker_snapshots`: labelled the same, and ``SNAPSHOT_LABEL``).
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import tarfile
import time
from pathlib import Path
from typing import Any

from harness_trainer.sandboxes.base import SandboxStartError

BASE_IMAGE = "ht-debian:bookworm"
LABEL = "harness-trainer.run"
SNAPSHOT_LABEL = "harness-trainer.snapshot"
"""Marks a snapshot image (its value: the sandbox it was taken from) among the images that carry ``LABEL``."""


def sdk() -> Any:
    """The Docker SDK module (``docker``), or a :class:`SandboxStartError` saying how to install it."""
    try:
        import docker
    except ImportError as exc:  # the SDK is an optional extra
        raise SandboxStartError(
            "the docker backend needs the Docker SDK: pip install 'harness-trainer[docker]'"
        ) from exc
    return docker


def _process_start(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


RUN_ID = f"{socket.gethostname()}:{os.getpid()}:{_process_start(os.getpid())}"


def daemon_problem(client: Any = None) -> str | None:
    """Why no Docker daemon answers here, in one line; None when one does."""
    try:
        (client or sdk().from_env(timeout=5)).ping()
    except SandboxStartError as exc:
        return str(exc)
    except Exception as exc:  # the SDK raises DockerException, requests' errors, OSError…
        return daemon_problem_text(exc)
    return None


def daemon_problem_text(exc: Exception) -> str:
    return f"no Docker daemon answers ({type(exc).__name__}: {exc})"


def unavailable(base_image: str = BASE_IMAGE) -> str | None:
    """Why the docker backend cannot start sandboxes of tasks without an image of their own here (no
    SDK, no daemon, no base image), in one line; None when it can."""
    try:
        docker = sdk()
        client = docker.from_env(timeout=10)
    except Exception as exc:
        return str(exc) if isinstance(exc, SandboxStartError) else daemon_problem_text(exc)
    try:
        if problem := daemon_problem(client):
            return problem
        client.api.inspect_image(base_image)
    except docker.errors.ImageNotFound:
        return f"the base image {base_image} is not on the Docker daemon: run scripts/setup_docker.sh"
    except Exception as exc:
        return daemon_problem_text(exc)
    finally:
        client.close()
    return None


def remove_leftovers(client: Any) -> list[str]:
    """Remove the containers of harness-trainer processes of this host that are no longer running, then
    their networks (a compose task's, :mod:`.docker_compose`) and their snapshot images; the ids removed."""
    removed = []
    for container in client.api.containers(all=True, filters={"label": LABEL}):
        if _orphaned(container["Labels"]):
            with contextlib.suppress(Exception):
                client.api.remove_container(container["Id"], force=True, v=True)
                removed.append(container["Id"])
    for network in client.api.networks(filters={"label": LABEL}):
        if _orphaned(network.get("Labels") or {}):
            with contextlib.suppress(Exception):
                client.api.remove_network(network["Id"])
                removed.append(network["Id"])
    for image in client.api.images(filters={"label": [LABEL, SNAPSHOT_LABEL]}):
        if _orphaned(image.get("Labels") or {}):
            with contextlib.suppress(Exception):
                client.api.remove_image(image["Id"], force=True)
                removed.append(image["Id"])
    return removed


def _orphaned(labels: dict[str, str]) -> bool:
    """Made by a harness-trainer process of this host that is no longer running."""
    owner_host, _, rest = labels.get(LABEL, "").partition(":")
    pid, _, started = rest.partition(":")
    return owner_host == socket.gethostname() and pid.isdigit() and _process_start(int(pid)) != started


def as_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """A tar member owned by root: files copied in belong to the image's root, not to this host's ids."""
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def tar_of(entries: list[tuple[str, bytes | None, int]]) -> bytes:
    """A tar of absolute paths: ``(path, content, mode)``, content None for a directory."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for path, content, mode in entries:
            info = as_root(tarfile.TarInfo(path.lstrip("/")))
            info.mode, info.mtime = mode, int(time.time())
            if content is None:
                info.type = tarfile.DIRTYPE
                archive.addfile(info)
            else:
                info.size = len(content)
                archive.addfile(info, io.BytesIO(content))
    return buffer.getvalue()
