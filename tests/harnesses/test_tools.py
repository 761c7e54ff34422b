"""Installing pinned agent packages: the host tool cache (once, shared, race-free, retried after a broken
install) and installs inside a sandbox that does not share the host's files. A fake ``npm`` on ``PATH``
stands in for the registry."""

from __future__ import annotations

import asyncio
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from harness_trainer.harnesses import tools
from harness_trainer.harnesses.base import HarnessError
from harness_trainer.harnesses.tools import (
    MARKER,
    ToolPackage,
    agent_layer,
    ensure_host_install,
    install_tool,
    sandbox_install_command,
    tool_path,
)
from harness_trainer.sandboxes.base import ExecResult
from tests.harnesses.conftest import FakeSandbox

FAKE = ToolPackage("npm", "@acme/fake-agent", "1.2.3", "node_modules/.bin/fake")
FAKE_NPM = """#!/bin/bash
# a stand-in for `npm install --prefix DEST ... SPEC`: slow, counted, and failing on demand
prefix="$3"
echo "$*" >> "$FAKE_NPM_CALLS"
sleep 0.3
[ -n "$FAKE_NPM_FAIL" ] && { echo "registry says no" >&2; exit 1; }
mkdir -p "$prefix/node_modules/.bin" && printf '#!/bin/sh\\necho fake\\n' > "$prefix/node_modules/.bin/fake"
"""


@pytest.fixture
def fake_npm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "npm").write_text(FAKE_NPM)
    (bin_dir / "npm").chmod(0o755)
    calls = tmp_path / "npm-calls.txt"
    calls.touch()
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_NPM_CALLS", str(calls))
    monkeypatch.setenv("HARNESS_TRAINER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tools, "_host_ready", set())
    return calls


def test_package_specs_and_folders_are_pinned_and_filesystem_safe() -> None:
    assert FAKE.spec == "@acme/fake-agent@1.2.3" and FAKE.dirname == "acme-fake-agent-1.2.3"
    pip = ToolPackage("pip", "mini-swe-agent", "2.4.6", "venv/bin/mini")
    assert pip.spec == "mini-swe-agent==2.4.6"
    assert "-m venv" in pip.install_command("/d") and "pip install" in pip.install_command("/d")
    assert "npm install --prefix /d" in FAKE.install_command("/d")


def test_pinned_dependencies_install_with_the_package_in_a_folder_of_their_own() -> None:
    pinned = ToolPackage("pip", "mini-swe-agent", "2.4.6", "venv/bin/mini", pins=(("litellm", "1.76.0"),))
    assert pinned.specs == ["mini-swe-agent==2.4.6", "litellm==1.76.0"]
    assert pinned.install_command("/d").endswith("pip install --disable-pip-version-check --no-input -q "
                                                  "mini-swe-agent==2.4.6 litellm==1.76.0")  # fmt: skip
    # Other pins are another install: a cached folder with the old ones is never taken for it.
    assert pinned.dirname == "mini-swe-agent-2.4.6-litellm-1.76.0"
    assert pinned.dirname != ToolPackage("pip", "mini-swe-agent", "2.4.6", "venv/bin/mini").dirname
    npm = ToolPackage("npm", "@acme/agent", "1.0.0", "bin/agent", pins=(("@acme/dep", "2.0.0"),))
    assert npm.install_command("/d").endswith("@acme/agent@1.0.0 @acme/dep@2.0.0")
    assert npm.dirname == "acme-agent-1.0.0-acme-dep-2.0.0"
    assert "echo 'mini-swe-agent==2.4.6 litellm==1.76.0' >" in sandbox_install_command(pinned, "/d")


async def test_concurrent_host_installs_of_one_package_run_the_installer_once(fake_npm: Path) -> None:
    folders = await asyncio.gather(*(ensure_host_install(FAKE) for _ in range(4)))
    assert len(set(folders)) == 1
    folder = folders[0]
    assert folder == tools.host_tools_dir() / "acme-fake-agent-1.2.3"
    assert (folder / MARKER).read_text().strip() == FAKE.spec
    assert (folder / FAKE.entrypoint).is_file()
    assert len(fake_npm.read_text().splitlines()) == 1


def test_installs_from_two_processes_at_once_share_one_install(fake_npm: Path) -> None:
    code = (
        "import asyncio; from harness_trainer.harnesses.tools import ToolPackage, ensure_host_install; "
        "package = ToolPackage('npm', '@acme/fake-agent', '1.2.3', 'node_modules/.bin/fake'); "
        "asyncio.run(ensure_host_install(package))"
    )
    processes = [subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ)) for _ in range(2)]
    assert [p.wait(timeout=60) for p in processes] == [0, 0]
    assert len(fake_npm.read_text().splitlines()) == 1


async def test_a_failed_install_raises_leaves_no_marker_and_is_redone_next_time(
    fake_npm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_NPM_FAIL", "1")
    with pytest.raises(HarnessError, match="registry says no"):
        await ensure_host_install(FAKE)
    assert not (tools.host_tools_dir() / FAKE.dirname / MARKER).exists()
    monkeypatch.delenv("FAKE_NPM_FAIL")
    folder = await ensure_host_install(FAKE)
    assert (folder / MARKER).is_file() and len(fake_npm.read_text().splitlines()) == 2


async def test_an_install_that_outlives_its_timeout_is_killed(fake_npm: Path) -> None:
    with pytest.raises(HarnessError, match="timed out"):
        await ensure_host_install(FAKE, timeout_s=0.05)


async def test_a_sandbox_sharing_the_host_runs_the_agent_from_the_host_cache(fake_npm: Path) -> None:
    sandbox = FakeSandbox()
    sandbox.shares_host_filesystem = True  # type: ignore[misc]
    path = await install_tool(sandbox, FAKE)
    assert path == str(tools.host_tools_dir() / FAKE.dirname / FAKE.entrypoint) == tool_path(sandbox, FAKE)
    assert sandbox.execs == []


async def test_another_sandbox_installs_inside_itself_unless_its_marker_is_there() -> None:
    sandbox = FakeSandbox()
    path = await install_tool(sandbox, FAKE)
    dest = "/home/user/.cache/harness-trainer/tools/acme-fake-agent-1.2.3"
    assert path == f"{dest}/node_modules/.bin/fake" == tool_path(sandbox, FAKE)
    command = sandbox.execs[0]["command"]
    assert f"if [ -f {dest}/{MARKER} ]; then exit 0; fi" in command
    assert f"npm install --prefix {dest}" in command and shlex.quote(FAKE.spec) in command


async def test_an_install_failing_inside_a_sandbox_says_why() -> None:
    sandbox = FakeSandbox(lambda _sandbox, _command: ExecResult(127, "", "no npm on PATH"))
    with pytest.raises(HarnessError, match="no npm on PATH"):
        await install_tool(sandbox, FAKE)


def test_the_template_agent_layer_installs_where_a_rollout_looks() -> None:
    layer = agent_layer([FAKE], "/root")
    dest = "/root/.cache/harness-trainer/tools/acme-fake-agent-1.2.3"
    assert layer == f"( {sandbox_install_command(FAKE, dest)} )"
    assert agent_layer([], "/root") == ""
