"""Agent bundles (:mod:`harness_trainer.harnesses.bundles`): built once per machine from the npm registry
(a real HTTP server on loopback in the registry's shape here; the real registry in the Docker tests and in
``tests/rollouts/test_harbor_shaped.py``), checked, never left half-built; a pip agent's venv made per
Python by the bundle's own installer; and what a harness runs in a sandbox with or without its bundle."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import email.parser
import hashlib
import io
import json
import logging
import os
import subprocess
import sys
import tarfile
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from harness_trainer.harnesses import aider, bundles, mini_swe_agent
from harness_trainer.harnesses.base import HarnessError
from harness_trainer.harnesses.bundles import (
    agent_path,
    bundle_entry,
    bundle_name,
    ensure_bundle,
    install_agent,
    probe_agent,
    setup_command,
)
from harness_trainer.harnesses.tools import NativeBinary, ToolPackage
from harness_trainer.sandboxes.base import AGENT_ROOT, ExecResult
from tests.harnesses.conftest import FakeSandbox

NATIVE = NativeBinary("acme-agent-linux-x64", "1.0.0", "bin/acme")
ACME = ToolPackage("npm", "acme-agent", "1.0.0", "node_modules/.bin/acme", native=NATIVE)
ACME_BINARY = b'#!/bin/sh\necho "acme 1.0.0 $*"\n'


def _tarball(files: dict[str, tuple[bytes, int]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, (data, mode) in files.items():
            info = tarfile.TarInfo(f"package/{name}")
            info.size, info.mode = len(data), mode
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@dataclass
class Registry:
    """An npm registry on loopback: ``GET /<name>/<version>`` answers the version's document (``dist``
    with ``tarball`` and ``integrity``, as registry.npmjs.org does), ``GET /-/<file>`` the tarball."""

    url: str = ""
    packages: dict[tuple[str, str], bytes] = field(default_factory=dict)
    corrupt: bool = False
    requests: list[str] = field(default_factory=list)


@pytest.fixture
def registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Registry]:
    state = Registry()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            state.requests.append(self.path)
            name, _, version = self.path.lstrip("/").replace("%2f", "/").rpartition("/")
            if self.path.startswith("/-/"):
                key = tuple(self.path[3:].removesuffix(".tgz").rsplit("@", 1))
                body = state.packages.get(key)  # type: ignore[arg-type]
                if body is not None and state.corrupt:
                    body = body[:-1] + bytes([body[-1] ^ 1])
            elif (name, version) in state.packages:
                data = state.packages[(name, version)]
                integrity = "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()
                tarball = f"{state.url}/-/{name}@{version}.tgz"
                body = json.dumps(
                    {"name": name, "version": version, "dist": {"tarball": tarball, "integrity": integrity}}
                ).encode()
            else:
                body = None
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body or b'{"error": "not found"}')

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{server.server_port}"
    state.packages[(NATIVE.name, NATIVE.version)] = _tarball(
        {"bin/acme": (ACME_BINARY, 0o755), "package.json": (b"{}", 0o644)}
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("NPM_CONFIG_REGISTRY", state.url)
    monkeypatch.setenv("HARNESS_TRAINER_CACHE", str(tmp_path / "cache"))
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


async def test_a_native_bundle_is_fetched_once_however_many_ask_and_runs_on_its_own(
    registry: Registry,
) -> None:
    folders = await asyncio.gather(*(ensure_bundle(ACME) for _ in range(4)))
    assert len(set(folders)) == 1
    folder = folders[0]
    assert folder.name == "acme-agent-1.0.0-native-linux-x64-f1" == bundle_name(ACME)
    assert [r for r in registry.requests if r.startswith("/-/")] == ["/-/acme-agent-linux-x64@1.0.0.tgz"]
    ran = subprocess.run([folder / "bin" / "acme", "--version"], capture_output=True, text=True, check=True)
    assert ran.stdout == "acme 1.0.0 --version\n"  # the launcher hands its arguments over
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name, folder.name + ".lock"]
    await ensure_bundle(ACME)  # built: no further request
    assert len(registry.requests) == 2


async def test_a_tarball_failing_its_check_or_a_missing_version_is_an_error_that_leaves_nothing(
    registry: Registry,
) -> None:
    registry.corrupt = True
    with pytest.raises(HarnessError, match=r"acme-agent-linux-x64@1\.0\.0: .* fails its integrity check"):
        await ensure_bundle(ACME)
    missing = ToolPackage(
        "npm", "acme-agent", "9.9.9", "x", native=NativeBinary(NATIVE.name, "9.9.9", "bin/acme")
    )
    with pytest.raises(HarnessError, match=r"answered 404 for acme-agent-linux-x64@9\.9\.9"):
        await ensure_bundle(missing)
    leftovers = [p.name for p in bundles.host_bundles_dir().iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []
    registry.corrupt = False
    assert (await ensure_bundle(ACME)).is_dir()  # a later build is not blocked by the failed one


async def test_an_unreachable_registry_names_the_package_and_the_registry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HARNESS_TRAINER_CACHE", str(tmp_path))
    monkeypatch.setenv("NPM_CONFIG_REGISTRY", "http://127.0.0.1:9")
    with pytest.raises(
        HarnessError,
        match=r"cannot fetch acme-agent-linux-x64@1.0.0 from the npm registry http://127\.0\.0\.1:9",
    ):
        await ensure_bundle(ACME)


COWSAY = ToolPackage("pip", "cowsay", "6.1", "venv/bin/cowsay", requires_python="3.8")


@pytest.mark.slow
async def test_a_pip_bundle_makes_one_venv_per_python_with_its_installer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The installer a backend runs in each image, run here with this machine's Python (PyPI, for real)."""
    monkeypatch.setenv("HARNESS_TRAINER_CACHE", str(tmp_path))
    folder = await ensure_bundle(COWSAY)
    launcher = folder / "bin" / "cowsay"
    python = Path(sys.executable).parent  # `python3` as the launcher and the setup find it
    env = {**os.environ, "PATH": f"{python}:{os.environ['PATH']}"}
    never = subprocess.run([launcher, "-t", "hi"], capture_output=True, text=True, env=env)
    assert never.returncode == 127 and "cowsay==6.1 was never installed for Python 3." in never.stderr
    setup = setup_command(COWSAY).replace(f"{AGENT_ROOT}/{bundle_name(COWSAY)}", str(folder))
    for _ in range(2):  # the second is a no-op: the venv is there
        subprocess.run(["bash", "-c", setup], env=env, check=True, capture_output=True, timeout=300)
    assert len(list((folder / "venvs").glob("*/.harness-trainer-installed"))) == 1
    said = subprocess.run([launcher, "-t", "hi"], capture_output=True, text=True, env=env, check=True)
    assert "hi" in said.stdout
    (folder / "requires.txt").write_text("99\n")
    old = subprocess.run(["bash", "-c", setup], env=env, capture_output=True, text=True)
    assert old.returncode == 3 and "cowsay==6.1 needs Python >= 99; this image has Python 3." in old.stderr
    this = f"3.{sys.version_info[1]}"
    (folder / "requires.txt").write_text(f">=3.8,<{this}\n")  # a release whose range ends below this Python
    refusal = f"cowsay==6.1 needs Python >= 3.8, < {this}; this image has Python {this}."
    new = subprocess.run(["bash", "-c", setup], env=env, capture_output=True, text=True)
    assert new.returncode == 3 and refusal in new.stderr
    stale = subprocess.run([launcher, "-t", "hi"], capture_output=True, text=True, env=env)
    assert stale.returncode == 127 and refusal in stale.stderr  # nor does the venv made before run
    bare = {"PATH": "/nonexistent"}  # no python3 to be found
    nothing = subprocess.run(["/bin/bash", "-c", setup], env=bare, capture_output=True, text=True)
    assert nothing.returncode == 127 and "needs python3 in this image, which has none" in nothing.stderr


