"""The hf backend's own behaviour, against the fake Hub (:mod:`tests.sandboxes.fake_hf`: the Jobs API and
the sandbox servers over HTTP, so ``huggingface_hub``'s client code runs): the token checked at start, the
pool (``dedicated=False``) sized from the run's concurrency and named for the run, dedicated sandboxes (the
default) labelled, images, agents, and nothing left running after ``aclose``. The sandbox contract itself
is in test_contract."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness_trainer.sandboxes import capabilities, make_backend, missing_credentials
from harness_trainer.sandboxes.base import AGENT_ROOT, AgentProvision, SandboxError, SandboxStartError
from harness_trainer.sandboxes.hf import ISOLATION_NOTE, HfSandboxBackend, hosts_for
from harness_trainer.sandboxes.hf_sandbox import HfSandbox
from harness_trainer.sandboxes.hf_sdk import OWNER_LABEL, RUN_LABEL, TASK_LABEL, pool_name
from tests.sandboxes.conftest import TaskFactory
from tests.sandboxes.fake_hf import FakeHub

pytestmark = pytest.mark.docker  # the fake's jobs run in images exported from the Docker daemon

IMAGE = "debian:bookworm-slim"


def dedicated(**options: object) -> HfSandboxBackend:
    """A backend with its default sandboxes: dedicated ones."""
    return HfSandboxBackend(image=IMAGE, kill_grace_s=0.5, retry_backoff_s=0, **options)


def test_its_facts_are_on_its_class() -> None:
    caps = capabilities("hf")
    assert caps.credentials == ("HF_TOKEN",) and caps.remote
    assert missing_credentials("hf", {}) == ["HF_TOKEN"]
    assert "one trust boundary" in ISOLATION_NOTE and "dedicated=false" in ISOLATION_NOTE
    assert "dedicated=false" in caps.summary
    backend = make_backend("hf")  # nothing is asked of the Hub until a start
    assert backend.name == "hf" and backend.dedicated, "dedicated by default: a Harbor task writes /logs"
    assert not make_backend("hf", dedicated=False).dedicated
    assert [hosts_for(c, 50) for c in (None, 1, 50, 51, 256)] == [1, 1, 1, 2, 6]


async def test_no_token_is_one_line_naming_it_and_starts_nothing(
    fake_hub: FakeHub, make_task: TaskFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_TOKEN")
    backend = dedicated()
    with pytest.raises(SandboxStartError, match=r"^the hf backend needs HF_TOKEN \(") as raised:
        await backend.start(make_task(), lifetime_s=60)
    assert "\n" not in str(raised.value)
    assert fake_hub.jobs == {} and fake_hub.requests == []


@pytest.mark.parametrize(
    ("fault", "says"),
    [("token", "HF_TOKEN is not a valid Hugging Face token"), ("forbidden", "may not run Hugging Face Jobs")],
)
async def test_a_token_the_hub_refuses_is_one_line(
    fake_hub: FakeHub, make_task: TaskFactory, monkeypatch: pytest.MonkeyPatch, fault: str, says: str
) -> None:
    if fault == "token":
        monkeypatch.setenv("HF_TOKEN", "hf_someone_elses")
    else:
        fake_hub.forbidden = True
    backend = dedicated()
    with pytest.raises(SandboxStartError, match=says) as raised:
        await backend.prepare(make_task())
    assert "\n" not in str(raised.value) and fake_hub.jobs == {}


async def test_the_pool_is_sized_from_the_concurrency_and_named_for_the_run(
    fake_hub: FakeHub, make_task: TaskFactory
) -> None:
    backend = HfSandboxBackend(
        dedicated=False, image=IMAGE, concurrency=5, sandboxes_per_host=2, run_id="run-7"
    )
    try:
        await backend.prepare(make_task())
        await backend.prepare(make_task())  # the same image: the same pool, no new host
        hosts = fake_hub.running(**{"hf-sandbox-pool": pool_name("run-7", IMAGE)})
        assert len(hosts) == 3 == len(fake_hub.running())
        assert {job.spec["environment"]["SBX_CAPACITY"] for job in hosts} == {"2"}
        assert {job.spec["dockerImage"] for job in hosts} == {IMAGE}
        assert pool_name("run-7", IMAGE).startswith("ht-run-7-")
    finally:
        await backend.aclose()
    assert fake_hub.running() == [], "aclose leaves no host job running"


async def test_a_pooled_sandbox_cannot_hold_a_tasks_paths_and_says_so(
    fake_hub: FakeHub, make_task: TaskFactory
) -> None:
    """A pooled sandbox writes only its home (the fake: a uid of its own); a task's /logs are outside it."""
    backend = HfSandboxBackend(dedicated=False, image=IMAGE, sandboxes_per_host=4)
    task = make_task()
    try:
        with pytest.raises(
            SandboxStartError,
            match=r"(?s)/logs.*: Permission denied \(a pooled HF sandbox writes only its home, /home/sbx-",
        ) as raised:
            await backend.start(task, lifetime_s=60)
        assert task.name in str(raised.value) and "dedicated=true, the default" in str(raised.value)
        assert backend.live == [] and fake_hub.boxes() == [], "the sandbox it made is gone again"
        assert len(fake_hub.running()) == 1  # its host stays for the run's next starts
    finally:
        await backend.aclose()
    assert fake_hub.running() == []


