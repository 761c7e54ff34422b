"""Images for the docker sandbox, built from the task's environment and cached by content.

The task's ``environment/Dockerfile`` (its folder is the build context) is built once per content and tagged
``ht-env:<16 hex>``, a sha256 of the Dockerfile as built, every file of the context and the id of each base
image, so tasks with identical environments share one image and a changed base rebuilds. Concurrent starts of
one environment wait for one build, and an image already on the daemon is reused. It never pulls: a ``FROM``
image that is not on the daemon is **mapped to the local base image** (``base_image``, default
``ht-debian:bookworm``, made by ``scripts/setup_docker.sh``; a ``python:X`` image to :data:`PYTHON_STAND_IN`,
built once from it) with a warning naming both images, because the machines this runs on reach no registry;
``map_missing_images=False`` refuses instead, with an error naming the image. A task without a Dockerfile runs
its ``docker_image`` (mapped the same way), else the base image. Every build carries the host's CA bundle and
proxy settings (:mod:`.host_trust`), so ``pip`` and ``npm`` in a ``RUN`` step work wherever they work on the
host; an image used without a Dockerfile is then built once too (``FROM`` it), to carry them. Builds are
bounded by ``build_timeout_sec`` (else ``build_timeout_s``); a failed build is a :class:`SandboxStartError`
with the build log's tail, which names the failing step.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import logging
import re
import tarfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import harness_trainer.sandboxes.dockerfile as dockerfile
from harness_trainer.sandboxes.base import SandboxStartError
from harness_trainer.sandboxes.docker_daemon import as_root, sdk
from harness_trainer.sandboxes.host_trust import CA_FILE_NAME, NO_TRUST, HostTrust
from harness_trainer.tasks.task import HarborTask

log = logging.getLogger(__name__)

PYTHON_STAND_IN = """FROM {base}
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \\
    python3-pip python-is-python3 >/dev/null && rm -rf /var/lib/apt/lists/*
ENV PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
"""
"""What stands in for a ``python:X`` image that is not on the daemon: the base image with what that image
promises, ``python``, ``python3`` and ``pip`` installing into the system Python (Debian's would refuse:
PEP 668). Built once per machine, over the build network (Debian's mirror)."""


class DockerImages:
    """The images of one backend. ``client()`` gives the Docker client; ``call(function, *args, long=…)``
    runs a blocking SDK call on the backend's threads (``long`` for a build)."""

    def __init__(
        self,
        client: Callable[[], Any],
        call: Callable[..., Awaitable[Any]],
        *,
        base_image: str,
        map_missing_images: bool,
        build_network: str | None,
        build_timeout_s: float,
        trust: HostTrust = NO_TRUST,
    ) -> None:
        self._client = client
        self._call = call
        self.base_image = base_image
        self.map_missing_images = map_missing_images
        self.build_network = build_network
        self.build_timeout_s = build_timeout_s
        self.trust = trust
        self._builds: dict[str, asyncio.Future[str]] = {}
        self._mapped: set[str] = set()

    async def resolve(self, task: HarborTask) -> str:
        """The image ``task`` runs in: built (once per content) from its Dockerfile, or its base."""
        if task.dockerfile is None:
            image = await self._base(task, task.environment.docker_image or self.base_image, "docker_image")
            if self.trust.ca_bundle is None:
                return image
            text, stood_in = f"FROM {image}\n", ()  # built once, to carry the host's trust store
        else:
            text, stood_in = await self._map_from(task, task.dockerfile.read_text())
        return await self._built(task, self.trust.dockerfile(text), task.environment_dir, stood_in)

    async def _built(
        self, task: HarborTask, text: str, context: Path | None, stood_in: tuple[str, ...] = ()
    ) -> str:
        """The tag of the image ``text`` builds in ``context``, built once per content however many starts
        ask at once."""
        digest = await self._call(_digest, text, context, self.trust.ca_bundle)
        tag = f"ht-env:{digest[:16]}"
        build = self._builds.get(tag)
        if build is None:
            build = self._builds[tag] = asyncio.ensure_future(self._build(task, text, tag, context, stood_in))
        try:
            return await asyncio.shield(build)
        except BaseException:
            # A failed build is retried by the next start; every start that waited on it gets its error
            # (the log's tail), whichever of them drops it first.
            if build.done() and self._builds.get(tag) is build:
                del self._builds[tag]
            raise

    async def _present(self, image: str) -> str | None:
        """The id of ``image`` on the daemon, or None."""
        try:
            return str((await self._call(self._client().api.inspect_image, image))["Id"])
        except sdk().errors.ImageNotFound:
            return None

    async def _base(self, task: HarborTask, image: str, where: str) -> str:
        if await self._present(image):
            return image
        if not self.map_missing_images or image == self.base_image:
            how = "build it with scripts/setup_docker.sh" if image == self.base_image else "load it first"
            raise SandboxStartError(
                f"{task.name}: {where} image {image} is not on this Docker daemon and the docker backend "
                f"does not pull ({how}: docker load / docker tag)"
            )
        if not await self._present(self.base_image):
            raise SandboxStartError(
                f"{task.name}: {where} image {image} is missing, and so is the base image {self.base_image} "
                "it would be mapped to: build it with scripts/setup_docker.sh"
            )
        stand_in, what = self.base_image, self.base_image
        if _repository(image) == "python":  # python:X promises python, python3 and pip
            text = self.trust.dockerfile(PYTHON_STAND_IN.format(base=self.base_image))
            stand_in, what = await self._built(task, text, None), f"{self.base_image} with python and pip"
        if image not in self._mapped:  # once per image and backend: every start of its tasks maps it
            self._mapped.add(image)
            log.warning("%s: %s image %s is not on this Docker daemon: using %s instead (%s)", task.name,
                        where, image, what, stand_in)  # fmt: skip
        return stand_in

    async def _map_from(self, task: HarborTask, text: str) -> tuple[str, tuple[str, ...]]:
        """``text`` with each ``FROM`` image that is not on the daemon replaced by the base image (or an
        error naming it); the ids of the images used are appended as a comment (they key the cache)."""
        lines = text.splitlines()
        stages: set[str] = set()
        args: dict[str, str] = {}
        used: list[str] = []
        stood_in: list[str] = []
        try:
            instructions = dockerfile.parse(text)
        except dockerfile.DockerfileError as exc:
            raise SandboxStartError(f"{task.name}: Dockerfile: {exc}") from exc
        for ins in instructions:
            if ins.keyword == "ARG" and not used:
                name, _, default = ins.args.partition("=")
                args[name.strip()] = default.strip().strip("\"'")
            if ins.keyword != "FROM":
                continue
            words = [w for w in ins.args.split() if not w.startswith("--")]
            image = dockerfile.expand(words[0], args) if words else ""
            if len(words) >= 3 and words[1].lower() == "as":
                stages.add(words[2])
            if image in stages or image == "scratch":
                continue
            chosen = await self._base(task, image, f"Dockerfile line {ins.line}: FROM")
            used.append(f"{chosen}@{await self._present(chosen)}")
            if chosen != image:
                flags = " ".join(w for w in ins.args.split() if w.startswith("--"))
                alias = f" AS {words[2]}" if len(words) >= 3 and words[1].lower() == "as" else ""
                lines[ins.line - 1] = f"FROM {flags + ' ' if flags else ''}{chosen}{alias}"
                stood_in.append(f"{image} stood in for by {chosen}")
        return "\n".join([*lines, f"# harness-trainer base images: {' '.join(used)}", ""]), tuple(stood_in)

    async def _build(
        self, task: HarborTask, text: str, tag: str, context_dir: Path | None, stood_in: tuple[str, ...]
    ) -> str:
        if await self._present(tag):
            return tag
        timeout = task.environment.build_timeout_sec or self.build_timeout_s
        context = await self._call(_context_tar, text, context_dir, self.trust.ca_bundle)
        began = time.monotonic()
        try:
            output = await asyncio.wait_for(
                self._call(self._run_build, context, tag, timeout, long=True), timeout
            )
        except TimeoutError:
            raise SandboxStartError(
                f"{task.name}: the image build ran past its {timeout:.0f} s timeout"
            ) from None
        if isinstance(output, str):
            hint = _missing_command_hint(stood_in, output)
            raise SandboxStartError(f"{task.name}: the image build failed; its log's tail:\n{output}{hint}")
        log.info("docker: built %s for %s in %.1f s", tag, task.name, time.monotonic() - began)
        return tag

    def _run_build(self, context: bytes, tag: str, timeout: float) -> str | None:
        """Build ``tag``; the log's tail on failure, None on success."""
        stream: list[str] = []

        def tail(last: str) -> str:
            return "\n".join([*build_log_lines(stream)[-40:], last])

        try:
            events = self._client().api.build(
                fileobj=io.BytesIO(context), custom_context=True, tag=tag, rm=True, forcerm=True,
                decode=True, pull=False, timeout=timeout, network_mode=self.build_network,
                labels={"harness-trainer": "env"}, buildargs=dict(self.trust.proxy),
            )  # fmt: skip
            for event in events:
                stream.append(str(event.get("stream", "")))
                if "error" in event:
                    return tail(str(event["error"]))
        except Exception as exc:
            return tail(f"{type(exc).__name__}: {exc}")
        return None


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def build_log_lines(chunks: list[str]) -> list[str]:
    """A build's log as lines, from the daemon's ``stream`` events. The events cut the output anywhere, a
    line too (under load, ``/bin/sh: 1: `` in one event and ``file: not found`` in the next), and wrap each
    stderr chunk in colour codes, which then sit mid-line: the codes are dropped and the text joined before
    it is cut into lines."""
    return _ANSI.sub("", "".join(chunks)).splitlines()


def _missing_command_hint(stood_in: tuple[str, ...], log_tail: str) -> str:
    """Where a build on a stand-in failed for a command it lacks (``/bin/sh: 1: file: not found``): a line
    saying so, naming the images stood in for; else nothing."""
    missing = re.search(r": ([\w.+-]+): (?:command )?not found", log_tail)
    if missing is None or not stood_in:
        return ""
    which = ", ".join(stood_in)
    return (
        f"\n`{missing.group(1)}` is not in the stand-in this build ran on ({which}: no registry here, so "
        f"the base image is a minimal Debian 12 with bash, python3 and CA certificates): install it in the "
        f"Dockerfile (apt-get install -y ...), or load the real image into the daemon"
    )


def _repository(image: str) -> str:
    """``python`` for ``python:3.12-slim``, ``docker.io/library/python@sha256:…`` and the like."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return last.split(":", 1)[0]


def _context_files(context: Path | None) -> list[Path]:
    if context is None or not context.is_dir():  # a stand-in, or a task with no environment folder
        return []
    return sorted(
        p for p in context.rglob("*") if p.is_file() and p.relative_to(context).as_posix() != "Dockerfile"
    )


def _digest(text: str, context: Path | None, ca_bundle: Path | None) -> str:
    """sha256 of the Dockerfile as built, every file of the build context (names, modes, contents) and the
    host's CA bundle the build carries."""
    digest = hashlib.sha256(text.encode())
    for path in _context_files(context):
        assert context is not None
        executable = bool(path.stat().st_mode & 0o111)  # as git keeps modes: other umasks hash the same
        digest.update(f"\0{path.relative_to(context).as_posix()}\0{executable}\0".encode())
        digest.update(path.read_bytes())
    if ca_bundle is not None:
        digest.update(b"\0" + CA_FILE_NAME.encode() + b"\0" + ca_bundle.read_bytes())
    return digest.hexdigest()


def _context_tar(text: str, context: Path | None, ca_bundle: Path | None) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for path in _context_files(context):
            assert context is not None
            archive.add(path, arcname=path.relative_to(context).as_posix(), filter=as_root)
        generated = {"Dockerfile": text.encode()}
        if ca_bundle is not None:
            generated[CA_FILE_NAME] = ca_bundle.read_bytes()
        for name, data in generated.items():
            info = as_root(tarfile.TarInfo(name))
            info.size, info.mode = len(data), 0o644
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()
