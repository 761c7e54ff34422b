"""The host's trust store and proxies reach image builds and sandboxes: HTTPS that works on the host works
in a ``RUN`` step and in an agent's sandbox (these machines' egress proxy has a CA only the host trusts, so
here the real fetches below fail without it), and each backend can opt out."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from harness_trainer.sandboxes.base import SandboxStartError
from harness_trainer.sandboxes.host_trust import CA_ENV, CA_FILE_NAME, CA_PATH, HostTrust, host_ca_bundle
from harness_trainer.sandboxes.local import LocalSandboxBackend
from tests.sandboxes.conftest import TaskFactory

FETCH = "import sys, urllib.request as u; print(u.urlopen(sys.argv[1], timeout=20).status)"
NODE_FETCH = (
    "require('https').get(process.argv[1], r => { console.log(r.statusCode); process.exit(0) })"
    ".on('error', e => { console.log(e.code || e.message); process.exit(1) })"
)


def test_the_host_bundle_and_proxies_are_read_from_the_environment(tmp_path: Path) -> None:
    bundle = tmp_path / "corp.pem"
    bundle.write_text("-----BEGIN CERTIFICATE-----\n")
    environ = {
        "SSL_CERT_FILE": str(bundle),
        "HTTPS_PROXY": "http://proxy:3128",
        "no_proxy": "localhost",
        "X": "1",
    }
    trust = HostTrust.from_host(environ)
    assert trust.ca_bundle == bundle.resolve()
    assert dict(trust.proxy) == {"HTTPS_PROXY": "http://proxy:3128", "no_proxy": "localhost"}
    assert trust.env("/ca.pem") == {**{name: "/ca.pem" for name in CA_ENV}, **trust.proxy}
    assert host_ca_bundle({"SSL_CERT_FILE": str(tmp_path / "absent")}) != tmp_path / "absent"
    assert HostTrust(None, {"HTTP_PROXY": "p"}).env("/ca.pem") == {"HTTP_PROXY": "p"}  # no bundle: no CA vars


def test_every_stage_of_a_dockerfile_gets_the_bundle_right_after_its_from(tmp_path: Path) -> None:
    text = "ARG V=1\nFROM python:3.11-slim AS build\nRUN pip wheel x\n"
    text += "FROM \\\n  debian:bookworm-slim\nRUN true\n"
    layered = HostTrust(tmp_path / "ca.pem").dockerfile(text).splitlines()
    copy = f"COPY {CA_FILE_NAME} {CA_PATH}"
    assert layered[0] == "ARG V=1" and layered[1] == "FROM python:3.11-slim AS build"
    assert layered[2] == copy and layered[3].startswith(f"ENV SSL_CERT_FILE={CA_PATH} ")
    assert layered[5:7] == ["FROM \\", "  debian:bookworm-slim"] and layered[7] == copy  # a continued FROM
    assert all(f"{name}={CA_PATH}" in layered[3] for name in CA_ENV)
    assert HostTrust(None).dockerfile(text) == text


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node on PATH (.ci/run installs it)")
async def test_a_local_sandbox_trusts_what_the_host_trusts(tmp_path: Path, make_task: TaskFactory) -> None:
    trusting = LocalSandboxBackend(tmp_path / "a")
    sandbox = await trusting.start(make_task(), lifetime_s=60)
    try:
        bundle = (await sandbox.exec('echo "$NODE_EXTRA_CA_CERTS"')).stdout.strip()
        assert bundle == str(host_ca_bundle())
        # npm's own TLS client, as the agents' installs use it: it carries its own CA list, so this is what
        # fails behind a proxy with a private CA unless the host's bundle is pointed at.
        node = await sandbox.exec(f'node -e "{NODE_FETCH}" https://registry.npmjs.org/', timeout_s=60)
        assert node.exit_code == 0 and node.stdout.strip() == "200", node.stdout + node.stderr
    finally:
        await sandbox.close()
    plain = LocalSandboxBackend(tmp_path / "b", inherit_host_trust=False)
    sandbox = await plain.start(make_task(), lifetime_s=60)
    try:
        listed = (await sandbox.exec("env")).stdout
        assert not [name for name in CA_ENV if f"\n{name}=" in f"\n{listed}"]
    finally:
        await sandbox.close()


@pytest.mark.docker
async def test_a_docker_build_and_its_sandbox_reach_https_as_the_host_does(make_task: TaskFactory) -> None:
    from harness_trainer.sandboxes.docker import DockerSandboxBackend

    url = "https://pypi.org/simple/pip/"
    dockerfile = f"FROM python:3.12-slim\nRUN python3 -c '{FETCH}' {url} > /fetched.txt\n"
    backend = DockerSandboxBackend(kill_grace_s=0.5)
    sandbox = await backend.start(make_task(dockerfile), lifetime_s=120)
    try:
        assert (await sandbox.exec("cat /fetched.txt")).stdout == "200\n"
        again = await sandbox.exec(f"python3 -c '{FETCH}' {url}", timeout_s=60)
        assert again.stdout == "200\n", again.stderr
    finally:
        await backend.aclose()
    bare = make_task()  # no Dockerfile: the base image, built once to carry the bundle too
    sandbox = await backend.start(bare, lifetime_s=120)
    try:
        assert (await sandbox.exec(f"python3 -c '{FETCH}' {url}", timeout_s=60)).stdout == "200\n"
    finally:
        await backend.aclose()
    if host_ca_bundle() is None:
        return
    # Opting out: the build has only the image's own trust store. Behind these machines' egress proxy that
    # fails the same build; a host whose CAs a fresh image already trusts builds it either way.
    plain = DockerSandboxBackend(inherit_host_trust=False)
    try:
        await plain.start(make_task(dockerfile), lifetime_s=120)
    except SandboxStartError as exc:
        assert "CERTIFICATE_VERIFY_FAILED" in str(exc), str(exc)
    finally:
        await plain.aclose()


def test_serve_carries_the_host_trust_to_backends_on_this_machine_unless_told_not_to(tmp_path: Path) -> None:
    import argparse

    from harness_trainer.launch.config_file import apply_config
    from harness_trainer.launch.serve import add_serve_arguments
    from harness_trainer.rollouts.server.runtime import RolloutRuntime, RuntimeConfig
    from harness_trainer.sandboxes.host_trust import NO_TRUST

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    base = ["--dataset", "d", "--upstream", "http://e:8000"]
    assert apply_config(parser.parse_args(base)).host_trust is True
    assert apply_config(parser.parse_args([*base, "--no-host-trust"])).host_trust is False
    for inherit in (True, False):
        runtime = RolloutRuntime(RuntimeConfig("http://e:8000", tmp_path, inherit_host_trust=inherit))
        local = runtime.backend("local").backend
        assert local.trust == (HostTrust.from_host() if inherit else NO_TRUST)
        runtime.backend("e2b")  # remote: the option is not its (it would refuse an unknown keyword)
