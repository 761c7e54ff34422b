"""E2B templates built from tasks' environments, against the fake cloud (whose builds really apply the
steps): naming, one build per name, failures, timeouts, precedence, prebuilt mode, the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("e2b")

from e2b import AsyncTemplate, BuildException
from e2b.template.types import BuildInfo

from harness_trainer.cli import build_parser
from harness_trainer.harnesses import mini_swe_agent, opencode
from harness_trainer.harnesses.base import HarnessError
from harness_trainer.harnesses.bundles import bundle_entry, bundle_name, install_agent, provision
from harness_trainer.harnesses.tools import agent_layer, install_tool
from harness_trainer.launch.config_file import apply_config
from harness_trainer.sandboxes.base import SandboxStartError
from harness_trainer.sandboxes.e2b import E2BSandbox, E2BSandboxBackend
from harness_trainer.sandboxes.e2b_templates import (
    SDK_INSTRUCTIONS,
    SDK_METADATA,
    TemplateBuilder,
    TemplateBuildError,
    TemplateBuildTimeout,
    TemplateMissing,
    UnsupportedDockerfile,
    dockerfile_line,
    failing_step,
    template_spec,
)
from harness_trainer.tasks.task import HarborTask
from tests.harnesses.test_tools import FAKE, FAKE_NPM
from tests.sandboxes.conftest import TaskFactory
from tests.sandboxes.fake_e2b import FakeE2BCloud

pytestmark = pytest.mark.docker  # the fake E2B cloud runs images exported from the Docker daemon

DOCKERFILE = """FROM python:3.11-slim
ENV GREETING=hello
WORKDIR /app
COPY data.txt /app/
RUN echo built > /app/marker && echo "$GREETING" > /app/greeting
"""


@pytest.fixture
def cloud(tmp_path: Path) -> FakeE2BCloud:
    return FakeE2BCloud(tmp_path / "e2b")


def make_backend(cloud: FakeE2BCloud, tmp_path: Path, **options: Any) -> E2BSandboxBackend:
    defaults: dict[str, Any] = {
        "retry_backoff_s": 0.01,
        "kill_grace_s": 0.3,
        "build_log_dir": tmp_path / "logs",
    }
    return E2BSandboxBackend(sandbox_class=cloud, template_class=cloud.template_class, **(defaults | options))


@pytest.fixture
async def backend(cloud: FakeE2BCloud, tmp_path: Path) -> AsyncIterator[E2BSandboxBackend]:
    started = make_backend(cloud, tmp_path)
    yield started
    await started.aclose()


def test_the_name_is_a_content_hash_shared_by_identical_environments(make_task: TaskFactory) -> None:
    first = template_spec(make_task(DOCKERFILE, files={"data.txt": "x"}, cpus=2, memory_mb=2048))
    same = template_spec(make_task(DOCKERFILE, files={"data.txt": "x"}, cpus=2, memory_mb=2048))
    assert re.fullmatch(r"ht-[0-9a-f]{16}", first.name)
    assert first.name == same.name and first.task != same.task
    assert first.cpu_count == 2 and first.memory_mb == 2048
    others = [
        make_task(DOCKERFILE, files={"data.txt": "x"}, cpus=4, memory_mb=2048),
        make_task(DOCKERFILE, files={"data.txt": "x"}, cpus=2, memory_mb=4096),
        make_task(DOCKERFILE + "RUN true\n", files={"data.txt": "x"}, cpus=2, memory_mb=2048),
        make_task(docker_image="python:3.11-slim"),
    ]
    names = {template_spec(task).name for task in others}
    names.add(
        template_spec(make_task(DOCKERFILE, files={"data.txt": "x"}, cpus=2, memory_mb=2048), "layer").name
    )
    assert len(names) == 5 and first.name not in names


def test_a_change_to_a_context_file_changes_the_name(make_task: TaskFactory) -> None:
    before = template_spec(make_task(DOCKERFILE, files={"data.txt": "x", "sub/deep.txt": "1"}))
    assert (
        before.name != template_spec(make_task(DOCKERFILE, files={"data.txt": "x", "sub/deep.txt": "2"})).name
    )
    assert (
        before.name != template_spec(make_task(DOCKERFILE, files={"data.txt": "x", "sub/new.txt": "1"})).name
    )
    executable = make_task(DOCKERFILE, files={"data.txt": "x", "sub/deep.txt": "1"})
    (executable.environment_dir / "data.txt").chmod(0o755)
    assert template_spec(executable).name != before.name
    other_umask = make_task(DOCKERFILE, files={"data.txt": "x", "sub/deep.txt": "1"})
    (other_umask.environment_dir / "data.txt").chmod(0o664)  # git keeps only the executable bit
    assert template_spec(other_umask).name == before.name


async def test_a_sandbox_of_a_built_template_has_the_environment(
    backend: E2BSandboxBackend, cloud: FakeE2BCloud, make_task: TaskFactory, tmp_path: Path
) -> None:
    task = make_task(DOCKERFILE, files={"data.txt": "from the context\n"})
    sandbox = await backend.start(task, lifetime_s=60)
    try:
        result = await sandbox.exec("cat marker greeting data.txt; echo $GREETING")
    finally:
        await sandbox.close()
    assert result.stdout == "built\nhello\nfrom the context\nhello\n"
    name = template_spec(task).name
    assert cloud.create_calls[0]["template"] == name and len(cloud.template_class.builds) == 1
    log = (tmp_path / "logs" / f"{name}.log").read_text()
    assert "[builder" in log and "RUN echo built" in log
    assert backend.template_builder.logs[name] == log.splitlines()


async def test_64_concurrent_starts_build_one_template(
    backend: E2BSandboxBackend, cloud: FakeE2BCloud, make_task: TaskFactory
) -> None:
    tasks = [make_task(DOCKERFILE, files={"data.txt": "x"}) for _ in range(64)]
    sandboxes = await asyncio.gather(*(backend.start(task, lifetime_s=60) for task in tasks))
    try:
        assert len(cloud.template_class.build_calls) == 1
        assert len(cloud.template_class.exists_calls) == 1  # the others waited for the first, then knew
        assert {call["template"] for call in cloud.create_calls} == {template_spec(tasks[0]).name}
        assert (await sandboxes[-1].exec("cat /app/marker")).stdout == "built\n"
    finally:
        await asyncio.gather(*(sandbox.close() for sandbox in sandboxes))


async def test_two_processes_on_one_account_share_one_build(
    cloud: FakeE2BCloud, make_task: TaskFactory, tmp_path: Path
) -> None:
    first, second = (make_backend(cloud, tmp_path, create_attempts=8) for _ in range(2))
    tasks = [make_task(DOCKERFILE, files={"data.txt": "x"}) for _ in range(2)]
    name = template_spec(tasks[0]).name
    try:
        starting = asyncio.ensure_future(first.start(tasks[0], lifetime_s=60))
        while name not in cloud.templates:  # the second process asks once the first requested its build
            await asyncio.sleep(0.001)
        sandboxes: list[E2BSandbox] = [await second.start(tasks[1], lifetime_s=60), await starting]
        for sandbox in sandboxes:
            assert (await sandbox.exec("cat /app/marker")).stdout == "built\n"
        third = make_backend(cloud, tmp_path)
        assert (await third.template_builder.ensure(tasks[0])).status == "reused"
    finally:
        await first.aclose()
        await second.aclose()
    assert len(cloud.template_class.build_calls) == 1


async def test_a_failed_build_names_the_task_and_instruction_and_others_still_build(
    backend: E2BSandboxBackend, cloud: FakeE2BCloud, make_task: TaskFactory
) -> None:
    broken = make_task(
        "FROM python:3.11-slim\nWORKDIR /app\n\nRUN echo compiling && \\\n    exit 3\n", name="broken"
    )
    with pytest.raises(TemplateBuildError) as failed:
        await backend.start(broken, lifetime_s=60)
    message = str(failed.value)
    assert "broken" in message and "Dockerfile line 4" in message and "exit 3" in message
    assert "exit status 3" in message and failed.value.line == 4
    assert isinstance(failed.value, SandboxStartError)
    sandbox = await backend.start(make_task(DOCKERFILE, files={"data.txt": "x"}), lifetime_s=60)
    await sandbox.close()
    with pytest.raises(TemplateBuildError):  # remembered: a broken environment is not built twice
        await backend.start(make_task(broken.dockerfile.read_text(), name="broken-too"), lifetime_s=60)
    assert len(cloud.template_class.build_calls) == 2


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('FROM python:3.11-slim\nRUN true\nSHELL ["/bin/bash", "-c"]\n', "line 3: SHELL"),
        ("FROM python:3.11-slim\nHEALTHCHECK CMD true\n", "line 2: HEALTHCHECK"),
        ("FROM python:3.11 AS build\nRUN true\nFROM python:3.11-slim\n", "Multi-stage"),
        ("FROM python:3.11-slim\nCOPY --from=build /x /x\n", "line 2: COPY --from"),
        ("FROM python:3.11-slim\nADD https://example.com/x.tgz /x\n", "line 2: ADD from a remote URL"),
    ],
)
async def test_what_e2b_cannot_express_fails_naming_the_instruction_and_the_task(
    backend: E2BSandboxBackend, cloud: FakeE2BCloud, make_task: TaskFactory, text: str, named: str
) -> None:
    with pytest.raises(UnsupportedDockerfile, match=re.escape(named)) as refused:
        await backend.start(make_task(text, name="odd"), lifetime_s=60)
    assert "odd" in str(refused.value)
    assert not cloud.template_class.build_calls


def test_the_refused_instructions_are_those_the_sdk_drops(capsys: pytest.CaptureFixture[str]) -> None:
    for keyword in ("SHELL", "HEALTHCHECK", "STOPSIGNAL", "ONBUILD", *SDK_METADATA):
        AsyncTemplate().from_dockerfile(f"FROM python:3.11-slim\n{keyword} x y\n")
        dropped = f"Unsupported instruction: {keyword}" in capsys.readouterr().out
        assert dropped == (keyword not in SDK_METADATA)
    for keyword in SDK_INSTRUCTIONS - {"FROM"}:
        with contextlib.suppress(Exception):  # some want other arguments; none may be dropped
            AsyncTemplate().from_dockerfile(f"FROM python:3.11-slim\n{keyword} x y\n")
        assert "Unsupported instruction" not in capsys.readouterr().out


async def test_a_hanging_build_times_out_with_a_clear_error_and_is_tried_again(
    backend: E2BSandboxBackend, cloud: FakeE2BCloud, make_task: TaskFactory
) -> None:
    cloud.template_class.hang_builds = True
    task = make_task(DOCKERFILE, files={"data.txt": "x"}, build_timeout_sec=0.3, name="slow")
    with pytest.raises(
        TemplateBuildTimeout, match=r"slow: E2B template ht-\w+ did not finish building in 0.3 s"
    ):
        await backend.start(task, lifetime_s=60)
    backend.template_builder.rebuild = True  # E2B registered the name: only a rebuild gets past it
    cloud.template_class.hang_builds = False
    patient = make_task(DOCKERFILE, files={"data.txt": "x"}, build_timeout_sec=120)  # the same template
    assert template_spec(patient).name == template_spec(task).name
    sandbox = await backend.start(patient, lifetime_s=60)
    await sandbox.close()
    assert len(cloud.template_class.build_calls) == 2


async def test_a_build_timing_out_mid_step_leaves_nothing_running(
    backend: E2BSandboxBackend, make_task: TaskFactory
) -> None:
    task = make_task("FROM python:3.11-slim\nRUN sleep 30\n", build_timeout_sec=0.5)
    with pytest.raises(TemplateBuildTimeout):
        await backend.start(task, lifetime_s=60)
    # the autouse fixture checks that no namespace (and so no `sleep 30`) is left running


async def test_an_api_failure_is_not_remembered(
    backend: E2BSandboxBackend, cloud: FakeE2BCloud, make_task: TaskFactory
) -> None:
    cloud.template_class.fail_requests.append(BuildException("API error: 503 Service Unavailable"))
    task = make_task(DOCKERFILE, files={"data.txt": "x"})
    with pytest.raises(SandboxStartError, match=r"did not build template .*503") as failed:
        await backend.start(task, lifetime_s=60)
    assert not isinstance(failed.value, TemplateBuildError)
    sandbox = await backend.start(task, lifetime_s=60)
    await sandbox.close()


async def test_a_named_template_wins_over_building(
    backend: E2BSandboxBackend, cloud: FakeE2BCloud, make_task: TaskFactory
) -> None:
    task = make_task(DOCKERFILE, files={"data.txt": "x"}, extra={"e2b_template": "their-own"})
    sandbox = await backend.start(task, lifetime_s=60)
    await sandbox.close()
    assert cloud.create_calls[0]["template"] == "their-own"
    assert not cloud.template_class.build_calls and not cloud.template_class.exists_calls


async def test_prebuilt_mode_fails_fast_naming_the_missing_template_then_uses_a_built_one(
    cloud: FakeE2BCloud, make_task: TaskFactory, tmp_path: Path
) -> None:
    prebuilt = make_backend(cloud, tmp_path, templates="prebuilt")
    task = make_task(DOCKERFILE, files={"data.txt": "x"}, name="needs-one")
    name = template_spec(task).name
    with pytest.raises(TemplateMissing, match=f"needs-one: E2B template {name} .*e2b build-templates"):
        await prebuilt.start(task, lifetime_s=60)
    assert not cloud.template_class.build_calls and not cloud.create_calls
    await make_backend(cloud, tmp_path).template_builder.ensure(task)  # e.g. by the CLI
    sandbox = await prebuilt.start(task, lifetime_s=60)
    await sandbox.close()
    assert cloud.create_calls[-1]["template"] == name
    with pytest.raises(ValueError, match="templates must be"):
        make_backend(cloud, tmp_path, templates="sometimes")


async def test_every_template_call_binds_to_the_real_sdk_signatures(
    cloud: FakeE2BCloud, make_task: TaskFactory, tmp_path: Path
) -> None:
    backend = make_backend(cloud, tmp_path, api_key="e2b_test", agent_layer="echo layer > /root/layer")
    task = make_task(DOCKERFILE, files={"data.txt": "x"}, cpus=1.5, memory_mb=1024)
    sandbox = await backend.start(task, lifetime_s=60)
    try:
        assert (await sandbox.exec("cat /root/layer")).stdout == "layer\n"
    finally:
        await sandbox.close()
    fake = cloud.template_class
    for call in fake.init_calls:
        inspect.signature(AsyncTemplate.__init__).bind(None, **call)
    for call in fake.exists_calls:
        inspect.signature(AsyncTemplate.exists).bind(**call)
    (build,) = fake.build_calls
    inspect.signature(AsyncTemplate.build).bind(**build)
    assert build["name"] == template_spec(task, "echo layer > /root/layer").name and "alias" not in build
    assert build["cpu_count"] == 2 and build["memory_mb"] == 1024 and build["api_key"] == "e2b_test"
    info = await fake.build(AsyncTemplate().from_image("python:3"), name="ht-direct")
    assert isinstance(info, BuildInfo) and await fake.exists("ht-direct") is True


def test_failing_steps_are_read_from_e2b_logs() -> None:
    log = [
        "[2025-11-08T07:40:59+00:00] [info] [base] FROM node:24 [deb1334053b829ccb461f9b715634edd3d963b75]",
        "[2025-11-08T07:40:59+00:00] [info] CACHED [builder 46/66] COPY path/to/file /app/path/to/file",
        "[2025-11-08T07:41:02+00:00] [info] [builder 47/66] RUN make   all",
        "[2025-11-08T07:41:09+00:00] [error] Build failed: exit status 2",
    ]
    assert failing_step(log) == "RUN make   all"
    assert failing_step(log[:1]) == "FROM node:24"
    assert failing_step(["[t] [info] nothing here"]) is None
    assert dockerfile_line("FROM node:24\n# build\nRUN make \\\n  all\n", "RUN make   all") == 3


def write_dataset(root: Path) -> Path:
    """train/{a,b} share an environment, train/c fails to build, train/d names its own template."""
    for name, dockerfile, toml in [
        ("a", DOCKERFILE, ""),
        ("b", DOCKERFILE, ""),
        ("c", "FROM python:3.11-slim\nRUN exit 1\n", ""),
        ("d", "FROM python:3.11-slim\n", '[environment]\ne2b_template = "theirs"\n'),
    ]:
        folder = root / "train" / name
        (folder / "environment").mkdir(parents=True)
        (folder / "tests").mkdir()
        (folder / "task.toml").write_text('version = "1.0"\n' + toml)
        (folder / "instruction.md").write_text("do it\n")
        (folder / "tests" / "test.sh").write_text("#!/bin/bash\n")
        (folder / "environment" / "Dockerfile").write_text(dockerfile)
        (folder / "environment" / "data.txt").write_text("x")
    return root


def run_cli(argv: list[str], cloud: FakeE2BCloud) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args, template_class=cloud.template_class))


def test_the_cli_needs_an_api_key_before_anything_else(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], cloud: FakeE2BCloud
) -> None:
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    assert run_cli(["e2b", "build-templates", "/no/such/dataset"], cloud) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "E2B_API_KEY" in err
    assert not cloud.template_class.exists_calls


def test_the_cli_builds_each_distinct_template_of_a_dataset(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], cloud: FakeE2BCloud, tmp_path: Path
) -> None:
    monkeypatch.setenv("E2B_API_KEY", "e2b_test")
    dataset = write_dataset(tmp_path / "dataset")
    argv = ["e2b", "build-templates", str(dataset), "--split", "train", "--log-dir", str(tmp_path / "logs")]
    assert run_cli(argv, cloud) == 1
    out = capsys.readouterr().out
    assert "1 built, 0 reused, 1 failed, 1 tasks name their own template" in out
    assert re.search(r"built ht-\w+ in [\d.]+ s \(a, b\)", out)
    assert re.search(r"FAILED ht-\w+ \(c\): c: E2B template .* failed to build at Dockerfile line 2", out)
    assert len(cloud.template_class.build_calls) == 2
    # E2B registers a name when its build is requested: its check cannot tell c's failed build from a
    # ready one, so a second run counts it as reused; --rebuild is the way out.
    assert run_cli(argv, cloud) == 0
    assert "0 built, 2 reused, 0 failed" in capsys.readouterr().out
    assert run_cli([*argv, "--rebuild"], cloud) == 1
    assert "1 built, 0 reused, 1 failed" in capsys.readouterr().out
    assert run_cli([*argv, "--agent", "nope"], cloud) == 2
    assert "--agent: unknown harness nope" in capsys.readouterr().err


def test_serve_takes_the_template_mode_and_the_agents_to_preinstall() -> None:
    argv = [
        "serve",
        "--dataset",
        "d",
        "--upstream",
        "u",
        "--e2b-templates",
        "prebuilt",
        "--e2b-agent",
        "codex",
    ]
    args = apply_config(build_parser().parse_args(argv))  # serve's options, layered as run_serve does
    assert args.e2b_templates == "prebuilt" and args.e2b_agent == ["codex"]
    default = apply_config(build_parser().parse_args(["serve", "--dataset", "d", "--upstream", "u"]))
    assert default.e2b_templates == "build"


NPM_CALLS = "/var/log/fake-npm-calls.txt"


def agent_task(make_task: TaskFactory) -> HarborTask:
    """A task whose image has a counted fake ``npm`` on root's login PATH (as an image provides tools): each
    call is a line of :data:`NPM_CALLS`, in the template when its build called it, else in the sandbox."""
    dockerfile = (
        f"FROM node:22-slim\nENV FAKE_NPM_CALLS={NPM_CALLS}\nCOPY --chmod=755 npm /root/bin/npm\n"
        "RUN echo 'export PATH=/root/bin:$PATH' >> /root/.profile\n"
    )
    return make_task(dockerfile, files={"npm": FAKE_NPM})


@pytest.mark.parametrize("layered", [True, False])
async def test_an_agent_in_the_template_is_not_installed_again_by_the_rollout(
    cloud: FakeE2BCloud, make_task: TaskFactory, tmp_path: Path, layered: bool
) -> None:
    backend = make_backend(cloud, tmp_path, agent_layer=agent_layer([FAKE], "/root") if layered else "")
    sandbox = await backend.start(agent_task(make_task), lifetime_s=60)
    count = f"cat {NPM_CALLS} 2>/dev/null | wc -l"
    try:
        built_with = int((await sandbox.exec(count)).stdout)
        path = await install_tool(sandbox, FAKE)  # what a harness's install does in every rollout
        installs = int((await sandbox.exec(count)).stdout) - built_with
        assert (await sandbox.exec(f"sh {path}")).stdout == "fake\n"
    finally:
        await backend.aclose()
    assert (built_with, installs) == ((1, 0) if layered else (0, 1))


@pytest.mark.slow
async def test_provisioned_agents_are_template_layers_that_run_where_the_image_has_no_node(
    cloud: FakeE2BCloud, make_task: TaskFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The fake cloud runs the template's own filesystem, not this machine's: its image has no Node, yet the
    npm agent runs from the bundle the template carries, and the pip agent from the venv its setup made
    there (from PyPI, at build time). A template named by the user carries none: the harness falls back to
    installing over the network, which fails there for want of npm, saying so."""
    task = make_task("FROM debian:bookworm-slim\nWORKDIR /app\n")
    backend = make_backend(cloud, tmp_path)
    backend.provide([await provision(opencode.PACKAGE), await provision(mini_swe_agent.PACKAGE)])
    try:
        sandbox = await backend.start(task, lifetime_s=300)
        assert (await sandbox.exec("command -v node npm")).exit_code == 1
        assert "/work" not in (await sandbox.exec("ls /")).stdout  # not this machine's root
        for package, probe in ((opencode.PACKAGE, "--version"), (mini_swe_agent.PACKAGE, "--help")):
            path = await install_agent(sandbox, package)
            assert path == bundle_entry(package)
            ran = await sandbox.exec(f"{path} {probe}")
            assert ran.exit_code == 0 and package.version in ran.stdout + ran.stderr, ran.stderr
        spec = backend.template_builder.spec(task)
        assert [agent.name for agent in spec.agents] == sorted(
            [bundle_name(opencode.PACKAGE), bundle_name(mini_swe_agent.PACKAGE)]
        )
        assert spec.name != template_spec(task).name  # the agents are part of the template's name
        await sandbox.close()

        plain = (await TemplateBuilder(cloud.template_class, log_dir=tmp_path).ensure(task)).name
        named = make_backend(cloud, tmp_path, template=plain)  # the image without agents, named by the user
        named.provide([await provision(opencode.PACKAGE)])
        sandbox = await named.start(task, lifetime_s=60)
        try:
            assert sandbox.provisioned == frozenset()
            with pytest.raises(HarnessError, match="exited with 127: no npm on PATH"):
                await install_agent(sandbox, opencode.PACKAGE)
        finally:
            await named.aclose()
    finally:
        await backend.aclose()
    assert "is not provisioned in sandbox" in caplog.text
