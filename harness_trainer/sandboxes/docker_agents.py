"""Agents in the docker sandbox: each provisioned agent's bundle bind-mounted read-only into every container.

A bundle (:class:`~harness_trainer.sandboxes.base.AgentProvision`) is a folder on this machine; each
container sees it at ``/opt/harness-trainer/agents/<name>``, so no rollout installs anything and a
container with no network still runs its agent. A mount, not a layer of each image: a bundle is hundreds of
megabytes (opencode's binary 177 MB, claude-code's 384 MB), which a layer would copy into every task's
image, and a mount costs nothing per container. An agent with a ``setup`` (a pip agent's venv for the
image's Python) is completed once per image and backend: a throwaway container of the image runs it as
root with the bundle writable, on the build network; its failure is a
:class:`~harness_trainer.sandboxes.base.SandboxStartError` naming the task, the image and the agent, with
the setup's output.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import harness_trainer.sandboxes.dockerfile as dockerfile
from harness_trainer.sandboxes.base import AgentProvision, SandboxStartError
from harness_trainer.sandboxes.docker_daemon import LABEL, RUN_ID
from harness_trainer.tasks.task import HarborTask

_OUTPUT_TAIL = 3000


class DockerAgents:
    """The agents one docker backend provisions. ``client()`` and ``call(function, *args, long=…)`` are the
    backend's (see :class:`~harness_trainer.sandboxes.docker_images.DockerImages`)."""

    def __init__(
        self,
        client: Callable[[], Any],
        call: Callable[..., Awaitable[Any]],
        *,
        network: str,
        env: Mapping[str, str],
        timeout_s: float,
    ) -> None:
        self._client = client
        self._call = call
        self.network = network
        self.env = dict(env)
        self.timeout_s = timeout_s
        self.agents: dict[str, AgentProvision] = {}
        self._setups: dict[tuple[str, str], asyncio.Future[None]] = {}

    def provide(self, agents: Sequence[AgentProvision]) -> None:
        """Mount these bundles into every container started from now on (an agent given again by the same
        name replaces its bundle)."""
        for agent in agents:
            self.agents[agent.name] = agent

    @property
    def binds(self) -> dict[str, dict[str, str]]:
        """The read-only bind mounts of every provisioned bundle, as ``create_host_config`` takes them."""
        return {str(agent.host_dir): {"bind": agent.path, "mode": "ro"} for agent in self.agents.values()}

    async def set_up(self, task: HarborTask, image: str) -> None:
        """Each provisioned agent with a ``setup`` completed for ``image``, once however many ask at once."""
        await asyncio.gather(*(self._once(task, image, a) for a in self.agents.values() if a.setup))

    async def _once(self, task: HarborTask, image: str, agent: AgentProvision) -> None:
        key = (image, agent.name)
        setup = self._setups.get(key)
        if setup is None:
            setup = self._setups[key] = asyncio.ensure_future(self._run(task, image, agent))
        try:
            await asyncio.shield(setup)
        except BaseException:
            if setup.done() and self._setups.get(key) is setup:
                del self._setups[key]  # the next start tries again; every waiter got this error
            raise

    async def _run(self, task: HarborTask, image: str, agent: AgentProvision) -> None:
        api = self._client().api
        host_config = api.create_host_config(
            binds={str(agent.host_dir): {"bind": agent.path, "mode": "rw"}}, network_mode=self.network
        )
        try:
            created = await self._call(
                api.create_container, image, entrypoint=["sh", "-c", agent.setup], command=[], user="0",
                environment=self.env, labels={LABEL: RUN_ID}, host_config=host_config, volumes=[agent.path],
            )  # fmt: skip
        except Exception as exc:
            what = f"{task.name}: cannot set up agent {agent.name} in {image}"
            raise SandboxStartError(f"{what}: {exc}") from None
        container = created["Id"]
        try:
            await self._call(api.start, container)
            try:
                waited = await asyncio.wait_for(
                    self._call(api.wait, container, long=True), self.timeout_s
                )  # fmt: skip
            except TimeoutError:
                raise SandboxStartError(
                    f"{task.name}: setting up agent {agent.name} in {image} ran past {self.timeout_s:.0f} s"
                ) from None
            if waited.get("StatusCode") != 0:
                output = await self._call(api.logs, container, stdout=True, stderr=True)
                tail = output.decode(errors="replace")[-_OUTPUT_TAIL:]
                raise SandboxStartError(
                    f"{task.name}: setting up agent {agent.name} in the task's image "
                    f"({declared_image(task)}, built as {image}) exited with {waited.get('StatusCode')}:"
                    f"\n{tail}"
                )
        finally:
            await self._call(api.remove_container, container, force=True, v=True)


def declared_image(task: HarborTask) -> str:
    """The image the task asks for, as its author wrote it: the last ``FROM`` of its Dockerfile, else its
    ``docker_image``, else ``the base image``."""
    if task.dockerfile is not None:
        try:
            parsed = dockerfile.parse(task.dockerfile.read_text())
            froms = [ins.args.split() for ins in parsed if ins.keyword == "FROM"]
        except (OSError, dockerfile.DockerfileError):
            froms = []
        words = [w for w in froms[-1] if not w.startswith("--")] if froms else []
        if words:
            return words[0]
    return task.environment.docker_image or "the base image"