async def test_dedicated_sandboxes_are_jobs_labelled_with_the_run(
    fake_hub: FakeHub, make_task: TaskFactory
) -> None:
    backend = dedicated(run_id="run-9", flavor="cpu-upgrade")
    task = make_task(name="labelled")
    sandbox = await backend.start(task, lifetime_s=60, env={"SESSION_KEY": "s3cret"})
    try:
        (job,) = fake_hub.running()
        assert job.labels[RUN_LABEL] == "run-9" and job.labels[TASK_LABEL] == "labelled"
        assert job.labels[OWNER_LABEL] == backend.owner and job.labels["hf-sandbox-mode"] == "dedicated"
        assert job.spec["flavor"] == "cpu-upgrade" and sandbox.id == job.id
        assert "s3cret" not in str(job.spec), "a start env goes with each command, not into the job's spec"
        assert (await sandbox.exec('echo "$SESSION_KEY"')).stdout == "s3cret\n"
    finally:
        await backend.aclose()
    assert fake_hub.running() == [] and backend.live == []


async def test_a_dockerfile_that_only_names_an_image_runs_it_and_one_that_builds_is_refused(
    fake_hub: FakeHub, make_task: TaskFactory
) -> None:
    backend = dedicated()
    plain = make_task(f"FROM {IMAGE}\nENV GREETING=hi\nWORKDIR /srv/work\n")
    builds = make_task(f"FROM {IMAGE}\nRUN echo built > /built\n", name="needs-a-build")
    try:
        sandbox = await backend.start(plain, lifetime_s=60)
        assert (await sandbox.exec('echo "$GREETING $PWD"')).stdout == "hi /srv/work\n"
        assert [job.spec["dockerImage"] for job in fake_hub.running()] == [IMAGE]
        with pytest.raises(SandboxStartError, match=r"^needs-a-build: .*builds an image \(line 2\)"):
            await backend.start(builds, lifetime_s=60)
        with pytest.raises(SandboxStartError, match="no image option"):
            await HfSandboxBackend().start(make_task(name="imageless"), lifetime_s=60)
    finally:
        await backend.aclose()
    assert len(fake_hub.jobs) == 1, "the refused tasks asked for no job"


