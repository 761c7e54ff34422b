"""The Docker sandbox (``sandbox="docker"``): one container per rollout, from an image built from the task.

Needs a Docker daemon on **this** machine (``DOCKER_HOST`` or the default socket) and the Docker SDK
(``pip install 'harness-trainer[docker]'``); the backend runs as root (see the proxy relay below).

Images: built from the task's environment once per content, never pulled; a base image missing on the
daemon maps to the local ``ht-debian:bookworm`` (:mod:`.docker_images`). Builds and containers carry the
host's CA bundle and proxy variables (:mod:`.host_trust`; ``inherit_host_trust=False`` opts out).

Containers. Each sandbox is a container of that image kept alive by ``sleep infinity`` under Docker's init
(which reaps orphans), labelled with this process (:mod:`.docker_daemon`) so that the leftovers of a process
that died are removed at the next backend's first start (and by :func:`remove_leftovers`). The container gets
``/logs/agent``, ``/logs/verifier``, empty ``/tests`` and ``/solution``, ``HOME`` (``/home/user``) and the
task's ``[environment] workdir``, else the image's ``WORKDIR``, else ``/app``, before it starts;
``[environment] cpus`` and ``memory_mb`` become its CPU quota and memory limit. Commands run as the image's
user with ``bash -lc``: a wrapper puts each in its own process group and sends its output to files it prints
at the end (a background child never holds the call open); on timeout or cancellation a second exec sends the
group SIGTERM, then SIGKILL after ``kill_grace_s``. ``close`` removes the container with everything in it
(idempotent, never raises); a sandbox closes itself when its lifetime runs out; ``aclose`` closes every open
one and removes any container of this process left by a failed start.

Network. ``allow_internet = false`` gives the container no network at all (``network_mode="none"``: only its
own loopback); otherwise it joins ``network`` (default Docker's ``bridge``, NAT to the internet). Either way
the agent must reach the capture proxy, which listens on this machine's loopback: the runtime gives the
backend the proxy's URL (``proxy_url``; ``capabilities.wants_proxy_url``), and when its host is loopback the
backend opens a listener on the **same address inside the container's network namespace**
(:mod:`.netns_relay`; hence root and a local daemon) and relays each connection to the proxy. So the agent
uses the URL it is given, unchanged, even with no network, and nothing else on this machine's loopback (the
engine, for one) is reachable from the container. A proxy URL that is not loopback is reached over the
container's network (not with ``allow_internet = false``). ``network="host"`` shares this machine's network
instead (no relay, no isolation; ``allow_internet = false`` still gets no network).

Snapshots (``capabilities.forks``, :mod:`.docker_snapshots`): ``snapshot`` commits a container to an image
labelled like the containers; ``start_from`` starts a container of it as ``start`` does one of the task's
(agents' mounts, sidecars, limits, network, relay, env, lifetime), with no build; ``drop`` removes it.

Isolation: its own filesystem, processes, network and limits; commands run as the image's user (root by
default), which is **root of this machine** unless the daemon remaps users (``userns-remap``): Docker's
default capability set and seccomp profile apply, but this is not a VM boundary. ``storage_mb`` is not
enforced.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from harness_trainer.sandboxes.base import (
    AgentProvision,
    Capabilities,
    Isolation,
    Sandbox,
    SandboxSnapshot,
    SandboxStartError,
    sandbox_lifetime,
)
from harness_trainer.sandboxes.docker_agents import DockerAgents
from harness_trainer.sandboxes.docker_compose import DockerSidecars, Sidecars
from harness_trainer.sandboxes.docker_daemon import (
    BASE_IMAGE,
    LABEL,
    RUN_ID,
    daemon_problem,
    daemon_problem_text,
    remove_leftovers,
    sdk,
    tar_of,
    unavailable,
)
from harness_trainer.sandboxes.docker_images import DockerImages
from harness_trainer.sandboxes.docker_sandbox import DockerSandbox
from harness_trainer.sandboxes.docker_scripts import BASH_PROFILE, EXEC_DIR
from harness_trainer.sandboxes.docker_snapshots import DockerSnapshots
from harness_trainer.sandboxes.host_trust import NO_TRUST, HostTrust
from harness_trainer.tasks.task import HarborTask

log = logging.getLogger(__name__)

LOOPBACK = ("127.0.0.1", "localhost")


class DockerSandboxBackend:
    """Starts :class:`DockerSandbox` es. Options (all keyword, all optional):

    - ``base_image``: what a ``FROM`` image missing on the daemon is built from (default
      ``ht-debian:bookworm``); ``map_missing_images=False`` refuses such tasks instead;
    - ``network``: the network of containers with internet (default ``"bridge"``; ``"host"`` shares this
      machine's); ``build_network``: the one ``RUN`` steps of builds use (default the daemon's);
    - ``proxy_url``: the capture proxy's URL as agents are told it (the runtime passes it), relayed into
      each container when it is on loopback;
    - ``build_timeout_s`` (default 1800), ``kill_grace_s`` (default 2), ``lifetime_margin_s`` (default
      60), ``home`` (default ``/home/user``);
    - ``client``: a ``docker.DockerClient`` (default ``docker.from_env()``).
    """

    name = "docker"
    capabilities = Capabilities(
        summary="a Docker container per rollout on this machine's daemon (images built from the task)",
        isolation=Isolation(network=True, filesystem=True, user=False, limits=True),
        builds="images",
        wants_proxy_url=True,
        sidecars=True,
        forks=True,
        extra="docker",
    )

    def __init__(
        self,
        *,
        base_image: str = BASE_IMAGE,
        map_missing_images: bool = True,
        network: str = "bridge",
        build_network: str | None = None,
        proxy_url: str | None = None,
        build_timeout_s: float = 1800.0,
        kill_grace_s: float = 2.0,
        lifetime_margin_s: float = 60.0,
        home: str = "/home/user",
        client: Any = None,
        inherit_host_trust: bool = True,
    ) -> None:
        self.network = network
        self.proxy_url = proxy_url
        self.kill_grace_s = kill_grace_s
        self.lifetime_margin_s = lifetime_margin_s
        self.home = home
        self._client = self._given_client = client
        self._stream_api: Any = None
        self._pools: dict[bool, concurrent.futures.ThreadPoolExecutor] = {}
        self._live: set[DockerSandbox] = set()
        self._swept = False
        self.images = DockerImages(
            lambda: self.client, self.call, base_image=base_image, map_missing_images=map_missing_images,
            build_network=build_network, build_timeout_s=build_timeout_s,
            trust=HostTrust.from_host() if inherit_host_trust else NO_TRUST,
        )  # fmt: skip
        self.agents = DockerAgents(
            lambda: self.client, self.call, network=build_network or network, env=self.images.trust.proxy,
            timeout_s=build_timeout_s,
        )  # fmt: skip
        self.sidecars = DockerSidecars(self)
        self._snapshots = DockerSnapshots(self)

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = sdk().from_env(timeout=120, max_pool_size=64)
        return self._client

    @property
    def stream_api(self) -> Any:
        """The low-level client for calls that last as long as a command (no read timeout)."""
        if self._stream_api is None:
            given = self._given_client
            self._stream_api = given.api if given else sdk().from_env(timeout=None, max_pool_size=256).api
        return self._stream_api

    def _first_contact(self) -> str | None:
        """Connects, checks the daemon answers and removes leftovers of dead processes; a problem or None."""
        try:
            client = self.client
        except Exception as exc:  # docker.from_env asks the daemon for its API version
            return daemon_problem_text(exc)
        if problem := daemon_problem(client):
            return problem
        remove_leftovers(client)
        return None

    @property
    def live(self) -> list[DockerSandbox]:
        return list(self._live)

    async def call(self, function: Callable[..., Any], *args: Any, long: bool = False, **kwargs: Any) -> Any:
        """``function`` on this backend's threads: SDK calls block. Calls that last as long as a command or a
        build (``long``) get their own pool, a thread each, so they never hold up short ones (a close)."""
        if long not in self._pools:
            size, name = (4096, "ht-docker-long") if long else (32, "ht-docker")
            self._pools[long] = concurrent.futures.ThreadPoolExecutor(size, thread_name_prefix=name)
        call = lambda: function(*args, **kwargs)  # noqa: E731
        return await asyncio.get_running_loop().run_in_executor(self._pools[long], call)

    def provide(self, agents: Sequence[AgentProvision]) -> None:
        """Mount these agents' bundles into every container from now on (:mod:`.docker_agents`)."""
        self.agents.provide(agents)

    async def prepare(self, task: HarborTask) -> None:
        """The daemon checked (and leftovers removed) once, ``task``'s image built once per content, and
        each provisioned agent set up for it once."""
        await self._image(task)

    async def _image(self, task: HarborTask) -> str:
        if not self._swept:
            if problem := await self.call(self._first_contact):
                raise SandboxStartError(f"{task.name}: {problem}")
            self._swept = True
        try:
            image = await self.images.resolve(task)
            await self.agents.set_up(task, image)
            await self.sidecars.prepare(task)
            return image
        except SandboxStartError:
            raise
        except Exception as exc:
            raise SandboxStartError(f"{task.name}: cannot prepare the image: {exc}") from exc

    async def start(
        self, task: HarborTask, *, lifetime_s: float, env: dict[str, str] | None = None
    ) -> DockerSandbox:
        return await self._launch(task, await self._image(task), lifetime_s, env)

    @property
    def snapshots(self) -> list[SandboxSnapshot]:
        return self._snapshots.held

    async def snapshot(self, sandbox: Sandbox) -> SandboxSnapshot:
        """``sandbox``'s container committed to an image; raises :class:`SandboxError`."""
        return await self._snapshots.take(sandbox)

    async def start_from(
        self,
        snapshot: SandboxSnapshot,
        task: HarborTask,
        *,
        lifetime_s: float,
        env: dict[str, str] | None = None,
    ) -> DockerSandbox:
        """A container of ``snapshot``'s image, started as :meth:`start` starts one of the task's."""
        image = self._snapshots.image(snapshot, task)
        await self._image(task)  # built and set up already (the source's start): agents provided since
        return await self._launch(task, image, lifetime_s, env)

    async def drop(self, snapshot: SandboxSnapshot) -> None:
        """Remove ``snapshot``'s image; idempotent, never raises."""
        await self._snapshots.drop(snapshot)

    async def _launch(
        self, task: HarborTask, image: str, lifetime_s: float, env: dict[str, str] | None
    ) -> DockerSandbox:
        """A running, tracked sandbox of ``task`` in a container of ``image`` (the task's or a snapshot's)."""
        sidecars = await self.sidecars.start(task) if task.compose and task.compose.sidecars else None
        try:
            sandbox = await self._create(task, image, env or {}, sidecars)
        except BaseException:
            if sidecars is not None:
                await self.sidecars.remove(sidecars)
            raise
        self._live.add(sandbox)
        sandbox.on_close.append(self._live.discard)
        try:
            await self._start(task, sandbox)
        except BaseException:
            await sandbox.close()
            raise
        sandbox.expire_after(sandbox_lifetime(task, lifetime_s, self.lifetime_margin_s))
        return sandbox

    async def _create(
        self, task: HarborTask, image: str, env: Mapping[str, str], sidecars: Sidecars | None
    ) -> DockerSandbox:
        api = self.client.api
        spec = task.environment
        limits: dict[str, Any] = {}
        if spec.cpus:
            limits["nano_cpus"] = int(spec.cpus * 1e9)
        if spec.memory_mb:
            limits["mem_limit"] = f"{int(spec.memory_mb)}m"
        network = self.network if spec.allow_internet else "none"
        network = sidecars.network if sidecars is not None else network
        proxy = sidecars.proxy_env(self.images.trust.proxy) if sidecars else self.images.trust.proxy
        binds = self.agents.binds
        host_config = api.create_host_config(init=True, network_mode=network, binds=binds or None, **limits)
        try:
            config = (await self.call(api.inspect_image, image)).get("Config") or {}
            workdir = spec.workdir or config.get("WorkingDir") or "/app"
            created = await self.call(
                api.create_container, image, entrypoint=["sleep", "infinity"], command=[],
                environment={"HOME": self.home, **proxy, **env}, working_dir=workdir,
                labels={LABEL: RUN_ID}, host_config=host_config, stop_signal="SIGKILL",
                volumes=[bind["bind"] for bind in binds.values()],
                networking_config=sidecars.endpoint(api) if sidecars is not None else None,
            )  # fmt: skip
            inspected = await self.call(api.inspect_container, created["Id"])
        except Exception as exc:
            raise SandboxStartError(f"{task.name}: cannot create a container of {image}: {exc}") from exc
        container_env = dict(item.partition("=")[::2] for item in inspected["Config"].get("Env") or [])
        provisioned = frozenset(self.agents.agents)
        return DockerSandbox(
            self, created["Id"], task_name=task.name, workdir=workdir, env={**container_env, **env},
            provisioned=provisioned, sidecars=sidecars,
        )  # fmt: skip

    async def _start(self, task: HarborTask, sandbox: DockerSandbox) -> None:
        api = self.client.api
        dirs = ["/logs", "/logs/agent", "/logs/verifier", "/tests", "/solution", EXEC_DIR, sandbox.workdir]
        entries: list[tuple[str, bytes | None, int]] = [(d, None, 0o755) for d in dict.fromkeys(dirs)]
        entries += [(self.home, None, 0o755), (f"{self.home}/.bash_profile", BASH_PROFILE.encode(), 0o644)]
        try:
            await self.call(api.put_archive, sandbox.container, "/", tar_of(entries))
            await self.call(api.start, sandbox.container)
            pid = (await self.call(api.inspect_container, sandbox.container))["State"]["Pid"]
        except Exception as exc:
            raise SandboxStartError(f"{task.name}: cannot start container {sandbox.id}: {exc}") from exc
        url = urlsplit(self.proxy_url or "")
        shares_host_network = self.network == "host" and task.environment.allow_internet
        if url.hostname in LOOPBACK and not shares_host_network:
            try:
                await sandbox.relay(pid, "127.0.0.1", url.port or (443 if url.scheme == "https" else 80))
            except OSError as exc:
                raise SandboxStartError(
                    f"{task.name}: cannot relay the capture proxy ({self.proxy_url}) into container "
                    f"{sandbox.id}: {exc} (the docker backend needs root and a daemon on this machine)"
                ) from exc

    async def remove(self, container: str) -> None:
        """Remove ``container`` (killing what runs in it); never raises."""
        try:
            await self.call(self.client.api.remove_container, container, force=True, v=True)
        except Exception as exc:
            if "No such container" not in str(exc):
                log.warning("docker: could not remove container %s: %s", container[:12], exc)

    async def aclose(self) -> None:
        """Close every sandbox this backend started, remove any container of this process left over and
        drop its snapshots; then let go of its threads and connections (the next start makes new ones)."""
        await asyncio.gather(*(sandbox.close() for sandbox in self.live))
        await self._snapshots.drop_all()
        if self._client is not None:
            with contextlib.suppress(Exception):
                for container in await self.call(
                    self.client.api.containers, all=True, filters={"label": f"{LABEL}={RUN_ID}"}
                ):
                    await self.remove(container["Id"])
        for pool in self._pools.values():
            pool.shutdown(wait=False)
        self._pools.clear()
        if self._given_client is None:
            for client in (self._client, self._stream_api):
                if client is not None:
                    with contextlib.suppress(Exception):
                        client.close()
            self._client = self._stream_api = None


__all__ = [
    "BASE_IMAGE",
    "DockerSandbox",
    "DockerSandboxBackend",
    "daemon_problem",
    "remove_leftovers",
    "unavailable",
]
