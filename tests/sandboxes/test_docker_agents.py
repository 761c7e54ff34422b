"""Agents provisioned into the Docker backend's containers (:mod:`harness_trainer.sandboxes.docker_agents`),
against the real daemon and the real npm registry and PyPI: the npm agents' bundles run in an image with
neither Node nor Python; the pip agent is set up per image at prepare, and an image without Python fails
that preparation naming the image and what is missing; an npm agent with no native build runs on the
bundle's own Node."""

from __future__ import annotations

import asyncio

import pytest

from harness_trainer.harnesses import claude_code, codex, mini_swe_agent, opencode
from harness_trainer.harnesses.bundles import ensure_bundle, install_agent, provision
from harness_trainer.harnesses.tools import ToolPackage
from harness_trainer.net import free_port
from harness_trainer.sandboxes.base import SandboxStartError, fetch_command
from harness_trainer.sandboxes.docker import DockerSandboxBackend
from tests.sandboxes.conftest import TaskFactory

pytestmark = [pytest.mark.docker, pytest.mark.slow]

NO_PYTHON = """FROM debian:bookworm-slim
RUN apt-get purge -y --auto-remove python3 python3-minimal python3.11 python3.11-minimal \\
    libpython3.11-minimal libpython3.11-stdlib >/dev/null 2>&1; ! command -v python3
"""
"""A real-world shape: a slim image with neither Node nor Python (the stand-in's Python purged)."""


async def test_npm_agents_run_from_their_bundles_where_there_is_no_node_nor_python(
    docker_backend: DockerSandboxBackend, make_task: TaskFactory
) -> None:
    packages = [opencode.PACKAGE, codex.PACKAGE, claude_code.PACKAGE]
    docker_backend.provide([await provision(package) for package in packages])
    sandbox = await docker_backend.start(make_task(NO_PYTHON), lifetime_s=120)
    try:
        assert (await sandbox.exec("command -v node npm python3 python")).exit_code == 1
        for package in packages:
            path = await install_agent(sandbox, package)
            version = await sandbox.exec(f"{path} --version")
            assert version.exit_code == 0 and package.version in version.stdout, version.stderr
        denied = await sandbox.exec(f"touch {path}")  # read-only: no rollout can change a bundle
        assert denied.exit_code != 0 and "Read-only file system" in denied.stderr
    finally:
        await sandbox.close()


async def test_the_pip_agent_is_set_up_per_image_and_an_image_without_python_fails_at_prepare(
    docker_backend: DockerSandboxBackend, make_task: TaskFactory
) -> None:
    docker_backend.provide([await provision(mini_swe_agent.PACKAGE)])
    with pytest.raises(SandboxStartError) as refused:
        await docker_backend.prepare(make_task(NO_PYTHON, name="no-python"))
    message = str(refused.value)
    assert "no-python: setting up agent mini-swe-agent-2.4.6-litellm-1.76.0-pip" in message
    assert "the task's image (debian:bookworm-slim" in message and "exited with 127" in message
    assert "mini-swe-agent==2.4.6 needs python3 in this image, which has none" in message

    sandbox = await docker_backend.start(make_task("FROM python:3.12-slim\n"), lifetime_s=120)
    try:
        path = await install_agent(sandbox, mini_swe_agent.PACKAGE)
        ran = await sandbox.exec(f"{path} --help", env={"MSWEA_CONFIGURED": "true"})
        assert ran.exit_code == 0 and "mini-swe-agent version 2.4.6" in ran.stdout + ran.stderr
    finally:
        await sandbox.close()


async def test_an_npm_agent_without_a_native_build_runs_on_the_bundles_own_node(
    docker_backend: DockerSandboxBackend, make_task: TaskFactory
) -> None:
    semver = ToolPackage("npm", "semver", "7.6.3", "node_modules/semver/bin/semver.js")
    folder = await ensure_bundle(semver)
    assert (folder / "node" / "bin" / "node").is_file()
    docker_backend.provide([await provision(semver)])
    sandbox = await docker_backend.start(make_task(NO_PYTHON), lifetime_s=120)
    try:
        path = await install_agent(sandbox, semver)
        ran = await sandbox.exec(f"{path} -r '>=1.2' 1.0.0 1.3.0 2.0.0; command -v node")
        assert ran.stdout == "1.3.0\n2.0.0\n" and ran.exit_code == 1, ran.stderr  # no node on PATH besides
    finally:
        await sandbox.close()


async def test_a_url_is_fetched_from_inside_an_image_without_curl_or_python(
    make_task: TaskFactory,
) -> None:
    """What preparation and the Jobs warm-up use to see a sandbox reach the capture proxy: in an image with
    neither curl nor Python, bash's own ``/dev/tcp`` (an unreachable port still fails)."""
    server = await asyncio.start_server(_answer_ok, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    relaying = DockerSandboxBackend(kill_grace_s=0.5, proxy_url=f"http://127.0.0.1:{port}")
    try:
        sandbox = await relaying.start(make_task(NO_PYTHON), lifetime_s=120)
        try:
            assert (await sandbox.exec("command -v curl python3")).exit_code == 1
            fetched = await sandbox.exec(fetch_command(f"http://127.0.0.1:{port}/health"), timeout_s=60)
            assert fetched.exit_code == 0 and fetched.stdout.strip() == "ok", fetched.stderr
            closed = await sandbox.exec(fetch_command(f"http://127.0.0.1:{free_port()}/health"), timeout_s=60)
            assert closed.exit_code != 0
        finally:
            await sandbox.close()
    finally:
        await relaying.aclose()
        server.close()
        await server.wait_closed()


async def _answer_ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b'HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n{"status": "ok"}')
    await writer.drain()
    writer.close()
