"""The E2B backend: each sandbox is an E2B cloud microVM, driven with the official SDK (``e2b.AsyncSandbox``).

Template: E2B runs templates, not Dockerfiles. The first that applies wins: ``template_map[task.name]``,
the task's ``[environment] e2b_template``, ``template_map[docker_image]``, the ``template`` option; else
the template built from the task's own environment (``environment/Dockerfile``, else ``docker_image``,
plus the ``agent_layer``), named by a hash of its content (:mod:`.e2b_templates`): with
``templates="build"`` (default) the backend builds it on first use, once per name however many rollouts
ask, and reuses one that exists in E2B; with ``templates="prebuilt"`` it only looks it up and fails at
once naming the missing template (build them ahead with ``harness-trainer e2b build-templates``). A
failed or timed-out build is a :class:`SandboxStartError` naming the task (and the failing instruction).

Lifetime: the sandbox's E2B ``timeout`` is ``max(lifetime_s, agent + verifier timeouts) + lifetime_margin_s``,
so E2B reaps it even if this process dies; with ``run_id`` a server restarted on the same run kills
them before that (:mod:`.e2b_runs`). A failed create is classified (:mod:`.e2b_errors`): transport errors,
429s, "busy / unavailable / 5xx" and a template whose build is not ready yet are tried up to
``create_attempts`` times (3) with jittered exponential backoff (longer after a 429); bad credentials or
arguments, an unknown template, any other 4xx fail at once; an unclassified exception gets one more try.
The :class:`SandboxStartError` says how many tries, the last error's kind and its text. A retried create
whose answer was lost (a transport error after the request went out) may leave a sandbox behind: E2B
reaps it at its timeout (and ``run_id`` reaping finds it).

Commands run as ``user`` (``root`` by default, as task images expect) in ``bash -l -c`` (envd's own),
with ``start(env=…)`` and the command's ``env`` passed as ``envs`` on **every** command. Each command
is wrapped to run in its own session (``setsid``, util-linux, present in Debian/Ubuntu images) and to
record its process group; on timeout the backend kills that whole group (SIGTERM, then SIGKILL after
``kill_grace_s``) with a second command. ``close`` kills the sandbox (idempotent, never raises).
If ``allow_internet = false``, egress is denied except to ``allow_out`` (which must include the capture
proxy's public host, or the agent cannot reach its model).

Snapshots (one setup per GRPO group, :mod:`.e2b_snapshots`): E2B's ``create_snapshot``, named for the run
(reaped as its sandboxes are); ``start_from`` creates from the snapshot's id through ``start``'s create path.

The SDK boundary is ``sandbox_class`` (default ``e2b.AsyncSandbox``) and ``template_class`` (default
``e2b.AsyncTemplate``): tests inject fakes with the same signatures (tested against a fake cloud only).

Manual smoke test, for users with ``E2B_API_KEY`` (creates one sandbox from the ``base`` template, runs
commands, a timeout and file round trips, and closes it)::

    python -m harness_trainer.launch.e2b_smoke --smoke [--template base]
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import posixpath
import shlex
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import harness_trainer.sandboxes.dockerfile as dockerfile
from harness_trainer.finish import finish
from harness_trainer.sandboxes.base import (
    AgentProvision,
    Capabilities,
    ExecResult,
    Isolation,
    SandboxError,
    SandboxStartError,
    refuse_sidecars,
    resolve_path,
    sandbox_lifetime,
)
from harness_trainer.sandboxes.e2b_errors import classify, create_failure, retry_delay_s, tries_allowed
from harness_trainer.sandboxes.e2b_runs import kill_run, new_owner, sandbox_metadata
from harness_trainer.sandboxes.e2b_sdk import sdk
from harness_trainer.sandboxes.e2b_snapshots import E2BSnapshots
from harness_trainer.sandboxes.e2b_templates import DEFAULT_BUILD_TIMEOUT_S, TemplateBuilder
from harness_trainer.tasks.task import EnvironmentSpec, HarborTask

log = logging.getLogger(__name__)

# $1 = pidfile, $2 = command. The inner shell records its pid (= its process group, under setsid).
_WRAP = """ht_w='echo $$ > "$1"; exec /bin/bash -c "$2"'
if command -v setsid >/dev/null 2>&1; then setsid -w /bin/bash -c "$ht_w" ht {pidfile} {command}
else /bin/bash -c "$ht_w" ht {pidfile} {command}; fi
ht_rc=$?; rm -f {pidfile}; exit $ht_rc
"""
_KILL = """i=0; while [ ! -s {pidfile} ] && [ $i -lt 20 ]; do sleep 0.05; i=$((i+1)); done
p=$(cat {pidfile} 2>/dev/null) || exit 0
kill -TERM -- "-$p" 2>/dev/null || kill -TERM "$p" 2>/dev/null
i=0; while kill -0 -- "-$p" 2>/dev/null && [ $i -lt {ticks} ]; do sleep 0.1; i=$((i+1)); done
kill -KILL -- "-$p" 2>/dev/null || kill -KILL "$p" 2>/dev/null; rm -f {pidfile}; exit 0
"""


class SandboxClass(Protocol):
    """What the backend needs of ``e2b.AsyncSandbox``: its ``create`` classmethod."""

    async def create(self, template: str | None = None, timeout: int | None = None, **kwargs: Any) -> Any: ...


class E2BSandbox:
    """One E2B sandbox; the SDK object is ``sdk_sandbox``."""

    shares_host_filesystem = False

    def __init__(
        self,
        sdk_sandbox: Any,
        *,
        workdir: str,
        home: str,
        env: dict[str, str],
        user: str,
        kill_grace_s: float,
        provisioned: frozenset[str] = frozenset(),
        task_name: str = "",
    ) -> None:
        self.sdk_sandbox = sdk_sandbox
        self.task_name = task_name
        self.provisioned = provisioned
        """The agents its template carries (:meth:`E2BSandboxBackend.provide`), by bundle name."""
        self.id: str = sdk_sandbox.sandbox_id
        self.workdir = workdir
        self.home = home
        self.user = user
        self._env = env
        self._kill_grace_s = kill_grace_s
        self._closed = False
        self._background: set[asyncio.Task[None]] = set()
        self.on_close: list[Callable[[E2BSandbox], object]] = []

    @property
    def closed(self) -> bool:
        return self._closed

    def sandbox_path(self, path: str) -> str:
        return resolve_path(path, workdir=self.workdir, home=self.home)

    async def exec(
        self,
        command: str,
        *,
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> ExecResult:
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")
        e2b = sdk()
        pidfile = shlex.quote(f"/tmp/.ht-exec-{uuid.uuid4().hex}.pid")
        out: list[str] = []
        err: list[str] = []
        try:
            result = await self.sdk_sandbox.commands.run(
                _WRAP.format(pidfile=pidfile, command=shlex.quote(command)),
                envs={**self._env, **(env or {})},
                cwd=self.sandbox_path(cwd) if cwd else self.workdir,
                user=self.user,
                timeout=timeout_s or 0,  # 0: no limit (the SDK's own default is 60 s)
                on_stdout=out.append,
                on_stderr=err.append,
            )
        except e2b.CommandExitException as exc:
            return ExecResult(exit_code=exc.exit_code, stdout=exc.stdout or "", stderr=exc.stderr or "")
        except (e2b.SandboxNotRunningException, e2b.SandboxUnreachableException) as exc:
            raise SandboxError(f"sandbox {self.id} is gone: {exc}") from exc
        except e2b.TimeoutException:
            await self._kill_group(pidfile)
            return ExecResult(exit_code=None, stdout="".join(out), stderr="".join(err), timed_out=True)
        except asyncio.CancelledError:
            task = asyncio.ensure_future(self._kill_group(pidfile))  # do not leave it running
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            raise
        except e2b.SandboxException as exc:
            raise SandboxError(f"sandbox {self.id}: command failed to run: {exc}") from exc
        return ExecResult(exit_code=result.exit_code, stdout=result.stdout or "", stderr=result.stderr or "")

    async def _kill_group(self, pidfile: str) -> None:
        ticks = max(1, math.ceil(self._kill_grace_s / 0.1))
        script = _KILL.format(pidfile=pidfile, ticks=ticks)
        e2b = sdk()
        try:
            await self.sdk_sandbox.commands.run(script, user=self.user, timeout=self._kill_grace_s + 30)
        except e2b.SandboxException as exc:  # the sandbox may be dying; close() kills it all anyway
            log.warning("sandbox %s: could not kill a timed-out command: %s", self.id, exc)

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        target = self.sandbox_path(path)
        e2b = sdk()
        try:
            await self.sdk_sandbox.files.write(target, data, user=self.user)
        except e2b.SandboxException as exc:
            raise SandboxError(f"sandbox {self.id}: cannot write {target}: {exc}") from exc
        if mode != 0o644:
            await self._check(f"chmod {mode:o} {shlex.quote(target)}")

    async def read_file(self, path: str) -> bytes:
        target = self.sandbox_path(path)
        e2b = sdk()
        try:
            return bytes(await self.sdk_sandbox.files.read(target, format="bytes", user=self.user))
        except e2b.NotFoundException as exc:
            raise FileNotFoundError(f"{target} (in sandbox {self.id})") from exc
        except e2b.SandboxException as exc:
            raise SandboxError(f"sandbox {self.id}: cannot read {target}: {exc}") from exc

    async def upload_dir(self, local: Path, remote: str) -> None:
        root, target = Path(local), self.sandbox_path(remote)
        if not root.is_dir():
            raise NotADirectoryError(f"{local} is not a directory")
        entries, executables, dirs = [], [], [target]
        for path in sorted(root.rglob("*")):
            inside = posixpath.join(target, path.relative_to(root).as_posix())
            if path.is_dir():
                dirs.append(inside)
            else:
                entries.append({"path": inside, "data": path.read_bytes()})
                if os.access(path, os.X_OK):
                    executables.append(inside)
        e2b = sdk()
        try:
            if entries:
                await self.sdk_sandbox.files.write_files(entries, user=self.user)
        except e2b.SandboxException as exc:
            raise SandboxError(f"sandbox {self.id}: cannot upload {local} to {target}: {exc}") from exc
        script = "mkdir -p " + " ".join(map(shlex.quote, dirs))
        if executables:
            script += " && chmod +x " + " ".join(map(shlex.quote, executables))
        await self._check(script)

    async def _check(self, command: str, cwd: str | None = None) -> None:
        result = await self.exec(command, timeout_s=120, cwd=cwd)
        if result.exit_code != 0:
            raise SandboxError(f"sandbox {self.id}: `{command[:200]}` failed: {result.stderr[-500:]}")

    async def close(self) -> None:
        """Kill the sandbox; idempotent, never raises, and finishes when its caller is cancelled meanwhile
        (:func:`~harness_trainer.finish.finish`)."""
        if self._closed:
            return
        self._closed = True
        await finish(self._kill())

    async def _kill(self) -> None:
        try:
            await self.sdk_sandbox.kill()
        except Exception as exc:  # close must not raise; E2B reaps it at its timeout anyway
            log.warning("sandbox %s: kill failed (E2B reaps it at its timeout): %s", self.id, exc)
        finally:
            for callback in self.on_close:
                callback(self)


class E2BSandboxBackend(E2BSnapshots):
    """Starts :class:`E2BSandbox` es. Options (keyword): ``template``, ``template_map`` (see the module
    docstring), ``api_key`` (default: ``E2B_API_KEY``), ``user`` (``root``), ``home`` (``/root`` for root,
    else ``/home/<user>``), ``workdir`` (default: the task's ``[environment] workdir``, else its
    Dockerfile's last ``WORKDIR``, else ``/app``),
    ``lifetime_margin_s`` (300), ``create_attempts`` (3: tries of a create failing in a retryable way, see
    :mod:`.e2b_errors`), ``retry_backoff_s`` (2, doubled per try, jittered, at most 60),
    ``rate_limit_backoff_s`` (10: the same, after a 429), ``kill_grace_s`` (2), ``allow_out`` (egress allowed
    when a task has ``allow_internet = false``), ``sandbox_class`` (the SDK boundary; default
    ``e2b.AsyncSandbox``); for templates built from the task's environment: ``templates`` (``"build"`` or
    ``"prebuilt"``), ``agent_layer`` (a shell command run as root at the end of every such template),
    ``build_timeout_s`` (when the task sets no ``build_timeout_sec``), ``build_log_dir``, ``template_class``
    (default ``e2b.AsyncTemplate``); ``run_id``: label every sandbox and snapshot with the run, and before the
    first start remove the run's sandboxes and snapshots a dead server left (:mod:`.e2b_runs`). Snapshots:
    :class:`~.e2b_snapshots.E2BSnapshots`."""

    name = "e2b"
    capabilities = Capabilities(
        summary="E2B cloud microVMs",
        # A template built from the task gets its cpus/memory_mb; a named template keeps its own.
        isolation=Isolation(network=True, filesystem=True, user=True, limits=False),
        credentials=("E2B_API_KEY",),
        remote=True,
        builds="templates",
        forks=True,
        extra="e2b",
    )

    def __init__(
        self,
        *,
        template: str | None = None,
        template_map: Mapping[str, str] | None = None,
        api_key: str | None = None,
        user: str = "root",
        home: str | None = None,
        workdir: str | None = None,
        lifetime_margin_s: float = 300.0,
        create_attempts: int = 3,
        retry_backoff_s: float = 2.0,
        rate_limit_backoff_s: float = 10.0,
        kill_grace_s: float = 2.0,
        allow_out: Sequence[str] = (),
        sandbox_class: SandboxClass | None = None,
        templates: Literal["build", "prebuilt"] = "build",
        agent_layer: str = "",
        build_timeout_s: float = DEFAULT_BUILD_TIMEOUT_S,
        build_log_dir: Path | None = None,
        template_class: Any = None,
        run_id: str | None = None,
    ) -> None:
        if templates not in ("build", "prebuilt"):
            raise ValueError(f"templates must be 'build' or 'prebuilt', not {templates!r}")
        super().__init__(sandbox_class)
        self.template = template
        self.template_map = dict(template_map or {})
        self.api_key = api_key
        self.user = user
        self.home = home or ("/root" if user == "root" else f"/home/{user}")
        self.workdir = workdir
        self.lifetime_margin_s = lifetime_margin_s
        self.create_attempts = max(1, create_attempts)
        self.retry_backoff_s = retry_backoff_s
        self.rate_limit_backoff_s = rate_limit_backoff_s
        self.kill_grace_s = kill_grace_s
        self.allow_out = list(allow_out)
        self.templates = templates
        self.template_builder = TemplateBuilder(
            template_class,
            api_key=api_key,
            agent_layer=agent_layer,
            timeout_s=build_timeout_s,
            log_dir=build_log_dir,
        )
        self._live: set[E2BSandbox] = set()
        self.run_id = run_id
        self.owner = new_owner()
        self._reaping: asyncio.Future[None] | None = None

    @property
    def live(self) -> list[E2BSandbox]:
        return list(self._live)

    async def reap_orphans(self) -> None:
        """Once, before the first start: kill the run's sandboxes another owner left (a server of the same
        ``run_id`` that died hard; see :mod:`.e2b_runs`). A failure to list is logged, never fatal."""
        if self.run_id is None:
            return
        if self._reaping is None:
            self._reaping = asyncio.ensure_future(self._reap())
        await asyncio.shield(self._reaping)

    async def _reap(self) -> None:
        assert self.run_id is not None
        try:
            sandbox_class, owner = self._sdk_class(), self.owner
            killed = await kill_run(sandbox_class, self.run_id, keep_owner=owner, api_key=self.api_key)
        except Exception as exc:  # orphans are E2B's to reap at their timeout; the run goes on
            log.warning("E2B run %s: cannot look for orphaned sandboxes: %s", self.run_id, exc)
            return
        if killed:
            log.warning("E2B run %s: removed what an earlier server left: %s", self.run_id, killed.describe())

    def named_template(self, task: HarborTask) -> str | None:
        """The template named for ``task`` by the options or its task.toml, if any."""
        env: EnvironmentSpec = task.environment
        candidates = [
            self.template_map.get(task.name),
            env.extra.get("e2b_template"),
            self.template_map.get(env.docker_image or ""),
            self.template,
        ]
        return next((str(candidate) for candidate in candidates if candidate), None)

    async def template_for(self, task: HarborTask) -> str:
        """The E2B template ``task`` runs in: the named one, else the one built from its environment
        (built now, or found when prebuilt); raises SandboxStartError."""
        named = self.named_template(task)
        if named is not None:
            return named
        if self.templates == "prebuilt":
            return await self.template_builder.find(task)
        return (await self.template_builder.ensure(task)).name

    def provide(self, agents: Sequence[AgentProvision]) -> None:
        """Put these agents into every template this backend builds or finds from now on (its last layers,
        :mod:`.e2b_templates`); a named template is the user's and gets none (a harness then installs its
        agent per rollout, warning once)."""
        self.template_builder.provide(agents)

    async def prepare(self, task: HarborTask) -> None:
        """The run's orphans reaped (once) and ``task``'s template ready (built once per name)."""
        refuse_sidecars(task, self.name)
        await self.reap_orphans()
        await self.template_for(task)

    async def start(
        self, task: HarborTask, *, lifetime_s: float, env: dict[str, str] | None = None
    ) -> E2BSandbox:
        refuse_sidecars(task, self.name)
        await self.reap_orphans()
        template = await self.template_for(task)
        return await self._launch(task, template, lifetime_s=lifetime_s, env=env)

    async def _launch(
        self, task: HarborTask, template: str, *, lifetime_s: float, env: dict[str, str] | None
    ) -> E2BSandbox:
        """A live sandbox for ``task`` created from ``template`` (or a snapshot's id), with the task's
        directories: what ``start`` and ``start_from`` share."""
        workdir = self.workdir or task.environment.workdir or _dockerfile_workdir(task)
        timeout = math.ceil(sandbox_lifetime(task, lifetime_s, self.lifetime_margin_s))
        sdk_sandbox = await self._create(task, template, timeout, env or {})
        sandbox = E2BSandbox(
            sdk_sandbox,
            workdir=workdir,
            home=self.home,
            env=dict(env or {}),
            user=self.user,
            kill_grace_s=self.kill_grace_s,
            provisioned=frozenset()
            if self.named_template(task) is not None
            else frozenset(agent.name for agent in self.template_builder.spec(task).agents),
            task_name=task.name,
        )
        self._live.add(sandbox)
        sandbox.on_close.append(self._live.discard)
        dirs = ["/logs/agent", "/logs/verifier", "/tests", "/solution", workdir]
        try:
            await sandbox._check("mkdir -p " + " ".join(map(shlex.quote, dirs)), cwd="/")
        except BaseException as exc:
            await sandbox.close()
            if isinstance(exc, SandboxError):
                raise SandboxStartError(f"{task.name}: cannot prepare sandbox {sandbox.id}: {exc}") from exc
            raise
        return sandbox

    async def _create(self, task: HarborTask, template: str, timeout: int, env: dict[str, str]) -> Any:
        create = self._sdk_class().create
        kwargs: dict[str, Any] = {
            "metadata": sandbox_metadata(task.name, self.run_id, self.owner),
            "envs": env,
        }
        if self.api_key:
            kwargs["api_key"] = self.api_key
        if not task.environment.allow_internet:
            kwargs["network"] = {"deny_out": ["0.0.0.0/0"], "allow_out": list(self.allow_out)}
        for attempt in itertools.count(1):
            made = asyncio.ensure_future(create(template=template, timeout=timeout, **kwargs))
            try:
                # Shielded: a rollout cancelled while its create is in flight (the run stopping) must not
                # leave the sandbox E2B made meanwhile; the create runs to its end and what it made is killed.
                return await asyncio.shield(made)
            except asyncio.CancelledError:
                self._in_background(self._reclaim(made))
                raise
            except Exception as exc:  # every failure is classified; unknown ones get one more try
                kind = classify(exc)
                if attempt >= tries_allowed(kind, self.create_attempts):
                    source = f"{'snapshot' if template in self._held else 'template'} {template!r}"
                    raise SandboxStartError(create_failure(task.name, source, attempt, kind, exc)) from exc
                delay = retry_delay_s(
                    kind, attempt, base_s=self.retry_backoff_s, rate_limit_base_s=self.rate_limit_backoff_s
                )
                log.warning(
                    "E2B create for %s failed (try %d/%d, %s, again in %.1fs): %s",
                    task.name,
                    attempt,
                    self.create_attempts,
                    kind,
                    delay,
                    exc,
                )
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _reclaim(self, made: asyncio.Future[Any]) -> None:
        """Once a create whose caller was cancelled ends, kill the sandbox it made, if it made one."""
        try:
            sdk_sandbox = await made
        except Exception:
            return  # it made nothing
        try:
            await sdk_sandbox.kill()
        except Exception as exc:  # the orphan reaper (the run's metadata) finds it on a later start
            log.warning("could not kill sandbox %s, made for a cancelled start: %s", sdk_sandbox, exc)

    async def aclose(self) -> None:
        """Kill every sandbox this backend started that is still open, and those cancelled starts made; then
        delete every snapshot still held, and those cancelled snapshots took."""
        await asyncio.gather(*(sandbox.close() for sandbox in self.live))
        await self.drop_all()
        if self._unclaimed:
            await asyncio.wait(list(self._unclaimed), timeout=60)


def _dockerfile_workdir(task: HarborTask) -> str:
    if task.dockerfile is None:
        return "/app"
    try:
        instructions = dockerfile.parse(task.dockerfile.read_text())
        return dockerfile.plan(instructions, base_env={}, strict=False).workdir
    except (dockerfile.DockerfileError, OSError) as exc:
        raise SandboxStartError(f"{task.name}: cannot read the WORKDIR of {task.dockerfile}: {exc}") from exc
