"""E2B templates built from a task's own environment, once per content hash.

E2B starts sandboxes from templates, not Dockerfiles. For a task whose template nobody named, the E2B
backend builds one from ``environment/Dockerfile`` (else from ``[environment] docker_image``) with the
SDK's template API: ``AsyncTemplate(file_context_path=environment/).from_dockerfile(text)`` (or
``.from_image(image)``), then ``AsyncTemplate.build(template, name=…)``.

Naming (pure, :func:`template_spec`): ``ht-`` + the first 16 hex digits of a sha256 over everything that
decides the template: the Dockerfile's text (or the image), every file under ``environment/`` (path,
executable bit, bytes: the build context COPY reads from), the resources asked for (``cpus`` rounded up
to whole CPUs, ``memory_mb``), the agent layer (a shell command run as root after the Dockerfile,
e.g. a pinned agent install; empty for none) and the provisioned agents (each bundle's name, which pins its
content, and its setup; none: the key is absent, so templates made before agents existed keep their
names). Tasks with identical environments share one template; a change to any file in the context is a
new template.

Agents (``TemplateBuilder.provide``) are the template's last layers: each bundle copied to its
``AgentProvision.path`` (from a staging context, :mod:`.e2b_staging`), then its setup run as root.

Dockerfiles are converted by the SDK itself. As of SDK 2.63 its converter raises on multi-stage builds,
``COPY --from`` and ``ADD <url>``, drops ``EXPOSE``, ``VOLUME``, ``LABEL`` and ``MAINTAINER`` as metadata,
and prints-and-drops any other instruction it does not handle (``SHELL``, ``HEALTHCHECK``,
``STOPSIGNAL``, ``ONBUILD``…). Both kinds fail here with :class:`UnsupportedDockerfile`, naming the task,
the instruction and its line: a task relying on a dropped instruction would silently run differently.
The SDK's other remarks (RUN flags such as ``--mount`` it ignores) go to the build log.

Building (:class:`TemplateBuilder`): ``ensure(task)`` builds each name at most once per process: callers
for one name queue on one lock, and the first asks E2B (``AsyncTemplate.exists``) before building, so a
template another process built is reused. E2B registers a name when its build is *requested*, so two
processes racing on one name end with one build used by both, unless both asked before either requested
(then two builds of identical content under one name). E2B's check cannot tell a failed or unfinished
build from a ready one: such a name is reused, and creating a sandbox from it fails at create time;
``rebuild=True`` (``harness-trainer e2b build-templates --rebuild``) builds without asking. Each build's
log goes to ``log_dir/<name>.log`` and stays in ``logs[name]``. A build is bounded by the task's
``build_timeout_sec`` (else ``timeout_s``): :class:`TemplateBuildTimeout`. A failed build raises
:class:`TemplateBuildError` naming the task and, when E2B's log names the failing step, that step and its
Dockerfile line; the failure is remembered for the name (no second build of a broken environment in this
process), while a timeout or an API error (a refused request or upload: the SDK raises ``BuildException``
for those too, before it logs that the build runs) is only passed to the callers already queued.

The SDK boundary is ``template_class`` (default ``e2b.AsyncTemplate``): its constructor and its
``exists`` and ``build`` classmethods, with the SDK's signatures; tests inject a fake.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import harness_trainer.sandboxes.dockerfile as dockerfile
from harness_trainer.sandboxes.base import AgentProvision, SandboxStartError
from harness_trainer.sandboxes.e2b_sdk import sdk
from harness_trainer.sandboxes.e2b_staging import AGENTS_IN_CONTEXT, staging_context
from harness_trainer.tasks.task import HarborTask

NAME_PREFIX = "ht-"
DEFAULT_BUILD_TIMEOUT_S = 1800.0
TRIGGERED = "Waiting for logs..."  # what AsyncTemplate.build logs once E2B accepted and started the build
# What the SDK's Dockerfile converter handles (2.63); it drops the metadata-only ones on purpose.
SDK_INSTRUCTIONS = frozenset(
    {"FROM", "RUN", "COPY", "ADD", "WORKDIR", "USER", "ENV", "ARG", "CMD", "ENTRYPOINT"}
)
SDK_METADATA = frozenset({"EXPOSE", "VOLUME", "LABEL", "MAINTAINER"})
_STEP = re.compile(r"^(?:CACHED\s+)?\[(?:builder \d+/\d+|base)\]\s+(.+?)(?:\s+\[[0-9a-f]{12,}\])?\s*$")


class TemplateError(SandboxStartError):
    """A task's E2B template cannot be named, converted, found or built."""


