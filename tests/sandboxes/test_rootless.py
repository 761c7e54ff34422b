"""The local sandbox without root: its private root, its choice of mode, and the tests run as an ordinary
user (``nobody``, through :mod:`tests.ordinary_user`) with rootless mode chosen by itself.

The rootless mode runs as root too (root may make user namespaces), so most tests here run in both
places; the tests that switch to the ordinary user run only as root and skip themselves there."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from harness_trainer.models.tiny import default_cache_dir
from harness_trainer.sandboxes import rootless
from harness_trainer.sandboxes.base import SandboxStartError
from harness_trainer.sandboxes.local import LocalSandboxBackend
from harness_trainer.sandboxes.rootless import ROOTLESS, new_root_ops, probe
from tests import ordinary_user
from tests.sandboxes.conftest import TaskFactory, wait_until_gone, wait_until_present

rootless_works = pytest.mark.skipif(
    probe(ROOTLESS) is not None, reason=f"no rootless namespaces here: {probe(ROOTLESS)}"
)
as_user = pytest.mark.skipif(
    ordinary_user.why_not_available() is not None, reason=str(ordinary_user.why_not_available())
)
MODES = ["rootless", *(["root"] if os.geteuid() == 0 else [])]


def test_the_new_root_mirrors_the_host_and_makes_a_tmpfs_parent_only_on_the_way_to_a_task_path(
    tmp_path: Path,
) -> None:
    host = tmp_path / "host"
    for directory in ("usr", "home/alice", "home/user", "proc/1"):
        (host / directory).mkdir(parents=True)
    (host / "bin").symlink_to("usr/bin")
    (host / ".dockerenv").write_text("")
    own = tmp_path / "own"
    binds = [(own / "app", "/app"), (own / "home/user", "/home/user"), (own / "deep", "/srv/x/deep")]
    ops = new_root_ops(binds, host_root=host)
    assert ops == [
        *["file", str(host / ".dockerenv"), "/.dockerenv"],
        *["link", "/bin", "usr/bin"],
        *["rbind", str(host / "usr"), "/usr"],
        *["dir", "/home"],
        *["rbind", str(host / "home/alice"), "/home/alice"],  # the host's user/ is hidden, not bound
        *["dir", "/srv"],
        *["dir", "/srv/x"],
        *["bind", str(own / "app"), "/app"],
        *["bind", str(own / "home/user"), "/home/user"],
        *["bind", str(own / "deep"), "/srv/x/deep"],
    ]


@rootless_works
async def test_a_rootless_sandbox_adds_nothing_to_the_host(tmp_path: Path, make_task: TaskFactory) -> None:
    fresh = f"/ht-fresh-{uuid.uuid4().hex[:8]}"
    top, home = sorted(os.listdir("/")), sorted(os.listdir("/home")) if os.path.isdir("/home") else []
    task = make_task(f"FROM x\nWORKDIR {fresh}\nRUN touch {fresh}-top && echo built > here.txt\n")
    backend = LocalSandboxBackend(tmp_path / "sandboxes", mode="rootless")
    sandbox = await backend.start(task, lifetime_s=60)
    try:
        seen = await sandbox.exec(
            f"pwd; cat here.txt; test -f {fresh}-top && test -d /logs/verifier && id -u"
        )
        assert seen.stdout == f"{fresh}\nbuilt\n0\n", seen.stderr
        assert await sandbox.read_file("here.txt") == b"built\n"
        assert sorted(os.listdir("/")) == top, "the host got a new top-level entry"
        assert (sorted(os.listdir("/home")) if os.path.isdir("/home") else []) == home
    finally:
        await backend.aclose()
    assert not sandbox.root.exists()


@rootless_works
async def test_a_run_step_that_needs_root_runs_as_the_mapped_root(
    tmp_path: Path, make_task: TaskFactory
) -> None:
    dockerfile = "FROM x\nRUN id -u > uid && touch /root-only-thing && chown 0:0 uid && chmod 600 uid\n"
    backend = LocalSandboxBackend(tmp_path / "sandboxes", mode="rootless")
    sandbox = await backend.start(make_task(dockerfile), lifetime_s=60)
    try:
        assert (await sandbox.exec("cat uid; ls /root-only-thing")).stdout == "0\n/root-only-thing\n"
    finally:
        await backend.aclose()


@rootless_works
@pytest.mark.skipif(
    os.geteuid() == 0, reason="as root, the mapped root is the host's root: it can write there"
)
async def test_a_run_step_writing_a_host_system_directory_names_the_task_and_the_line(
    tmp_path: Path, make_task: TaskFactory
) -> None:
    task = make_task("FROM x\nRUN echo fine\nRUN touch /usr/lib/ht-should-not-exist\n", name="needs-root")
    backend = LocalSandboxBackend(tmp_path / "sandboxes", mode="rootless")
    with pytest.raises(SandboxStartError) as raised:
        await backend.start(task, lifetime_s=60)
    message = str(raised.value)
    assert message.startswith("needs-root: Dockerfile line 3: RUN exited with code 1 (rootless mode:")
    assert "Permission denied" in message
    assert not backend.live and not list(backend.base_dir.glob("ht-*"))


OWNER = """
import asyncio, pathlib, signal, sys
from harness_trainer.sandboxes import SandboxSupervisor
from harness_trainer.sandboxes.local import LocalSandboxBackend
from harness_trainer.tasks.task import EnvironmentSpec, HarborTask

