"""What the Docker backend's snapshots (:mod:`harness_trainer.sandboxes.docker_snapshots`) add to the forking
contract (test_fork_contract.py runs that against it too), against the real daemon: what a setup installed
anywhere in the image is in every member, the agents' bundles are mounted into members (not baked into the
snapshot), a member without internet still reaches the capture proxy's loopback URL, a snapshot of a dead
process is removed by the next backend's first start, and a dropped snapshot starts nothing."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import docker
import pytest

from harness_trainer.sandboxes.base import AgentProvision, SandboxStartError
from harness_trainer.sandboxes.docker import DockerSandboxBackend
from harness_trainer.sandboxes.docker_daemon import LABEL, RUN_ID, SNAPSHOT_LABEL
from tests.sandboxes.conftest import TaskFactory
from tests.sandboxes.test_docker import FETCH

pytestmark = pytest.mark.docker


async def test_what_the_setup_installed_outside_the_private_paths_is_in_every_member(
    docker_backend: DockerSandboxBackend, make_task: TaskFactory
) -> None:
    task = make_task()
    source = await docker_backend.start(task, lifetime_s=120)
    members = []
    try:
        installed = await source.exec(
            "mkdir -p /opt/x && echo data > /opt/x/file && printf '#!/bin/sh\\necho tool ran\\n' "
            "> /usr/local/bin/tool && chmod +x /usr/local/bin/tool"
        )
        assert installed.exit_code == 0, installed.stderr
        snapshot = await docker_backend.snapshot(source)
        assert (await source.exec("cat /opt/x/file")).stdout == "data\n"  # the source runs on
        labels = (await docker_backend.call(docker_backend.client.api.inspect_image, snapshot.id))["Config"][
            "Labels"
        ]
        assert (labels[LABEL], labels[SNAPSHOT_LABEL]) == (RUN_ID, source.id)
        members = [await docker_backend.start_from(snapshot, task, lifetime_s=120) for _ in range(2)]
        for member in members:
            ran = await member.exec("cat /opt/x/file; tool; echo $HOME")
            assert ran.stdout == "data\ntool ran\n/home/user\n", ran.stderr
            assert member in docker_backend.live
    finally:
        for sandbox in [*members, source]:
            await sandbox.close()
    await docker_backend.drop(snapshot)
    with pytest.raises(docker.errors.ImageNotFound):
        await docker_backend.call(docker_backend.client.api.inspect_image, snapshot.id)


async def test_a_member_sees_the_provided_agents_bundles_as_mounts_not_as_copies(
    docker_backend: DockerSandboxBackend, make_task: TaskFactory, tmp_path: Path
) -> None:
    bundle = tmp_path / "bundle"
    (bundle / "bin").mkdir(parents=True)
    (bundle / "bin" / "agent").write_text("v1\n")
    agent = AgentProvision("fake-agent", bundle)
    docker_backend.provide([agent])
    task = make_task()
    source = await docker_backend.start(task, lifetime_s=120)
    try:
        snapshot = await docker_backend.snapshot(source)
    finally:
        await source.close()
    (bundle / "bin" / "agent").write_text("v2\n")  # a mount shows the bundle as it is now; a copy would not
    member = await docker_backend.start_from(snapshot, task, lifetime_s=120)
    try:
        assert (await member.exec(f"cat {agent.path}/bin/agent")).stdout == "v2\n"
        denied = await member.exec(f"touch {agent.path}/bin/agent")
        assert denied.exit_code != 0 and "Read-only file system" in denied.stderr
        assert member.provisioned == frozenset({"fake-agent"})
    finally:
        await member.close()
        await docker_backend.drop(snapshot)


async def test_a_member_without_internet_has_no_network_but_reaches_the_loopback_proxy(
    make_task: TaskFactory,
) -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: 7\r\n\r\nproxied")
        await writer.drain()
        writer.close()

    proxy = await asyncio.start_server(answer, "127.0.0.1", 0)
    engine = await asyncio.start_server(answer, "127.0.0.1", 0)  # any other loopback service of the host
    proxy_port, engine_port = (s.sockets[0].getsockname()[1] for s in (proxy, engine))
    backend = DockerSandboxBackend(proxy_url=f"http://127.0.0.1:{proxy_port}/v1", kill_grace_s=0.5)
    task = make_task(allow_internet=False, cpus=0.5, memory_mb=128)
    try:
        source = await backend.start(task, lifetime_s=60)
        snapshot = await backend.snapshot(source)
        await source.close()
        member = await backend.start_from(snapshot, task, lifetime_s=60)
        reached = await member.exec(FETCH + f"http://127.0.0.1:{proxy_port}/v1/models")
        assert reached.stdout == "proxied\n", reached.stderr
        assert (await member.exec(FETCH + f"http://127.0.0.1:{engine_port}/")).exit_code != 0
        assert (await member.exec("ls /sys/class/net")).stdout.split() == ["lo"]
        limits = (await backend.call(backend.client.api.inspect_container, member.container))["HostConfig"]
        assert (limits["NanoCpus"], limits["Memory"], limits["NetworkMode"]) == (
            500_000_000,
            128 << 20,
            "none",
        )
    finally:
        await backend.aclose()  # closes the member and drops the snapshot
        assert not backend.snapshots
        proxy.close()
        engine.close()


async def test_a_snapshot_left_by_a_dead_process_is_removed_by_the_next_backends_first_start(
    make_task: TaskFactory,
) -> None:
    client = docker.from_env()
    dead = f"{socket.gethostname()}:999999999:0"
    made = []
    try:
        for owner in (dead, "nowhere:1:0", RUN_ID):  # a dead process's, another host's, this process's
            container = client.api.create_container("ht-debian:bookworm", ["true"])
            try:
                labels = {LABEL: owner, SNAPSHOT_LABEL: container["Id"][:12]}
                made.append(client.api.commit(container["Id"], "ht-snapshot-test", conf={"Labels": labels}))
            finally:
                client.api.remove_container(container["Id"], force=True)
        backend = DockerSandboxBackend(kill_grace_s=0.5)
        try:
            await (await backend.start(make_task(), lifetime_s=60)).close()
        finally:
            await backend.aclose()
        left = {image["Id"] for image in client.api.images(filters={"label": SNAPSHOT_LABEL})}
        assert made[0]["Id"] not in left
        assert {made[1]["Id"], made[2]["Id"]} <= left  # only a dead process of this host's is a leftover
    finally:
        for image in made:
            try:
                client.api.remove_image(image["Id"], force=True)
            except docker.errors.ImageNotFound:
                pass
        client.close()


async def test_a_dropped_snapshot_starts_nothing(
    docker_backend: DockerSandboxBackend, make_task: TaskFactory
) -> None:
    task = make_task()
    source = await docker_backend.start(task, lifetime_s=60)
    try:
        snapshot = await docker_backend.snapshot(source)
    finally:
        await source.close()
    await docker_backend.drop(snapshot)
    with pytest.raises(SandboxStartError, match=f"snapshot {snapshot.id} .* is not held"):
        await docker_backend.start_from(snapshot, task, lifetime_s=60)
    assert not docker_backend.live
    with pytest.raises(docker.errors.ImageNotFound):
        await docker_backend.call(docker_backend.client.api.inspect_image, snapshot.id)