class UnsupportedDockerfile(TemplateError):
    """The Dockerfile uses something E2B templates cannot express; names the task, instruction and line."""


class TemplateMissing(TemplateError):
    """Prebuilt mode: the task's template does not exist in E2B."""


class TemplateBuildTimeout(TemplateError):
    """The build did not finish within its timeout (it may still finish in E2B)."""


class TemplateBuildError(TemplateError):
    """E2B reported the build as failed."""

    def __init__(self, message: str, *, step: str | None = None, line: int | None = None) -> None:
        super().__init__(message)
        self.step = step  # the failing step as E2B's log names it, e.g. "RUN pip install x"
        self.line = line  # its Dockerfile line, when it maps to one


@dataclass(frozen=True)
class TemplateSpec:
    """Everything that decides a task's template, and the name derived from it."""

    task: str
    name: str
    digest: str
    dockerfile: str | None  # the Dockerfile's text, or None for an image-only task
    image: str | None
    context: Path
    cpu_count: int | None
    memory_mb: int | None
    agent_layer: str
    agents: tuple[AgentProvision, ...] = ()


@dataclass(frozen=True)
class TemplateBuild:
    """What :meth:`TemplateBuilder.ensure` did for a name: ``built`` it now, or ``reused`` one in E2B."""

    name: str
    status: Literal["built", "reused"]
    seconds: float = 0.0
    log_path: Path | None = None


def context_files(folder: Path) -> list[tuple[str, str, str]]:
    """``(relative path, kind, sha256)`` of every file under ``folder``, sorted. The kind is ``link`` (hashed
    by its target), ``exec`` or ``file``: only the executable bit counts, as git keeps only that one, so
    checkouts under different umasks name the same template."""
    entries = []
    for path in sorted(folder.rglob("*")) if folder.is_dir() else []:
        if path.is_symlink():
            kind, data = "link", os.readlink(path).encode()
        elif path.is_file():
            kind, data = ("exec" if os.access(path, os.X_OK) else "file"), path.read_bytes()
        else:
            continue
        entries.append((path.relative_to(folder).as_posix(), kind, hashlib.sha256(data).hexdigest()))
    return entries


def template_spec(
    task: HarborTask, agent_layer: str = "", agents: tuple[AgentProvision, ...] = ()
) -> TemplateSpec:
    """The template ``task`` needs (see the module docstring); raises :class:`TemplateError` when the task
    has neither a Dockerfile nor a ``docker_image``, or its build context cannot be read."""
    env = task.environment
    try:
        text = task.dockerfile.read_text() if task.dockerfile is not None else None
        files = context_files(task.environment_dir)
    except OSError as exc:
        raise TemplateError(f"{task.name}: cannot read its environment for an E2B template: {exc}") from exc
    image = None if text is not None else env.docker_image
    if text is None and not image:
        raise TemplateError(
            f"{task.name}: no environment/Dockerfile and no [environment] docker_image to build an E2B "
            "template from; name one (template=, template_map= or [environment] e2b_template)"
        )
    cpu_count = math.ceil(env.cpus) if env.cpus else None  # E2B gives whole CPUs
    decided = {
        "dockerfile": text,
        "image": image,
        "context": files,
        "cpu_count": cpu_count,
        "memory_mb": env.memory_mb,
        "agent_layer": agent_layer,
    }
    if agents:
        decided["agents"] = [[agent.name, agent.setup] for agent in agents]
    digest = hashlib.sha256(json.dumps(decided, sort_keys=True).encode()).hexdigest()
    return TemplateSpec(
        task=task.name,
        name=NAME_PREFIX + digest[:16],
        digest=digest,
        dockerfile=text,
        image=image,
        context=task.environment_dir,
        cpu_count=cpu_count,
        memory_mb=env.memory_mb,
        agent_layer=agent_layer,
        agents=agents,
    )