async def test_agents_are_uploaded_and_set_up_in_each_sandbox(
    fake_hub: FakeHub, make_task: TaskFactory, tmp_path: Path
) -> None:
    bundle = tmp_path / "bundle"
    (bundle / "bin").mkdir(parents=True)
    (bundle / "bin" / "agent").write_text("#!/bin/sh\necho agent 1.0\n")
    (bundle / "bin" / "agent").chmod(0o755)
    (bundle / "venvs").mkdir()
    (bundle / "venvs" / "host-only").write_text("made on this machine")
    backend = dedicated()
    backend.provide([AgentProvision("agent-1", bundle, setup=f"touch {AGENT_ROOT}/agent-1/set-up")])
    sandbox = await backend.start(make_task(), lifetime_s=60)
    try:
        assert (await sandbox.exec(f"{AGENT_ROOT}/agent-1/bin/agent")).stdout == "agent 1.0\n"
        assert (await sandbox.exec(f"ls {AGENT_ROOT}/agent-1")).stdout.split() == ["bin", "set-up"]
        assert sandbox.provisioned == frozenset({"agent-1"})
    finally:
        await backend.aclose()


async def test_failed_creates_are_retried_or_refused_by_kind(
    fake_hub: FakeHub, make_task: TaskFactory
) -> None:
    backend = dedicated(create_attempts=3)
    try:
        fake_hub.fail_run_jobs = [503, 503]
        sandbox = await backend.start(make_task(), lifetime_s=60)
        assert (await sandbox.exec("true")).exit_code == 0
        fake_hub.fail_run_jobs = [400]
        with pytest.raises(SandboxStartError, match=r"refused to create .* after 1 try; last error: refused"):
            await backend.start(make_task(), lifetime_s=60)
        fake_hub.fail_run_jobs = [503, 503, 503]
        with pytest.raises(SandboxStartError, match=r"did not start after 3 tries; last error: unavailable"):
            await backend.start(make_task(), lifetime_s=60)
    finally:
        await backend.aclose()
    assert fake_hub.running() == []


async def test_a_sandbox_whose_job_ended_raises_a_sandbox_error(
    fake_hub: FakeHub, make_task: TaskFactory
) -> None:
    backend = dedicated()
    sandbox = await backend.start(make_task(), lifetime_s=60)
    try:
        (job,) = fake_hub.running()
        job.stage = "COMPLETED"  # the job ended on the Hub's side (idle timeout, its 24 h)
        with pytest.raises(SandboxError, match=sandbox.id):
            await sandbox.exec("true")
        with pytest.raises(SandboxError):
            await sandbox.read_file("/app/x")
    finally:
        await backend.aclose()


async def test_a_start_cancelled_while_its_job_boots_leaves_no_job(
    fake_hub: FakeHub, make_task: TaskFactory
) -> None:
    backend = dedicated()
    starting = asyncio.ensure_future(backend.start(make_task(), lifetime_s=60))
    for _ in range(200):
        if fake_hub.jobs:
            break
        await asyncio.sleep(0.01)
    assert fake_hub.jobs, "the create reached the Hub"
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    await backend.aclose()  # waits for the create it shielded, then kills what it made
    assert fake_hub.running() == []


def test_a_pooled_sandbox_files_are_under_its_home(tmp_path: Path) -> None:
    """The library's file API is rooted at a pooled sandbox's home: paths there are sent relative to it,
    others refused (a write there would land where commands do not look)."""
    pooled = HfSandbox(
        SimpleNamespace(id="host.s1"),
        executor=ThreadPoolExecutor(1),
        pooled=True,
        workdir="/home/sbx-1/app",
        env={},
        kill_grace_s=0.5,
    )
    pooled.home = "/home/sbx-1"
    assert pooled.api_path("notes.txt") == "/app/notes.txt"
    assert pooled.api_path("~/x/y") == "/x/y" and pooled.api_path("/home/sbx-1") == "/"
    with pytest.raises(SandboxError, match=r"/logs/agent/a is outside its home \(/home/sbx-1\)"):
        pooled.api_path("/logs/agent/a")
    pooled.pooled = False
    assert pooled.api_path("/logs/agent/a") == "/logs/agent/a"