def test_a_pip_bundle_is_named_anew_when_its_python_range_or_installer_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A built bundle is never rebuilt in place: what its installer refuses by is in its name."""
    name = bundle_name(COWSAY)
    assert name.startswith("cowsay-6.1-pip-") and name.endswith("-linux-x64-f1")
    assert bundle_name(dataclasses.replace(COWSAY, requires_python=">=3.8,<3.13")) != name
    monkeypatch.setattr(bundles, "_installer_source", lambda: "another installer")
    assert bundle_name(COWSAY) != name


@pytest.mark.slow
@pytest.mark.parametrize("package", [aider.PACKAGE, mini_swe_agent.PACKAGE], ids=lambda p: p.name)
def test_a_pip_agents_python_range_is_the_one_its_release_declares(
    package: ToolPackage, tmp_path: Path
) -> None:
    """Its bundle's installer refuses exactly the Pythons pip would find no release for (PyPI, for real)."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--disable-pip-version-check", "-d", str(tmp_path), package.spec]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        declared = email.parser.HeaderParser().parsestr(archive.read(metadata).decode())["Requires-Python"]
    ours = package.requires_python if package.requires_python[0] in "<>" else f">={package.requires_python}"
    for minor in range(6, 16):
        python = f"3.{minor}"
        assert (python in SpecifierSet(ours)) == (python in SpecifierSet(declared)), (python, declared)