def check_dockerfile(text: str, task: str) -> None:
    """Raise :class:`UnsupportedDockerfile` for what the SDK's converter would drop or cannot parse."""
    from e2b_dockerfile_utils import DockerfileSyntaxError, parse_dockerfile_ast

    try:
        instructions = parse_dockerfile_ast(text).instructions
    except DockerfileSyntaxError as exc:
        raise UnsupportedDockerfile(f"{task}: Dockerfile: {exc}") from exc
    for ins in instructions:
        if ins.name not in SDK_INSTRUCTIONS | SDK_METADATA:
            raise UnsupportedDockerfile(
                f"{task}: Dockerfile line {ins.start_line}: {ins.name} cannot be expressed in an E2B "
                f"template (the SDK's converter would drop it); it handles "
                f"{', '.join(sorted(SDK_INSTRUCTIONS))}"
            )


def sdk_template(
    spec: TemplateSpec, template_class: Any, context: Path | None = None
) -> tuple[Any, list[str]]:
    """The SDK template object for ``spec`` (built from ``context``, default the task's environment folder;
    a :func:`staging_context` for a spec with agents), and the remarks the SDK's converter printed while
    making it; raises :class:`UnsupportedDockerfile` for a Dockerfile E2B cannot express."""
    from e2b import SandboxException

    remarks = io.StringIO()
    try:
        template = template_class(file_context_path=str(context or spec.context))
        with contextlib.redirect_stdout(remarks):  # the converter prints what it ignores
            if spec.dockerfile is not None:
                check_dockerfile(spec.dockerfile, spec.task)
                builder = template.from_dockerfile(spec.dockerfile)
            else:
                builder = template.from_image(spec.image)
            if spec.agent_layer:
                builder = builder.run_cmd(spec.agent_layer, user="root")
            for agent in spec.agents:
                builder = builder.copy(f"{AGENTS_IN_CONTEXT}/{agent.name}", agent.path + "/", user="root")
                if agent.setup:
                    builder = builder.run_cmd(agent.setup, user="root")
    except (ValueError, SandboxException) as exc:  # DockerfileSyntaxError is a ValueError
        raise UnsupportedDockerfile(f"{spec.task}: Dockerfile cannot become an E2B template: {exc}") from exc
    return builder, [line for line in remarks.getvalue().splitlines() if line.strip()]


def failing_step(log: list[str]) -> str | None:
    """The last build step E2B's log announced (``[builder 3/7] RUN …`` → ``RUN …``): the one that failed
    when the build failed."""
    for line in reversed(log):
        message = line.split("] ", 2)[-1] if line.startswith("[") else line  # drop "[time] [level] "
        match = _STEP.match(message.strip())
        if match:
            return match.group(1)
    return None


def dockerfile_line(text: str, step: str) -> int | None:
    """The line of the Dockerfile instruction E2B's step ``step`` came from, when one matches exactly
    (whitespace aside)."""

    def squash(value: str) -> str:
        return " ".join(value.split())

    wanted = squash(step)
    for ins in dockerfile.parse(text):
        if squash(f"{ins.keyword} {ins.args}") == wanted:
            return ins.line
    return None


def default_log_dir() -> Path:
    """``$HARNESS_TRAINER_CACHE/e2b-templates`` (default ``~/.cache/harness-trainer/e2b-templates``)."""
    root = os.environ.get("HARNESS_TRAINER_CACHE") or Path.home() / ".cache" / "harness-trainer"
    return Path(root) / "e2b-templates"


@dataclass
class _Failure:
    error: TemplateError
    at: float
    final: bool  # a failed build (deterministic), not a timeout or an API error