async def main(mode, base, tag):
    task = HarborTask(name="t", path=pathlib.Path(base), instruction="", config={}, agent_timeout_sec=60,
                      verifier_timeout_sec=60, environment=EnvironmentSpec())
    supervisor = SandboxSupervisor(LocalSandboxBackend(base, mode=mode))
    supervisor.install_signal_handlers()
    sandbox = await supervisor.start(task, lifetime_s=60)
    await sandbox.exec(f"nohup setsid sleep {tag} >/dev/null 2>&1 &")
    print(sandbox.root, flush=True)
    await asyncio.sleep(60)

asyncio.run(main(*sys.argv[1:]))
"""


@rootless_works
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_nothing_a_sandbox_started_outlives_its_owner(tmp_path: Path, mode: str, how: signal.Signals) -> None:
    script = tmp_path / "owner.py"  # a file, not `-c`: its command line would match the launcher marker
    script.write_text(OWNER)
    tag = str(600_000 + os.getpid() % 100_000)
    base = tmp_path / "owner"
    base.mkdir()
    owner = subprocess.Popen([sys.executable, script, mode, str(base), tag], stdout=subprocess.PIPE)
    try:
        assert owner.stdout is not None
        root = Path(owner.stdout.readline().decode().strip())
        assert root.is_dir() and wait_until_present(f"sleep {tag}")  # the nohup child may not have exec'd yet
        owner.send_signal(how)
        assert owner.wait(timeout=20) == -how
        assert not wait_until_gone(f"sleep {tag}"), f"the sandbox outlived its owner's {how.name}"
        if how == signal.SIGTERM:
            assert not root.exists(), "SIGTERM closes every sandbox, deleting its root"
        else:  # the root of a hard-killed owner is the next backend's to sweep
            from harness_trainer.sandboxes.local import sweep_stale_roots

            assert sweep_stale_roots(base) == [root]
    finally:
        owner.kill()
        owner.wait()
        if owner.stdout is not None:
            owner.stdout.close()


@as_user
@pytest.mark.slow
def test_the_sandbox_tests_pass_as_an_ordinary_user_in_rootless_mode() -> None:
    tests = [
        "tests/sandboxes/test_contract.py",
        "tests/sandboxes/test_local.py",
        "tests/sandboxes/test_rootless.py",
    ]
    with ordinary_user.user_workspace() as workspace:
        mode = ordinary_user.run_as_user(
            [sys.executable, "-c", "from harness_trainer.sandboxes.local import LocalSandboxBackend as B; "
             "print(B.choose_mode().name)"], workspace,
        )  # fmt: skip
        assert mode.stdout == "rootless\n", mode.stderr
        run = ordinary_user.pytest_as_user(["-q", "-x", "-k", "local or not contract", *tests], workspace)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and " failed" not in run.stdout


@as_user
@pytest.mark.slow
def test_the_toy_agent_solves_a_toy_task_as_an_ordinary_user(tiny_model_dir: Path) -> None:
    test = "tests/rollouts/test_local_factory.py::test_the_toy_agent_solves_a_task_and_its_trace_is_exactly"
    test += "_the_scripted_replies"
    with ordinary_user.user_workspace() as workspace:
        cache = workspace / "cache"
        copy = cache / "models" / tiny_model_dir.relative_to(default_cache_dir())
        shutil.copytree(tiny_model_dir, copy)
        shutil.chown(cache, "nobody")
        for path in cache.rglob("*"):
            shutil.chown(path, "nobody")
        run = ordinary_user.pytest_as_user(["-q", test], workspace, env={"HARNESS_TRAINER_CACHE": str(cache)})
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert "1 passed" in run.stdout


UNAVAILABLE = """
import asyncio, os, pathlib, sys
from harness_trainer.sandboxes.local import LocalSandboxBackend
from harness_trainer.sandboxes.rootless import LocalSandboxUnavailable
from harness_trainer.tasks.task import EnvironmentSpec, HarborTask

