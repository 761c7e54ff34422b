"""A compose task's sidecars on the Docker backend: the services of its ``docker-compose.yaml`` other than
``main`` (:mod:`harness_trainer.tasks.compose`), started beside the agent's container.

Contract of :class:`DockerSidecars`:

- ``prepare(task)``: each sidecar's image, once per content: a ``build`` is built like a task's environment
  (:class:`~harness_trainer.sandboxes.docker_images.DockerImages`: its ``FROM`` stood in for where no
  registry serves it, the host's trust carried in); an ``image`` is used where the daemon has it, else
  pulled, else the error names it (no stand-in can be what a database image promises).
- ``start(task)``: a network of the sandbox's own (``internal`` when the task has ``allow_internet =
  false``: the services reach each other, nothing else), then each sidecar in ``depends_on`` order, reached
  on it by its service name. Returns a :class:`Sidecars` for the agent's container to join (as ``main``)
  and for its close to remove: containers first, then the network. A start that fails removes what it made.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from harness_trainer.sandboxes.base import SandboxStartError
from harness_trainer.sandboxes.docker_daemon import LABEL, RUN_ID
from harness_trainer.tasks.compose import MAIN, ComposeService
from harness_trainer.tasks.task import EnvironmentSpec, HarborTask

if TYPE_CHECKING:
    from harness_trainer.sandboxes.docker import DockerSandboxBackend

log = logging.getLogger(__name__)


@dataclass
class Sidecars:
    """One sandbox's network and sidecar containers."""

    network: str
    containers: list[str] = field(default_factory=list)
    names: tuple[str, ...] = ()

    def proxy_env(self, proxy: Mapping[str, str]) -> dict[str, str]:
        """``proxy`` (the host's proxy variables, carried into the sandbox) with the services' names in
        ``NO_PROXY``: a proxy outside cannot reach them, so the agent's requests to them go direct."""
        if not proxy:
            return {}
        skip = ",".join(filter(None, [proxy.get("NO_PROXY") or proxy.get("no_proxy"), *self.names]))
        return {**proxy, "NO_PROXY": skip, "no_proxy": skip}

    def endpoint(self, api: Any) -> dict[str, Any]:
        """The networking config that puts the agent's container on the network as ``main``."""
        return api.create_networking_config({self.network: api.create_endpoint_config(aliases=[MAIN])})


class DockerSidecars:
    """Sidecars of compose tasks for one :class:`~harness_trainer.sandboxes.docker.DockerSandboxBackend`."""

    def __init__(self, backend: DockerSandboxBackend) -> None:
        self.backend = backend

    async def prepare(self, task: HarborTask) -> dict[str, str]:
        """Each sidecar's image (service name → image), built or found once per content."""
        images = {}
        for service in task.compose.sidecars if task.compose else ():
            images[service.name] = await self._image(task, service)
        return images

    async def _image(self, task: HarborTask, service: ComposeService) -> str:
        if service.context is not None:
            if service.dockerfile != "Dockerfile":
                raise SandboxStartError(
                    f"{task.name}: sidecar {service.name}: only a context's Dockerfile builds"
                )
            own = replace(
                task, name=f"{task.name}-{service.name}", environment=EnvironmentSpec(), compose=None,
                environment_folder=os.path.relpath(service.context, task.path), separate_verifier=None,
            )  # fmt: skip
            return await self.backend.images.resolve(own)
        image = str(service.image)
        api = self.backend.client.api
        try:
            await self.backend.call(api.inspect_image, image)
        except Exception:
            try:
                await self.backend.call(api.pull, image, long=True)
            except Exception as exc:
                raise SandboxStartError(
                    f"{task.name}: sidecar {service.name}'s image {image} is not on this Docker daemon and "
                    f"could not be pulled ({exc}): docker load it, or give the service a build"
                ) from exc
        return image

    async def start(self, task: HarborTask) -> Sidecars:
        """The sandbox's network and its sidecars, running (see the module docstring)."""
        images = await self.prepare(task)
        api = self.backend.client.api
        services = task.compose.sidecars if task.compose else ()
        made = Sidecars(f"ht-{uuid.uuid4().hex[:12]}", names=tuple(s.name for s in services))
        try:
            await self.backend.call(
                api.create_network, made.network, driver="bridge", labels={LABEL: RUN_ID},
                internal=not task.environment.allow_internet,
            )  # fmt: skip
        except Exception as exc:
            raise SandboxStartError(f"{task.name}: cannot create its compose network: {exc}") from exc
        try:
            for service in task.compose.sidecars if task.compose else ():
                await self._run(task, service, images[service.name], made)
        except BaseException:
            await self.remove(made)
            raise
        return made

    async def _run(self, task: HarborTask, service: ComposeService, image: str, made: Sidecars) -> None:
        """Create and start one sidecar; it joins ``made`` once created, so a failed start removes it too."""
        api = self.backend.client.api
        try:
            created = await self.backend.call(
                api.create_container, image, command=list(service.command) if service.command else None,
                entrypoint=list(service.entrypoint) if service.entrypoint else None,
                environment=service.environment or None, working_dir=service.working_dir,
                labels={LABEL: RUN_ID}, stop_signal="SIGKILL",
                host_config=api.create_host_config(init=True, network_mode=made.network),
                networking_config=api.create_networking_config(
                    {made.network: api.create_endpoint_config(aliases=[service.name])}
                ),
            )  # fmt: skip
            made.containers.append(created["Id"])
            await self.backend.call(api.start, created["Id"])
        except Exception as exc:
            raise SandboxStartError(
                f"{task.name}: cannot start sidecar {service.name} ({image}): {exc}"
            ) from exc

    async def remove(self, made: Sidecars) -> None:
        """Remove the sidecars, then the network; never raises."""
        for container in made.containers:
            await self.backend.remove(container)
        try:
            await self.backend.call(self.backend.client.api.remove_network, made.network)
        except Exception as exc:
            log.warning("docker: could not remove network %s: %s", made.network, exc)