class TemplateBuilder:
    """Builds (or finds) tasks' templates in E2B; see the module docstring. ``api_key`` is passed to every
    SDK call when set (else the SDK reads ``E2B_API_KEY``); ``log_dir`` defaults to
    :func:`default_log_dir`."""

    def __init__(
        self,
        template_class: Any = None,
        *,
        api_key: str | None = None,
        agent_layer: str = "",
        timeout_s: float = DEFAULT_BUILD_TIMEOUT_S,
        log_dir: Path | None = None,
        rebuild: bool = False,
    ) -> None:
        self.template_class = template_class
        self.api_key = api_key
        self.agent_layer = agent_layer
        self.timeout_s = timeout_s
        self.log_dir = log_dir or default_log_dir()
        self.rebuild = rebuild
        self.logs: dict[str, list[str]] = {}
        self.agents: tuple[AgentProvision, ...] = ()
        self._specs: dict[tuple[Path, str], TemplateSpec] = {}
        self._ready: dict[str, TemplateBuild] = {}
        self._failed: dict[str, _Failure] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def provide(self, agents: Sequence[AgentProvision]) -> None:
        """Put these agents into every template built or found from now on (a new name for each)."""
        merged = {agent.name: agent for agent in (*self.agents, *agents)}
        provided = tuple(merged[name] for name in sorted(merged))
        if provided != self.agents:
            self.agents = provided
            self._specs.clear()

    def spec(self, task: HarborTask) -> TemplateSpec:
        """The task's :class:`TemplateSpec`, hashed once per task (folder and name: a verifier's own)."""
        key = (task.path, task.name)
        if key not in self._specs:
            self._specs[key] = template_spec(task, self.agent_layer, self.agents)
        return self._specs[key]

    @property
    def _sdk(self) -> Any:
        if self.template_class is None:
            self.template_class = sdk().AsyncTemplate
        return self.template_class

    @property
    def _api(self) -> dict[str, Any]:
        return {"api_key": self.api_key} if self.api_key else {}

    async def find(self, task: HarborTask) -> str:
        """The task's template name if it exists in E2B; never builds (raises :class:`TemplateMissing`)."""
        spec = self.spec(task)
        if spec.name in self._ready:
            return spec.name
        if not await self._exists(spec):
            raise TemplateMissing(
                f"{task.name}: E2B template {spec.name} (built from its environment) does not exist and "
                "templates are prebuilt only: run `harness-trainer e2b build-templates DATASET` first, or "
                "let the backend build it (templates='build')"
            )
        self._ready[spec.name] = TemplateBuild(spec.name, "reused")
        return spec.name

    async def ensure(self, task: HarborTask) -> TemplateBuild:
        """The task's template, built unless this process or E2B has it; see the module docstring."""
        spec = self.spec(task)
        if spec.name in self._ready:
            return self._ready[spec.name]
        arrived = time.monotonic()
        async with self._locks.setdefault(spec.name, asyncio.Lock()):
            if spec.name in self._ready:
                return self._ready[spec.name]
            failure = self._failed.get(spec.name)
            if failure is not None and (failure.final or failure.at >= arrived):
                raise failure.error
            try:
                if not self.rebuild and await self._exists(spec):
                    self._ready[spec.name] = TemplateBuild(spec.name, "reused")
                else:
                    self._ready[spec.name] = await self._build(spec, task)
            except TemplateError as exc:
                final = isinstance(exc, (TemplateBuildError, UnsupportedDockerfile))
                self._failed[spec.name] = _Failure(exc, time.monotonic(), final)
                raise
            return self._ready[spec.name]

    async def _exists(self, spec: TemplateSpec) -> bool:
        try:
            return bool(await self._sdk.exists(spec.name, **self._api))
        except Exception as exc:  # network, auth: the start fails, the next one asks again
            raise TemplateError(
                f"{spec.task}: cannot ask E2B whether template {spec.name} exists: {exc}"
            ) from exc

    async def _build(self, spec: TemplateSpec, task: HarborTask) -> TemplateBuild:
        context = None
        if spec.agents:
            try:
                context = await asyncio.to_thread(
                    staging_context, spec, self.log_dir / "contexts" / spec.name
                )
            except OSError as exc:
                raise TemplateError(
                    f"{spec.task}: cannot stage the agents for template {spec.name}: {exc}"
                ) from exc
        template, remarks = sdk_template(spec, self._sdk, context)
        log = self.logs[spec.name] = [f"task {spec.task}: {remark}" for remark in remarks]
        log_path = self.log_dir / f"{spec.name}.log"
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TemplateError(f"{spec.task}: cannot keep the build log in {self.log_dir}: {exc}") from exc
        timeout = task.environment.build_timeout_sec or self.timeout_s
        started = time.monotonic()
        with log_path.open("w") as sink:
            sink.writelines(line + "\n" for line in log)

            def on_log(entry: Any) -> None:
                log.append(str(entry))
                sink.write(f"{entry}\n")
                sink.flush()

            try:
                await asyncio.wait_for(self._request(spec, template, on_log), timeout)
            except TimeoutError:
                raise TemplateBuildTimeout(
                    f"{spec.task}: E2B template {spec.name} did not finish building in {timeout:g} s "
                    f"(it may still finish in E2B; build log: {log_path})"
                ) from None
            except TemplateError:
                raise
            except Exception as exc:
                raise self._failure(spec, exc, log, log_path) from exc
        return TemplateBuild(spec.name, "built", time.monotonic() - started, log_path)

    async def _request(self, spec: TemplateSpec, template: Any, on_log: Callable[[Any], None]) -> None:
        resources = {"cpu_count": spec.cpu_count, "memory_mb": spec.memory_mb}
        await self._sdk.build(
            template,
            name=spec.name,
            on_build_logs=on_log,
            **{key: value for key, value in resources.items() if value is not None},
            **self._api,
        )

    def _failure(self, spec: TemplateSpec, exc: Exception, log: list[str], log_path: Path) -> TemplateError:
        from e2b import BuildException

        # The SDK raises BuildException for a refused request too; only once it logged that it waits for
        # the build's logs did E2B run the build.
        if not isinstance(exc, BuildException) or not any(TRIGGERED in line for line in log):
            return TemplateError(
                f"{spec.task}: E2B did not build template {spec.name}: {exc} (log: {log_path})"
            )
        step = failing_step(log)
        line = dockerfile_line(spec.dockerfile, step) if step and spec.dockerfile else None
        if step is None:
            where = ""
        elif spec.agent_layer and step.split() == f"RUN {spec.agent_layer}".split():
            where = " in the agent layer"
        elif any(agent.setup and step.split() == f"RUN {agent.setup}".split() for agent in spec.agents):
            where = f" setting up an agent ({step[:300]})"
        elif line is not None:
            where = f" at Dockerfile line {line} ({step[:300]})"
        else:
            where = f" at step {step[:300]}"
        return TemplateBuildError(
            f"{spec.task}: E2B template {spec.name} failed to build{where}: {exc} (build log: {log_path})",
            step=step,
            line=line,
        )