async def test_a_harness_runs_the_provisioned_bundle_and_explains_one_that_does_not_run() -> None:
    sandbox = FakeSandbox()
    sandbox.provisioned = frozenset({bundle_name(ACME)})  # type: ignore[attr-defined]
    assert await install_agent(sandbox, ACME) == bundle_entry(ACME) == agent_path(sandbox, ACME)
    assert sandbox.execs[0]["command"] == f"test -x {bundle_entry(ACME)}"

    def broken(sandbox: FakeSandbox, command: str) -> ExecResult:
        return ExecResult(126, "", "cannot execute binary file: Exec format error")

    with pytest.raises(
        HarnessError, match=r"provisioned in sandbox fake-1 but does not run there: .*Exec format"
    ):
        failing = FakeSandbox(broken)
        failing.provisioned = frozenset({bundle_name(ACME)})  # type: ignore[attr-defined]
        await install_agent(failing, ACME)


async def test_without_a_provisioned_bundle_the_network_install_is_the_warned_fallback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def no_bundle(sandbox: FakeSandbox, command: str) -> ExecResult:
        return ExecResult(1 if command.startswith("test -x") else 0, "", "")

    sandbox = FakeSandbox(no_bundle)
    with caplog.at_level(logging.WARNING):
        path = await install_agent(sandbox, ACME)
    assert path == "/home/user/.cache/harness-trainer/tools/acme-agent-1.0.0/node_modules/.bin/acme"
    assert "npm install" in sandbox.execs[1]["command"] and agent_path(sandbox, ACME) == path
    assert (
        "acme-agent@1.0.0 is not provisioned in sandbox fake-1: installing it over the network" in caplog.text
    )


async def test_an_agent_that_does_not_start_fails_its_probe_naming_the_command_and_its_output() -> None:
    def crashes(sandbox: FakeSandbox, command: str) -> ExecResult:
        if command.startswith("test -x"):
            return ExecResult(0, "", "")
        return ExecResult(127, "", "error while loading shared libraries: libstdc++.so.6")

    sandbox = FakeSandbox(crashes)
    sandbox.provisioned = frozenset({bundle_name(ACME)})  # type: ignore[attr-defined]
    with pytest.raises(HarnessError) as failed:
        await probe_agent(sandbox, ACME)
    assert f"`{bundle_entry(ACME)} --version` exited with 127 in sandbox fake-1" in str(failed.value)
    assert "libstdc++.so.6" in str(failed.value)

    def answers(sandbox: FakeSandbox, command: str) -> ExecResult:
        return ExecResult(0, "acme 1.0.0\n", "")

    assert await probe_agent(FakeSandbox(answers), ACME) == "acme 1.0.0\n"