base = pathlib.Path(sys.argv[1])
task = HarborTask(name="t", path=base, instruction="", config={}, agent_timeout_sec=60,
                  verifier_timeout_sec=60, environment=EnvironmentSpec())
try:
    asyncio.run(LocalSandboxBackend(base / "sandboxes").start(task, lifetime_s=60))
except LocalSandboxUnavailable as exc:
    print(exc)
me = os.getpid()
print("children:", pathlib.Path(f"/proc/{me}/task/{me}/children").read_text().split())
"""


@as_user
def test_without_user_namespaces_the_sandbox_and_the_dev_loop_stop_first_saying_why_and_what_to_do() -> None:
    with ordinary_user.user_workspace() as workspace:
        (workspace / "tmp" / "start.py").write_text(UNAVAILABLE)
        start = ordinary_user.run_as_user(
            [sys.executable, str(workspace / "tmp" / "start.py"), str(workspace / "tmp")],
            workspace,
            user_namespaces=0,
        )
        dev = ordinary_user.run_as_user(
            [
                sys.executable,
                "-m",
                "harness_trainer.cli",
                "dev",
                "--output-dir",
                str(workspace / "tmp" / "run"),
            ],
            workspace,
            user_namespaces=0,
        )
        left = sorted(p.name for p in (workspace / "tmp").iterdir())
    message, children = start.stdout.strip().splitlines()
    assert children == "children: []", "a refused start left a process behind"
    assert (
        "the local sandbox cannot run on this machine (root mode: not running as root; rootless mode: "
        in message
    )
    assert "`sudo sysctl -w user.max_user_namespaces=15000`" in message and "--sandbox docker" in message
    assert left == ["start.py"], "a refused start left something behind"
    assert dev.returncode == 2 and dev.stdout == ""
    assert dev.stderr.strip() == f"error: {message}"


def test_the_advice_names_the_setting_found_off_or_else_all_three(monkeypatch: pytest.MonkeyPatch) -> None:
    values = {"/proc/sys/user/max_user_namespaces": "0", "/proc/sys/kernel/unprivileged_userns_clone": "1"}
    monkeypatch.setattr(rootless, "_read", values.get)
    assert rootless.how_to_enable_user_namespaces() == "`sudo sysctl -w user.max_user_namespaces=15000`"
    monkeypatch.setattr(rootless, "_read", {}.get)
    assert rootless.how_to_enable_user_namespaces().count("sudo sysctl -w") == 3


def test_an_unknown_mode_is_refused_naming_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown local sandbox mode 'chroot'; known: root, rootless"):
        LocalSandboxBackend.choose_mode("chroot")


def test_the_ordinary_user_is_given_a_mode_700_checkout_whole_and_only_the_way_through_others(
    tmp_path: Path,
) -> None:
    clone = tmp_path / "clone"  # as `git clone URL "$(mktemp -d)"` leaves it
    (clone / "tests").mkdir(parents=True)
    (clone / ".git").write_text("gitdir: elsewhere\n")
    home = tmp_path / "home"
    (home / ".pyenv" / "bin").mkdir(parents=True)
    (home / "secrets").mkdir()
    clone.chmod(0o700)
    home.chmod(0o700)
    blocked = ordinary_user.blocked_steps([str(clone), str(home / ".pyenv" / "bin")])
    assert blocked[str(clone)] == {"tests", ".git"}
    assert blocked[str(home)] == {".pyenv"}
    assert str(home / ".pyenv") not in blocked


def test_off_linux_the_advice_is_docker_or_e2b_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rootless.sys, "platform", "darwin")
    with pytest.raises(rootless.LocalSandboxUnavailable) as raised:
        rootless.choose_mode.__wrapped__()
    assert str(raised.value).startswith(
        "the local sandbox needs Linux, and this is darwin: run the agents in"
    )
    assert "sysctl" not in str(raised.value)
