"""EngineReplicas over real dev engines on loopback: a push reaches every replica; a replica that dies is
reported out (and drained at a real ``capture_proxy --replicas``) while the step goes on; restarted with its
start-up weights (between two steps, or between a step's push and its resume), it is given the current
version before it is enabled again."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from capture_proxy.admin_client import CaptureClient
from harness_trainer.dev_engine.process import EngineProcess, start_engine
from harness_trainer.engines import DevEngine, EngineUnavailable, PushRefused, RetryPolicy
from harness_trainer.engines.replicas import EngineReplicas
from harness_trainer.net import free_port
from harness_trainer.rollouts.server.proxy_process import ProxyProcess
from tests.proxy.replica_rig import ReplicaRig, rig, weight_version, weights  # noqa: F401 - rig: a fixture

NO_RETRY = RetryPolicy(attempts=1)


def start_on(model_dir: Path, port: int) -> EngineProcess:
    """A dev engine on ``port`` (to restart one where the proxy and the set expect it)."""
    return start_engine(model_dir, port=port)


@pytest.fixture
def two_engines(tiny_model_dir: Path) -> Iterator[list[EngineProcess]]:
    started = [start_on(tiny_model_dir, free_port()) for _ in range(2)]
    yield started
    for engine in started:
        engine.stop()


def replica_proxy(first: str, second: str, folder: Path) -> tuple[ProxyProcess, CaptureClient]:
    """A real ``capture_proxy --replicas`` over two engines (admin key ``key``), not yet started, and its
    admin client."""
    proxy = ProxyProcess(
        first, folder, "key", "127.0.0.1", free_port(), allowed_upstreams=(second,), replicas=True
    )
    return proxy, CaptureClient(proxy.url, "key")


def greedy_reply(url: str) -> tuple[str, int]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Count to five."}], "temperature": 0.0}
    reply = httpx.post(url + "/v1/chat/completions", json={**body, "max_tokens": 12}, timeout=120).json()
    return reply["choices"][0]["message"]["content"], reply["weight_version"]


async def step(replicas: EngineReplicas, named: dict[str, torch.Tensor], version: int) -> int:
    await replicas.pause()
    served = await replicas.push_weights(named, version)
    await replicas.resume()
    return served


@pytest.mark.slow
async def test_a_push_reaches_every_replica_and_they_then_sample_alike(
    two_engines: list[EngineProcess], tiny_model_dir: Path
) -> None:
    replicas = EngineReplicas([DevEngine(engine.url) for engine in two_engines])
    assert await step(replicas, weights(tiny_model_dir, 1), 1) == 1
    assert [weight_version(engine.url) for engine in two_engines] == [1, 1]
    first, second = (greedy_reply(engine.url) for engine in two_engines)
    assert first == second and first[1] == 1
    assert replicas.out_of_rotation == [] and [r["version"] for r in replicas.report()] == [1, 1]


@pytest.mark.slow
async def test_a_dead_replica_is_drained_and_enabled_only_once_it_has_the_current_version(
    two_engines: list[EngineProcess], tiny_model_dir: Path, tmp_path: Path
) -> None:
    first, second = two_engines
    proxy, client = replica_proxy(first.url, second.url, tmp_path / "proxy")
    await proxy.start(client)
    replicas = EngineReplicas(
        [DevEngine(engine.url, retry=NO_RETRY) for engine in two_engines],
        proxy_url=proxy.url,
        admin_key="key",
    )
    try:
        assert await step(replicas, weights(tiny_model_dir, 1), 1) == 1

        second.stop()
        assert await step(replicas, weights(tiny_model_dir, 2), 2) == 2  # the step goes on with one
        assert replicas.out_of_rotation == [1]
        report = replicas.report()[1]
        assert report["out"] and report["drained"] and "pause" in report["error"]
        assert weight_version(first.url) == 2
        assert [r["drained"] for r in await client.replicas()] == [False, True]

        port = int(second.url.rsplit(":", 1)[1])
        restarted = start_on(tiny_model_dir, port)  # back, with its start-up weights
        two_engines[1] = restarted
        assert weight_version(restarted.url) == 0
        assert [r["drained"] for r in await client.replicas()] == [False, True]  # still out at the proxy

        assert await step(replicas, weights(tiny_model_dir, 3), 3) == 3
        assert [weight_version(engine.url) for engine in two_engines] == [3, 3]
        assert replicas.out_of_rotation == [] and replicas.report()[1]["error"] is None
        assert [r["drained"] for r in await client.replicas()] == [False, False]
        assert greedy_reply(first.url) == greedy_reply(restarted.url)
    finally:
        await proxy.stop()
        await client.aclose()


@pytest.mark.slow
async def test_a_replica_restarted_between_steps_is_enabled_once_pushed_and_samples_at_the_dispatch_version(
    rig: ReplicaRig,  # noqa: F811 - the imported fixture
) -> None:
    await rig.step(1)
    rig.restart(1)
    await rig.wait_for(lambda table: table[1]["stale"])
    await rig.replicas.pause()
    await rig.replicas.resume()  # no push (as after a refused one): it still holds its start-up weights
    assert [row["stale"] for row in await rig.table()] == [False, True]
    assert rig.replicas.out_of_rotation == []  # the set saw no failure: only the proxy knows

    await rig.step(2)

    assert [row["stale"] for row in await rig.table()] == [False, False]
    assert [weight_version(url) for url in rig.urls] == [2, 2]
    assert [state["version"] for state in rig.replicas.report()] == [2, 2]
    records = [rig.placed_on() for _ in range(2)]
    assert [record["engine"] for record in records] == rig.urls
    assert all(record["weight_version"] == record["dispatch_version"] == 2 for record in records)


@pytest.mark.slow
async def test_a_replica_restarted_between_push_and_resume_is_drained_and_comes_back_at_the_next_push(
    rig: ReplicaRig,  # noqa: F811 - the imported fixture
) -> None:
    await rig.step(1)
    await rig.replicas.pause()
    await rig.replicas.push_weights(weights(rig.model_dir, 2), 2)
    rig.restart(1)  # took the push, then lost it: a new process with its start-up weights

    await rig.replicas.resume()
    await rig.client.set_policy(None, 2)

    assert rig.replicas.out_of_rotation == [1]
    state = rig.replicas.report()[1]
    assert state["error"] == "serves version none (its start-up weights), not 2"
    assert state["drained"] and state["version"] is None
    assert [row["drained"] for row in await rig.table()] == [False, True]
    assert [weight_version(url) for url in rig.urls] == [2, 0]
    assert [httpx.get(url + "/is_paused").json()["is_paused"] for url in rig.urls] == [False, True]
    record = rig.placed_on()  # only the replica at version 2 samples
    assert record["engine"] == rig.urls[0] and record["weight_version"] == 2

    await rig.step(3)

    assert rig.replicas.out_of_rotation == [] and rig.replicas.report()[1]["error"] is None
    assert [weight_version(url) for url in rig.urls] == [3, 3]
    assert [(row["drained"], row["stale"]) for row in await rig.table()] == [(False, False), (False, False)]
    record = rig.placed_on()  # the fewest sessions pinned: the replica back in rotation
    assert record["engine"] == rig.urls[1] and record["weight_version"] == record["dispatch_version"] == 3


@pytest.mark.slow
async def test_without_a_proxy_a_dead_replica_is_only_recorded(
    two_engines: list[EngineProcess], tiny_model_dir: Path
) -> None:
    replicas = EngineReplicas([DevEngine(engine.url, retry=NO_RETRY) for engine in two_engines])
    two_engines[0].stop()
    assert await step(replicas, weights(tiny_model_dir, 1), 1) == 1
    assert replicas.out_of_rotation == [0] and replicas.report()[0]["version"] is None
    assert replicas.base_url == two_engines[0].url
    two_engines[1].stop()
    with pytest.raises(EngineUnavailable, match="no replica paused"):
        await replicas.pause()


class Refusing:
    """An engine that answers pause (unless ``unreachable``) and resume, and refuses every push (its old
    weights whole)."""

    def __init__(self, base_url: str, unreachable: bool = False) -> None:
        self.base_url, self.resumed, self.unreachable = base_url, 0, unreachable

    async def pause(self) -> None:
        if self.unreachable:
            raise EngineUnavailable(f"{self.base_url} unreachable")

    async def resume(self) -> None:
        self.resumed += 1

    async def push_weights(self, named_tensors: object, version: int) -> int:
        raise PushRefused(f"{self.base_url} refused version {version}")

    async def health(self) -> bool:
        return True

    async def served_version(self) -> int | None:
        return None  # it never took a push: its start-up weights


async def test_a_push_every_replica_refused_is_a_push_refused_and_every_replica_resumes() -> None:
    engines = [Refusing("http://a"), Refusing("http://b")]
    replicas = EngineReplicas(engines)
    await replicas.pause()
    with pytest.raises(PushRefused, match="no replica took version 1"):
        await replicas.push_weights({}, 1)
    await replicas.resume()  # what the trainer does after a refusal: the old weights are whole
    assert [engine.resumed for engine in engines] == [1, 1] and replicas.version is None


async def test_a_drain_the_proxy_did_not_take_is_recorded_and_asked_again_on_resume() -> None:
    replicas = EngineReplicas(
        [Refusing("http://a"), Refusing("http://b", unreachable=True)],
        proxy_url=f"http://127.0.0.1:{free_port()}",
    )
    await replicas.pause()
    state = replicas.report()[1]
    assert state["out"] and not state["drained"] and "drain at the proxy" in state["error"]
    await replicas.resume()  # the proxy is still down: asked again, still recorded
    assert replicas.report()[1]["error"].count("drain at the proxy") == 2


class Forgetful(Refusing):
    """A replica whose push answers the version but whose weights stay the start-up ones (a reload that did
    not happen): it says so when asked."""

    def __init__(self, base_url: str, served: int | None = None) -> None:
        super().__init__(base_url)
        self.served, self.paused = served, 0

    async def pause(self) -> None:
        self.paused += 1

    async def push_weights(self, named_tensors: object, version: int) -> int:
        return version

    async def served_version(self) -> int | None:
        return self.served


async def test_a_replica_that_does_not_serve_the_pushed_version_is_out_paused_and_not_resumed() -> None:
    engines = [Forgetful("http://a", served=1), Forgetful("http://b", served=None)]
    replicas = EngineReplicas(engines)
    await replicas.pause()
    assert await replicas.push_weights({}, 1) == 1

    await replicas.resume()

    assert replicas.out_of_rotation == [1]
    assert replicas.report()[1]["error"] == "serves version none (its start-up weights), not 1"
    assert [engine.resumed for engine in engines] == [1, 0] and engines[1].paused == 2
    assert await replicas.served_version() == 1  # what the replicas in rotation serve


async def test_when_no_replica_serves_the_pushed_version_resume_fails_and_none_resumes() -> None:
    engines = [Forgetful("http://a", served=4), Forgetful("http://b", served=4)]
    replicas = EngineReplicas(engines)
    await replicas.pause()
    await replicas.push_weights({}, 5)
    with pytest.raises(EngineUnavailable, match="no replica serving version 5 resumed"):
        await replicas.resume()
    assert replicas.out_of_rotation == [0, 1] and [engine.resumed for engine in engines] == [0, 0]
    assert "serves version 4, not 5" in replicas.report()[0]["error"]


class Staging(Refusing):
    """A replica with a pause-free part of its push (as VLLMEngine's file path): it stages, refuses, or is
    unreachable, and records what it was given to close."""

    def __init__(self, base_url: str, stage: str = "ok") -> None:
        super().__init__(base_url)
        self.stage, self.staged, self.closed = stage, [], 0

    async def stage_weights(self, named_tensors: object, version: int) -> None:
        if self.stage == "refuse":
            raise PushRefused(f"{self.base_url} cannot load version {version}")
        if self.stage == "unreachable":
            raise EngineUnavailable(f"{self.base_url} unreachable")
        self.staged.append(version)

    def close(self) -> None:
        self.closed += 1


async def test_staging_reaches_every_replica_and_one_that_fails_it_is_out() -> None:
    engines = [Staging("http://a"), Staging("http://b", stage="unreachable")]
    replicas = EngineReplicas(engines)
    await replicas.stage_weights({}, 1)
    assert engines[0].staged == [1] and replicas.out_of_rotation == [1]
    assert "staging of 1" in replicas.report()[1]["error"]
    replicas.close()
    assert [engine.closed for engine in engines] == [1, 1]


async def test_staging_every_replica_refused_is_a_push_refused_and_none_goes_out() -> None:
    replicas = EngineReplicas([Staging("http://a", stage="refuse"), Staging("http://b", stage="refuse")])
    with pytest.raises(PushRefused, match="no replica can load version 2"):
        await replicas.stage_weights({}, 2)
    assert replicas.out_of_rotation == []  # nothing was sent: each serves its old weights whole