@dataclass
class DatasetBuild:
    """What :func:`build_all` did: template names built and reused, and failures by name (or by task,
    for a task whose template could not even be named)."""

    built: list[str]
    reused: list[str]
    failed: dict[str, str]
    named: list[str]  # tasks that name their own template ([environment] e2b_template): nothing to build


async def build_all(
    tasks: list[HarborTask],
    builder: TemplateBuilder,
    *,
    jobs: int = 4,
    on_planned: Callable[[int], None] | None = None,
    on_done: Callable[[str, list[str], TemplateBuild | TemplateError], None] | None = None,
) -> DatasetBuild:
    """Build (or find) every distinct template ``tasks`` need, ``jobs`` at a time; ``on_planned(count)``
    is called once they are known, ``on_done(name, task names, result or error)`` as each finishes. Never
    raises for one template's failure."""
    result = DatasetBuild(built=[], reused=[], failed={}, named=[])
    by_name: dict[str, list[HarborTask]] = {}
    for task in tasks:
        if task.environment.extra.get("e2b_template"):
            result.named.append(task.name)
            continue
        try:
            by_name.setdefault(builder.spec(task).name, []).append(task)
        except TemplateError as exc:
            result.failed[task.name] = str(exc)
            if on_done is not None:
                on_done(task.name, [task.name], exc)
    if on_planned is not None:
        on_planned(len(by_name))
    limit = asyncio.Semaphore(max(1, jobs))

    async def one(name: str, group: list[HarborTask]) -> None:
        async with limit:
            try:
                done: TemplateBuild | TemplateError = await builder.ensure(group[0])
            except TemplateError as exc:
                done = exc
        if isinstance(done, TemplateError):
            result.failed[name] = str(done)
        else:
            (result.built if done.status == "built" else result.reused).append(name)
        if on_done is not None:
            on_done(name, [task.name for task in group], done)

    await asyncio.gather(*(one(name, group) for name, group in by_name.items()))
    return result
