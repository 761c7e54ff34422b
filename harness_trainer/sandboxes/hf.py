"""The Hugging Face backend (``sandbox="hf"``): sandboxes on Hugging Face Jobs, through ``huggingface_hub``'s
``Sandbox.create`` (dedicated, the default) or ``SandboxPool`` (``dedicated=False``).

Dedicated (the default): each sandbox is a job (a VM) of its own, root in the task's image, labelled with
the run id, this backend object (owner) and the task: what a Harbor task needs (it writes ``/logs``,
``/tests`` and its workdir), and the option for untrusted tasks.

Pooled (``dedicated=False``): one ``SandboxPool`` per image per backend (a pool runs one image; a backend
is one run), named for the run (:func:`~.hf_sdk.pool_name`), with ``sandboxes_per_host`` sandboxes packed
in each host job and ``ceil(concurrency / sandboxes_per_host)`` hosts booted when the pool is first asked
(``concurrency``: the rollouts the run keeps in flight); more hosts boot on demand, up to ``max_hosts``.
The pool adopts no host it did not boot (``adopt_hosts="never"``): a run's hosts are its own.
**Isolation**: a pooled sandbox is a uid and a Landlock ruleset inside a VM shared with the other
sandboxes of its host, which share the host's token and control plane: for tasks inside one trust
boundary only. Its commands may write only its home, so a task whose paths (``/logs``, ``/tests``, its
workdir) are outside it cannot start there: the start fails naming the path and ``dedicated=true``. Today
that is every Harbor task, hence the default; pooled is for tasks whose paths all lie in the home.

Images (:func:`image_for`): the task's ``[environment] docker_image``; else its ``environment/Dockerfile``
when it only names an image (``FROM``, ``ARG``, ``ENV``, ``WORKDIR``: run as that image with that
environment and workdir); else the ``image`` option for a task with neither. A Dockerfile that builds
(``RUN``, ``COPY``) is refused naming the task: the Jobs API runs images and builds none.

Agents (:meth:`HfSandboxBackend.provide`): each bundle is uploaded into every sandbox at start (one tar
archive, unpacked at its ``AgentProvision.path``) and its ``setup`` run there, as root in a dedicated
sandbox. Lifetime: a sandbox closes itself after ``max(lifetime_s, agent + verifier timeouts) +
lifetime_margin_s``; HF ends a sandbox idle for ``idle_timeout`` (default: that lifetime, since a
foreground command does not count as activity) and an empty pool host idle for ``host_idle_timeout``.

Ended jobs (:mod:`.hf_hosts`): when a sandbox's job (a pooled one's host) ends under it, every operation
of the sandboxes on it raises SandboxError naming why (the job's stage and message), and an ended host is
dropped from its pool, which keeps it otherwise: the next starts go to another host or a new one.

Reaping (:mod:`.hf_runs`): every job names its run (a dedicated one by its label, a pool host by its pool's
name); given a ``run_id``, the backend first cancels the jobs of that run a dead server left.

Credentials: ``HF_TOKEN``, or the ``token`` option, or a token stored by ``hf auth login`` (its
``capabilities.login``: preflight and ``serve`` accept a logged-in user too). Before its first create the
backend checks the token once (``whoami``, one page of the namespace's Jobs): a missing token, one the Hub
refuses (401) or one without the right to run Jobs (403) is one :class:`SandboxStartError` line. Tested
against a fake Hub and fake sandbox servers only (``tests/sandboxes/fake_hf.py``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shlex
import uuid
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import harness_trainer.sandboxes.dockerfile as dockerfile
from harness_trainer.sandboxes import create_retry
from harness_trainer.sandboxes.base import (
    AgentProvision,
    Capabilities,
    Isolation,
    Login,
    SandboxError,
    SandboxStartError,
    refuse_sidecars,
    sandbox_lifetime,
)
from harness_trainer.sandboxes.hf_errors import (
    RETRIED,
    Kind,
    access_problem,
    classify,
    retry_delay_s,
    tries_allowed,
)
from harness_trainer.sandboxes.hf_hosts import drop_ended_hosts, drop_host, job_ended
from harness_trainer.sandboxes.hf_runs import cancel_run
from harness_trainer.sandboxes.hf_sandbox import HfSandbox
from harness_trainer.sandboxes.hf_sdk import check_access, dedicated_labels, hub, pool_name
from harness_trainer.tasks.task import HarborTask

log = logging.getLogger(__name__)

ISOLATION_NOTE = (
    "HF sandboxes are each a job (a VM) of their own by default (dedicated=true); pooled ones "
    "(dedicated=false) are a uid and a Landlock ruleset in a VM shared with the other sandboxes of their "
    "host job, writing only their home: use them for tasks inside one trust boundary"
)
"""What the backend says of its isolation, for the docs and ``--help``."""


def stored_login() -> bool:
    """Whether ``hf auth login`` stored a token on this machine (the library's token file), which the
    backend uses when neither its ``token`` option nor ``HF_TOKEN`` gives one."""
    try:
        from huggingface_hub import constants
    except ImportError:
        return False
    try:
        return bool(Path(constants.HF_TOKEN_PATH).read_text().strip())
    except OSError:
        return False


def hosts_for(concurrency: int | None, sandboxes_per_host: int) -> int:
    """Hosts a pool boots up front: enough for ``concurrency`` sandboxes at once (at least one)."""
    return max(1, math.ceil((concurrency or 1) / sandboxes_per_host))


def image_for(task: HarborTask, default: str | None) -> tuple[str, str | None, dict[str, str]]:
    """The image ``task`` runs in, the workdir its Dockerfile sets (None: none) and its ``ENV``; raises
    SandboxStartError naming the task when that takes a build or there is no image at all."""
    env_spec = task.environment
    if env_spec.docker_image:
        return env_spec.docker_image, None, {}
    if task.dockerfile is not None:
        try:
            built = dockerfile.plan(dockerfile.parse(task.dockerfile.read_text()), base_env={}, strict=False)
        except (dockerfile.DockerfileError, OSError) as exc:
            raise SandboxStartError(f"{task.name}: cannot read {task.dockerfile}: {exc}") from exc
        if built.steps or not built.base_image:
            line = built.steps[0].line if built.steps else 1
            raise SandboxStartError(
                f"{task.name}: its environment/Dockerfile builds an image (line {line}), and the hf backend "
                "runs prebuilt images only (the Jobs API builds none): push the image and set [environment] "
                "docker_image, or run the task on the docker or e2b backend"
            )
        return built.base_image, built.workdir, dict(built.env)
    if default:
        return default, None, {}
    raise SandboxStartError(
        f"{task.name}: it names no image ([environment] docker_image) and the hf backend has no image option"
    )


class HfSandboxBackend:
    """Starts :class:`~.hf_sandbox.HfSandbox` es. Options (keyword): ``dedicated`` (True; False: pooled),
    ``sandboxes_per_host`` (50), ``concurrency`` (the run's rollouts in flight: sizes the pool),
    ``max_hosts`` (None: no cap), ``flavor`` (``cpu-basic``), ``image`` (for tasks that name none),
    ``idle_timeout`` (seconds; None: the sandbox's lifetime), ``host_idle_timeout`` (600),
    ``namespace``, ``token`` (default: ``HF_TOKEN``, then the library's login), ``workdir`` (default: the
    task's, else its Dockerfile's, else ``/app``), ``lifetime_margin_s`` (300), ``create_attempts`` (3),
    ``retry_backoff_s`` (2), ``kill_grace_s`` (2), ``start_timeout_s`` (300: a job's boot), ``run_id``
    (labels and pool names, and whose orphans are reaped; default: a fresh id per backend, reaping none)."""

    name = "hf"
    capabilities = Capabilities(
        summary="Hugging Face Jobs sandboxes: a VM each, or pooled (dedicated=false; one trust boundary)",
        # Dedicated: a VM each; pooled: a uid + Landlock in a shared VM. Neither cuts the network off, and
        # a task's cpus/memory_mb are not applied (the flavor is).
        isolation=Isolation(network=False, filesystem=True, user=True, limits=False),
        credentials=("HF_TOKEN",),
        login=Login("hf auth login", stored_login),
        remote=True,
        extra="hf",
    )

    def __init__(
        self,
        *,
        dedicated: bool = True,
        sandboxes_per_host: int = 50,
        concurrency: int | None = None,
        max_hosts: int | None = None,
        flavor: str = "cpu-basic",
        image: str | None = None,
        idle_timeout: float | None = None,
        host_idle_timeout: float | None = 600.0,
        namespace: str | None = None,
        token: str | None = None,
        workdir: str | None = None,
        lifetime_margin_s: float = 300.0,
        create_attempts: int = 3,
        retry_backoff_s: float = 2.0,
        kill_grace_s: float = 2.0,
        start_timeout_s: float = 300.0,
        run_id: str | None = None,
    ) -> None:
        if sandboxes_per_host < 1:
            raise ValueError("sandboxes_per_host must be at least 1")
        self.dedicated = dedicated
        self.sandboxes_per_host = sandboxes_per_host
        self.concurrency = concurrency
        self.max_hosts = max_hosts
        self.flavor = flavor
        self.image = image
        self.idle_timeout = idle_timeout
        self.host_idle_timeout = host_idle_timeout
        self.namespace = namespace
        self.token = token
        self.workdir = workdir
        self.lifetime_margin_s = lifetime_margin_s
        self.create_attempts = max(1, create_attempts)
        self.retry_backoff_s = retry_backoff_s
        self.kill_grace_s = kill_grace_s
        self.start_timeout_s = start_timeout_s
        self.owner = uuid.uuid4().hex[:16]
        self.run_id = run_id or self.owner
        self._named_run = run_id is not None  # a fresh id has no earlier server to reap after
        self.agents: tuple[AgentProvision, ...] = ()
        self.pools: dict[str, Any] = {}  # image -> huggingface_hub.SandboxPool
        self._pool_starts: dict[str, asyncio.Future[Any]] = {}
        self._live: set[HfSandbox] = set()
        self._unclaimed: set[asyncio.Future[None]] = set()
        self._access: asyncio.Future[None] | None = None
        self._reaping: asyncio.Future[None] | None = None
        self._ended: dict[str, str] = {}  # job id -> why it ended (see job_ended)
        # Library calls block their thread for a whole command: a pool of its own, sized for the run.
        self.executor = ThreadPoolExecutor(
            max_workers=max(32, 4 * (concurrency or 8)), thread_name_prefix="ht-hf"
        )

    @property
    def live(self) -> list[HfSandbox]:
        return list(self._live)

    def provide(self, agents: Sequence[AgentProvision]) -> None:
        """Upload these agents into every sandbox started from now on, and run their setup there."""
        merged = {agent.name: agent for agent in (*self.agents, *agents)}
        self.agents = tuple(merged[name] for name in sorted(merged))

    async def _in_thread(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, lambda: fn(*args, **kwargs))

    async def check_access(self) -> None:
        """Once: the token is there and may run Jobs; raises SandboxStartError in one line."""
        if self._access is None:
            self._access = asyncio.ensure_future(self._check_access())
        await asyncio.shield(self._access)

    async def _check_access(self) -> None:
        hub()
        token = self.token or os.environ.get("HF_TOKEN") or hub().get_token()
        if not token:
            raise SandboxStartError(
                "the hf backend needs HF_TOKEN (a Hugging Face token that may run Jobs) in the environment, "
                "or a token stored by `hf auth login`"
            )
        self.token = token
        try:
            self.namespace = await self._in_thread(check_access, token, self.namespace)
        except Exception as exc:
            raise SandboxStartError(access_problem(exc, "HF_TOKEN")) from exc

    async def reap_orphans(self) -> None:
        """Once, after the token check and before the first create: cancel the run's sandbox jobs another
        owner left (a server of the same ``run_id`` that died hard; see :mod:`.hf_runs`). Only with a
        ``run_id`` given; a failure to list is logged, never fatal."""
        if not self._named_run:
            return
        if self._reaping is None:
            self._reaping = asyncio.ensure_future(self._reap())
        await asyncio.shield(self._reaping)

    async def _reap(self) -> None:
        try:
            cancelled = await self._in_thread(
                cancel_run, self.run_id, token=self.token, namespace=self.namespace, keep_owner=self.owner
            )
        except Exception as exc:  # orphans end at their idle timeout; the run goes on
            log.warning("HF run %s: cannot look for orphaned sandbox jobs: %s", self.run_id, exc)
            return
        if cancelled:
            log.warning("HF run %s: cancelled %d sandbox jobs an earlier server left", self.run_id,
                        len(cancelled))  # fmt: skip

    async def prepare(self, task: HarborTask) -> None:
        """The token checked and, pooled, the pool of ``task``'s image booted (its first hosts)."""
        refuse_sidecars(task, self.name)
        image, _, _ = image_for(task, self.image)
        await self.check_access()
        await self.reap_orphans()
        if not self.dedicated:
            await self._pool(image)

    async def _pool(self, image: str) -> Any:
        """The run's pool for ``image``, made (its first hosts booted) once however many ask."""
        if image not in self._pool_starts:
            self._pool_starts[image] = asyncio.ensure_future(self._open_pool(image))
        return await asyncio.shield(self._pool_starts[image])

    async def _open_pool(self, image: str) -> Any:
        try:
            pool = await self._in_thread(
                hub().SandboxPool, image, flavor=self.flavor, sandboxes_per_host=self.sandboxes_per_host,
                warm_up=hosts_for(self.concurrency, self.sandboxes_per_host),  # max_hosts caps it
                max_hosts=self.max_hosts, name=pool_name(self.run_id, image),
                idle_timeout=self.host_idle_timeout, namespace=self.namespace,
                start_timeout=self.start_timeout_s, adopt_hosts="never", token=self.token,
            )  # fmt: skip
        except Exception as exc:
            self._pool_starts.pop(image, None)  # the next start tries again
            raise SandboxStartError(
                f"the HF sandbox pool for image {image!r} did not start: {classify(exc)}: {exc}"
            ) from exc
        self.pools[image] = pool
        return pool

    async def start(
        self, task: HarborTask, *, lifetime_s: float, env: dict[str, str] | None = None
    ) -> HfSandbox:
        sandbox = await self.create_sandbox(task, lifetime_s=lifetime_s, env=env)
        async with _closed_on_failure(sandbox, task, "cannot prepare"):
            await self._make_task_dirs(sandbox, sandbox.workdir)
            for agent in self.agents:
                await sandbox.upload_dir(agent.host_dir, agent.path, skip=("venvs",))
                if agent.setup:
                    await sandbox.check(agent.setup)
        return sandbox

    async def create_sandbox(
        self, task: HarborTask, *, lifetime_s: float, env: dict[str, str] | None = None
    ) -> HfSandbox:
        """A sandbox of ``task``'s image, made (through the run's pool when pooled, with retries, an ended
        pool host replaced) and answering its first command (its home learned), its lifetime running: what
        :meth:`start` builds on, before the task's paths and agents. Alone, what a pooled sandbox always
        holds: a task that needs only its home (its workdir is not made: give commands a ``cwd`` there).
        Raises SandboxStartError."""
        refuse_sidecars(task, self.name)
        image, image_workdir, image_env = image_for(task, self.image)
        await self.check_access()
        await self.reap_orphans()
        lifetime = sandbox_lifetime(task, lifetime_s, self.lifetime_margin_s)
        idle = math.ceil(self.idle_timeout if self.idle_timeout is not None else lifetime)
        sdk_sandbox = await self._create(task, image, idle)
        sandbox = HfSandbox(
            sdk_sandbox,
            executor=self.executor,
            pooled=not self.dedicated,
            workdir=self.workdir or task.environment.workdir or image_workdir or "/app",
            env={**image_env, **(env or {})},
            kill_grace_s=self.kill_grace_s,
            provisioned=frozenset(agent.name for agent in self.agents),
            ended=self.job_ended,
        )
        self._live.add(sandbox)
        sandbox.on_close.append(self._live.discard)
        async with _closed_on_failure(sandbox, task, "cannot reach"):
            await sandbox.learn_home()
        sandbox.start_lifetime(lifetime)
        return sandbox

    async def job_ended(self, job_id: str) -> str | None:
        """Why job ``job_id`` (a sandbox's, or a pool host's) has ended, or None while it runs: asked of the
        Hub until it has ended, then remembered. An ended pool host is dropped from its pool at once, so
        that the run's next starts go to another host."""
        if job_id not in self._ended:
            reason = await self._in_thread(job_ended, job_id, token=self.token, namespace=self.namespace)
            if reason is None:
                return None
            self._ended[job_id] = reason
            for pool in self.pools.values():
                await self._in_thread(drop_host, pool, job_id)
        return self._ended[job_id]

    async def _make_task_dirs(self, sandbox: HfSandbox, workdir: str) -> None:
        """The task's paths made; in a pooled sandbox, a failure says why it may be one (its home)."""
        dirs = ["/logs/agent", "/logs/verifier", "/tests", "/solution", workdir]
        try:
            await sandbox.check("mkdir -p " + " ".join(map(shlex.quote, dirs)))
        except SandboxError as exc:
            if self.dedicated:
                raise
            raise SandboxError(
                f"{exc} (a pooled HF sandbox writes only its home, {sandbox.home}: run this task with "
                "dedicated=true, the default)"
            ) from exc

    async def _create(self, task: HarborTask, image: str, idle: int) -> Any:
        """A sandbox of ``image`` from the pool or as a job of its own, with retries of what may pass."""
        if self.dedicated:
            create = lambda: hub().Sandbox.create(  # noqa: E731
                image, flavor=self.flavor, idle_timeout=idle, namespace=self.namespace,
                labels=dedicated_labels(task.name, self.run_id, self.owner),
                start_timeout=self.start_timeout_s, token=self.token,
            )  # fmt: skip
        else:
            pool = await self._pool(image)
            create = lambda: pool.create(idle_timeout=idle)  # noqa: E731
        attempt, hosts_checked = 0, self.dedicated  # only a pool keeps a host whose job ended
        while True:
            attempt += 1
            made = asyncio.get_running_loop().run_in_executor(self.executor, create)
            try:
                # Shielded: a start cancelled mid-create must not leave what the create makes meanwhile.
                return await asyncio.shield(made)
            except asyncio.CancelledError:
                reclaim = asyncio.ensure_future(_reclaim(made))
                self._unclaimed.add(reclaim)
                reclaim.add_done_callback(self._unclaimed.discard)
                raise
            except Exception as exc:
                # The pool may have placed it on a host whose job ended (it keeps such hosts): once per
                # start, drop those and try again, on another host or a new one, without counting that try.
                if not hosts_checked:
                    hosts_checked = True
                    if await self._drop_ended_hosts(pool):
                        attempt -= 1
                        continue
                kind = classify(exc)
                if attempt >= tries_allowed(kind, self.create_attempts):
                    raise SandboxStartError(_create_failure(task, image, attempt, kind, exc)) from exc
                await asyncio.sleep(retry_delay_s(kind, attempt, base_s=self.retry_backoff_s))

    async def _drop_ended_hosts(self, pool: Any) -> list[str]:
        """The hosts of ``pool`` whose jobs have ended, dropped from it (:func:`~.hf_hosts.drop_ended_hosts`);
        none when the Hub cannot list them (logged: the start's own error stands)."""
        try:
            return await self._in_thread(drop_ended_hosts, pool, token=self.token, namespace=self.namespace)
        except Exception as exc:
            log.warning("HF sandbox pool %s: cannot list its hosts' jobs: %s", pool.name, exc)
            return []

    async def aclose(self) -> None:
        """Close every sandbox still open, then every pool (its host jobs cancelled)."""
        await asyncio.gather(*(sandbox.close() for sandbox in self.live))
        if self._unclaimed:
            await asyncio.wait(list(self._unclaimed), timeout=60)
        pools, self.pools = list(self.pools.values()), {}
        self._pool_starts.clear()
        for pool in pools:
            try:
                await self._in_thread(pool.close)
            except Exception as exc:  # its hosts idle-time-out; the error names the jobs still billing
                log.warning("HF sandbox pool %s: close failed: %s", pool.name, exc)
        self.executor.shutdown(wait=False)  # its threads are idle now: none outlives the backend


@asynccontextmanager
async def _closed_on_failure(sandbox: HfSandbox, task: HarborTask, what: str) -> AsyncIterator[None]:
    """Close ``sandbox`` when the block fails; a SandboxError becomes a SandboxStartError naming the task."""
    try:
        yield
    except BaseException as exc:
        await sandbox.close()
        if isinstance(exc, SandboxError):
            raise SandboxStartError(f"{task.name}: {what} HF sandbox {sandbox.id}: {exc}") from exc
        raise


async def _reclaim(made: asyncio.Future[Any]) -> None:
    """Once a create whose caller was cancelled ends, kill the sandbox it made, if it made one."""
    try:
        sdk_sandbox = await made
    except Exception:
        return
    await asyncio.get_running_loop().run_in_executor(None, sdk_sandbox.kill)


def _create_failure(task: HarborTask, image: str, tries: int, kind: Kind, exc: Exception) -> str:
    """The start error's text: how many tries, the last error's kind and its text."""
    if kind in RETRIED or kind in (Kind.UNKNOWN, Kind.DID_NOT_BOOT):
        head = f"HF sandbox for {task.name} (image {image!r}) did not start"
    else:
        head = f"Hugging Face refused to create a sandbox for {task.name} (image {image!r})"
    return create_retry.failure_text(head, tries, kind, exc)
