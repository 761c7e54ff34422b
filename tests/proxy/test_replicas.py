"""Engine replicas behind one proxy (``--replicas``): affinity, least-loaded placement, failover, probing back
in, draining, the start-up model check and per-replica metrics, over real HTTP with several fake engines."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from capture_proxy.app import build_app
from capture_proxy.config import ConfigError, ProxyConfig
from capture_proxy.journal import read_records
from capture_proxy.replicas import ReplicaSet
from capture_proxy.upstream import Upstream, UpstreamResult, process_start_time
from harness_trainer.net import free_port
from tests.proxy.conftest import ADMIN_KEY, Stack
from tests.proxy.fake_engine import FakeEngine, ServerThread
from tests.proxy.test_admin import call


@dataclass
class Replicas:
    stack: Stack
    engines: list[FakeEngine]
    urls: list[str]
    runners: list[web.AppRunner | None]

    def engine_of(self, session: dict[str, str]) -> list[str | None]:
        """The engine each of the session's journaled calls records."""
        return [record["engine"] for record in self.stack.calls(session["session_id"])]

    def kill(self, index: int) -> None:
        runner = self.runners[index]
        assert runner is not None
        self.stack.servers.stop_runner(runner)
        self.runners[index] = None

    def revive(self, index: int) -> None:
        port = int(self.urls[index].rsplit(":", 1)[1])
        assert self.stack.servers.serve(self.engines[index].app(), port) == self.urls[index]
        self.runners[index] = self.stack.servers.runners[-1]

    def replica_table(self) -> list[dict[str, Any]]:
        response = self.stack.admin.get("/replicas")
        assert response.status_code == 200, response.text
        return response.json()["replicas"]


@pytest.fixture
def replicas(servers: ServerThread, tmp_path: Path) -> Iterator[Replicas]:
    extra = [FakeEngine(), FakeEngine()]
    urls, runners = [], []
    for engine in extra:
        urls.append(servers.serve(engine.app()))
        runners.append(servers.runners[-1])
    stack = Stack(
        servers,
        tmp_path / "data",
        allowed_upstreams=tuple(urls),
        replicas=True,
        probe_interval_s=0.05,
        upstream_attempts=2,
    )
    first = servers.runners[-2]  # the stack serves its own engine, then the proxy
    yield Replicas(stack, [stack.engine, *extra], [stack.engine_url, *urls], [first, *runners])
    stack.close()
    for runner in list(servers.runners):
        servers.stop_runner(runner)


def test_each_session_stays_on_one_replica_and_new_ones_go_to_the_least_loaded(replicas: Replicas) -> None:
    sessions = [replicas.stack.new_session() for _ in range(6)]
    for _ in range(4):
        for session in sessions:
            assert call(session).status_code == 200

    engines = [replicas.engine_of(session) for session in sessions]
    assert all(len(set(calls)) == 1 and len(calls) == 4 for calls in engines)  # 100 % affinity
    assert [calls[0] for calls in engines] == replicas.urls * 2  # first calls placed round the set
    assert [len(engine.requests) for engine in replicas.engines] == [8, 8, 8]

    replicas.stack.admin.delete(f"/sessions/{sessions[1]['session_id']}")  # replica 1 now holds one
    late = replicas.stack.new_session()
    assert call(late).status_code == 200
    assert replicas.engine_of(late) == [replicas.urls[1]]
    assert [row["sessions"] for row in replicas.replica_table()] == [2, 2, 2]


def test_a_killed_replica_s_sessions_continue_on_another_with_nothing_lost(replicas: Replicas) -> None:
    sessions = [replicas.stack.new_session() for _ in range(3)]
    for session in sessions:
        assert call(session).status_code == 200
    replicas.kill(1)

    for _ in range(3):
        for session in sessions:
            assert call(session).status_code == 200

    moved = replicas.engine_of(sessions[1])
    assert moved[0] == replicas.urls[1] and len(set(moved[1:])) == 1 and moved[1] != replicas.urls[1]
    for session in sessions:
        records = replicas.stack.calls(session["session_id"])
        assert [r["kind"] for r in records] == [
            "model"
        ] * 4  # the failed attempt is no record: it was retried
        assert all(r["completion_token_ids"] for r in records)
    assert replicas.engine_of(sessions[0]) == [replicas.urls[0]] * 4
    assert replicas.engine_of(sessions[2]) == [replicas.urls[2]] * 4
    table = replicas.replica_table()
    assert [row["healthy"] for row in table] == [True, False, True]
    assert table[1]["failures"] == 1 and table[1]["sessions"] == 0
    failed_over = replicas.stack.calls(sessions[1]["session_id"])[1]
    assert failed_over["timings"]["attempts"] == 3  # two tries on the dead replica, one on the next


def test_a_replica_timing_out_past_its_retries_hands_the_call_to_another(replicas: Replicas) -> None:
    replicas.stack.stop_proxy()
    replicas.stack.config_overrides.update(upstream_timeout_s=0.3, probe_interval_s=30.0)
    replicas.stack.start_proxy()
    session = replicas.stack.new_session()
    assert call(session).status_code == 200
    slow = [{"mode": "timeout", "seconds": 2}] * 2
    httpx.post(replicas.urls[0] + "/_faults", json={"queue": slow})

    assert call(session).status_code == 200
    assert call(session).status_code == 200
    assert replicas.engine_of(session) == [replicas.urls[0], replicas.urls[1], replicas.urls[1]]
    assert [row["healthy"] for row in replicas.replica_table()] == [False, True, True]


def test_a_replica_dropping_the_connection_mid_reply_hands_the_call_to_another(replicas: Replicas) -> None:
    session = replicas.stack.new_session()
    httpx.post(replicas.urls[0] + "/_faults", json={"queue": [{"mode": "disconnect"}] * 2})

    assert call(session).status_code == 200

    records = replicas.stack.calls(session["session_id"])
    assert [(r["kind"], r["engine"]) for r in records] == [("model", replicas.urls[1])]
    assert replicas.replica_table()[0]["failures"] == 1


def test_a_replica_that_answers_again_is_probed_back_into_rotation(replicas: Replicas) -> None:
    first = [replicas.stack.new_session() for _ in range(3)]
    replicas.kill(2)
    for session in first:
        assert call(session).status_code == 200
    assert replicas.replica_table()[2]["healthy"] is False
    assert {replicas.engine_of(s)[0] for s in first} <= set(replicas.urls[:2])

    replicas.revive(2)
    deadline = time.monotonic() + 5
    while not replicas.replica_table()[2]["healthy"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert replicas.replica_table()[2]["healthy"] is True

    late = replicas.stack.new_session()
    assert call(late).status_code == 200
    assert replicas.engine_of(late) == [replicas.urls[2]]  # the least loaded: it held no session


def test_a_drained_replica_gets_no_new_session_and_its_sessions_move_until_enabled(
    replicas: Replicas,
) -> None:
    session = replicas.stack.new_session()
    assert call(session).status_code == 200
    assert replicas.stack.admin.post("/replicas/0/drain").json()["drained"] is True

    assert call(session).status_code == 200
    assert replicas.engine_of(session) == [replicas.urls[0], replicas.urls[1]]
    assert replicas.stack.admin.post("/replicas/0/enable").json()["drained"] is False
    newcomer = replicas.stack.new_session()
    assert call(newcomer).status_code == 200
    assert replicas.engine_of(newcomer) == [replicas.urls[0]]
    assert replicas.stack.admin.post("/replicas/7/drain").status_code == 404
    assert httpx.post(replicas.stack.url + "/replicas/0/drain").status_code == 401


def test_a_session_naming_its_engine_stays_on_it_and_is_not_pinned(replicas: Replicas) -> None:
    session = replicas.stack.new_session(upstream=replicas.urls[2])
    for _ in range(3):
        assert call(session).status_code == 200
    assert replicas.engine_of(session) == [replicas.urls[2]] * 3
    assert [row["sessions"] for row in replicas.replica_table()] == [0, 0, 0]


def test_metrics_show_each_replica_s_sessions_calls_failures_and_health(replicas: Replicas) -> None:
    sessions = [replicas.stack.new_session() for _ in range(2)]
    for session in sessions:
        assert call(session).status_code == 200
    replicas.kill(1)
    assert call(sessions[1]).status_code == 200

    text = httpx.get(replicas.stack.url + "/metrics").text
    for index, url in enumerate(replicas.urls):
        labels = f'{{replica="{index}",engine="{url}"}}'
        sessions_now, calls, failures, healthy = [(1, 1, 0, 1), (0, 2, 1, 0), (1, 1, 0, 1)][
            index
        ]  # 1 failed over to 2
        assert f"capture_proxy_replica_sessions{labels} {sessions_now}" in text
        assert f"capture_proxy_replica_calls_total{labels} {calls}" in text
        assert f"capture_proxy_replica_failures_total{labels} {failures}" in text
        assert f"capture_proxy_replica_healthy{labels} {healthy}" in text


def _config(tmp_path: Path, urls: list[str], **overrides: Any) -> ProxyConfig:
    return ProxyConfig(
        upstream=urls[0],
        allowed_upstreams=tuple(urls[1:]),
        replicas=True,
        data_dir=tmp_path / "data",
        admin_key=ADMIN_KEY,
        **overrides,
    )


def test_replicas_serving_different_models_are_refused_at_start_naming_both(
    servers: ServerThread, tmp_path: Path
) -> None:
    urls = [servers.serve(FakeEngine("model-a").app()), servers.serve(FakeEngine("model-b").app())]
    try:
        with pytest.raises(ConfigError) as refused:
            servers.serve(build_app(_config(tmp_path, urls)))
        message = str(refused.value)
        assert all(name in message for name in (*urls, "model-a", "model-b"))

        with pytest.raises(ConfigError, match="model-b"):  # a configured name must be served by each
            servers.serve(build_app(_config(tmp_path, urls, served_model="model-a")))

        port = free_port()
        command = [sys.executable, "-m", "capture_proxy", "--replicas", "--port", str(port)]
        command += ["--upstream", urls[0], "--upstream", urls[1], "--data-dir", str(tmp_path / "cli")]
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 2, done.stderr
        assert urls[0] in done.stderr and urls[1] in done.stderr and "different models" in done.stderr
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0  # it never served
    finally:
        for runner in list(servers.runners):
            servers.stop_runner(runner)


def test_a_journal_written_before_the_engine_field_still_loads(replicas: Replicas, tmp_path: Path) -> None:
    session = replicas.stack.new_session()
    for _ in range(2):
        assert call(session).status_code == 200
    journal = replicas.stack.data_dir / "sessions" / session["session_id"] / "calls.jsonl"
    lines = [orjson.loads(line) for line in journal.read_bytes().splitlines() if line.strip()]
    assert all(line["engine"] == replicas.urls[0] for line in lines)
    old = tmp_path / "old.jsonl"
    old.write_bytes(
        b"".join(orjson.dumps({k: v for k, v in line.items() if k != "engine"}) + b"\n" for line in lines)
    )

    records = list(read_records(old))
    assert [r.engine for r in records] == [None, None]
    assert [r.completion_token_ids for r in records] == [
        r.completion_token_ids for r in read_records(journal)
    ]


def test_a_replica_down_at_start_is_left_out_until_a_probe_finds_it(
    servers: ServerThread, tmp_path: Path
) -> None:
    dead_port = free_port()
    dead, alive = FakeEngine(), FakeEngine()
    alive_url = servers.serve(alive.app())
    config = _config(
        tmp_path, [f"http://127.0.0.1:{dead_port}", alive_url], probe_interval_s=0.05, port=free_port()
    )
    try:
        url = servers.serve(build_app(config), config.port)
        admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)
        assert [row["healthy"] for row in admin.get("/replicas").json()["replicas"]] == [False, True]
        session = admin.post("/sessions", json={}).json()

        assert call(session).status_code == 200
        assert alive.requests[-1]["model"] == "fake-model"  # the set's model, not asked of the dead default

        servers.serve(dead.app(), dead_port)
        deadline = time.monotonic() + 5
        while not admin.get("/replicas").json()["replicas"][0]["healthy"] and time.monotonic() < deadline:
            time.sleep(0.05)
        newcomer = admin.post("/sessions", json={}).json()
        assert call(newcomer).status_code == 200
        assert len(dead.requests) == 1  # back in rotation, and the least loaded
        admin.close()
    finally:
        for runner in list(servers.runners):
            servers.stop_runner(runner)


def _set(count: int = 3) -> ReplicaSet:
    return ReplicaSet([Upstream(f"http://127.0.0.1:{9000 + i}") for i in range(count)], "m", 5.0)


def test_placement_takes_the_fewest_pinned_then_the_lowest_index_and_skips_a_drained_replica() -> None:
    replicas = _set()
    assert [replicas.pick(f"s{i}").index for i in range(4)] == [0, 1, 2, 0]
    assert replicas.pick("s1").index == 1  # pinned: the same replica again
    replicas.release("s1")
    replicas.drain(1)
    assert replicas.pick("new").index == 2  # 1 has fewest but is drained
    replicas.enable(1)
    assert replicas.pick("newer").index == 1
    assert [r.sessions for r in replicas.replicas] == [2, 1, 2]


def test_with_every_replica_down_a_session_keeps_its_pin() -> None:
    replicas = _set(2)
    assert replicas.pick("s").index == 0
    down = UpstreamResult(None, 502, "cannot reach the engine", unreachable=True)
    replicas.observe(replicas.replicas[0], down)
    assert replicas.pick("s").index == 1  # moved
    replicas.observe(replicas.replicas[1], down)
    assert replicas.pick("s").index == 1 and replicas.pick("other").index == 0  # nothing in rotation
    refused = UpstreamResult(None, 503, "engine answered 503")
    replicas.replicas[0].healthy = True
    replicas.observe(replicas.replicas[0], refused)  # an engine that answers, even a 5xx, stays up
    assert replicas.replicas[0].healthy and replicas.replicas[0].failures == 1  # the one before


def wait_for(check: Any, timeout: float = 10.0) -> None:
    """Poll ``check()`` until it is true (the probe loop runs every 0.05 s here)."""
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.05)


def placed_on(replicas: Replicas) -> str | None:
    """The engine a newly minted session's first call goes to."""
    session = replicas.stack.new_session()
    assert call(session).status_code == 200
    return replicas.engine_of(session)[0]


def restart_after_a_failed_call(replicas: Replicas, index: int, *, new_process: bool) -> None:
    """Three sessions placed round the set; replica ``index`` dies, its session fails over, then it comes
    back (``new_process``: with another start time, as a restarted engine) and is probed in."""
    sessions = [replicas.stack.new_session() for _ in range(3)]
    for session in sessions:
        assert call(session).status_code == 200
    replicas.kill(index)
    assert call(sessions[index]).status_code == 200  # failed over
    if new_process:
        replicas.engines[index].start_time += 100.0
    replicas.revive(index)
    wait_for(lambda: replicas.replica_table()[index]["healthy"])
    assert replicas.replica_table()[index]["healthy"] is True


def test_a_replica_restarted_while_a_policy_version_is_set_is_stale_and_gets_no_session_until_enabled(
    replicas: Replicas,
) -> None:
    assert replicas.stack.admin.put("/policy", json={"version": 3}).status_code == 200
    restart_after_a_failed_call(replicas, 1, new_process=True)

    row = replicas.replica_table()[1]
    assert row["stale"] is True and row["drained"] is False
    assert placed_on(replicas) != replicas.urls[1]  # it held the fewest sessions, but is stale
    text = httpx.get(replicas.stack.url + "/metrics").text
    labels = f'{{replica="1",engine="{replicas.urls[1]}"}}'
    assert f"capture_proxy_replica_stale{labels} 1" in text
    assert f"capture_proxy_replica_in_rotation{labels} 0" in text

    assert replicas.stack.admin.post("/replicas/1/enable").json()["stale"] is False
    assert placed_on(replicas) == replicas.urls[1]
    assert replicas.replica_table()[1]["stale"] is False  # the new start time is the one compared now


def test_a_replica_back_with_an_unchanged_start_time_is_not_stale(replicas: Replicas) -> None:
    assert replicas.stack.admin.put("/policy", json={"version": 3}).status_code == 200
    restart_after_a_failed_call(replicas, 1, new_process=False)  # the same process answered again

    assert replicas.replica_table()[1]["stale"] is False
    assert placed_on(replicas) == replicas.urls[1]


def test_without_a_policy_version_a_restarted_replica_is_not_stale(replicas: Replicas) -> None:
    restart_after_a_failed_call(replicas, 1, new_process=True)

    assert replicas.replica_table()[1]["stale"] is False
    assert placed_on(replicas) == replicas.urls[1]


def test_a_healthy_replica_whose_start_time_changes_is_stale(replicas: Replicas) -> None:
    assert replicas.stack.admin.put("/policy", json={"version": 1}).status_code == 200
    replicas.engines[2].start_time += 100.0  # restarted between two probes: no call of it failed

    wait_for(lambda: replicas.replica_table()[2]["stale"])
    assert [(row["healthy"], row["stale"]) for row in replicas.replica_table()] == [
        (True, False),
        (True, False),
        (True, True),
    ]
    assert {placed_on(replicas) for _ in range(4)} == set(replicas.urls[:2])


def test_with_every_replica_stale_a_call_fails_without_reaching_old_weights(replicas: Replicas) -> None:
    session = replicas.stack.new_session()
    assert call(session).status_code == 200
    assert replicas.stack.admin.put("/policy", json={"version": 1}).status_code == 200
    for engine in replicas.engines:
        engine.start_time += 100.0
    wait_for(lambda: all(row["stale"] for row in replicas.replica_table()))
    sent = [len(engine.requests) for engine in replicas.engines]

    assert call(session).status_code == 502
    assert [len(engine.requests) for engine in replicas.engines] == sent
    records = replicas.stack.calls(session["session_id"])
    assert records[-1]["kind"] == "upstream_error" and "stale" in records[-1]["finding"]["detail"]


def test_the_stale_decision_follows_the_start_time_and_the_policy_version() -> None:
    version: list[int | None] = [None]
    replicas = ReplicaSet(
        [Upstream(f"http://127.0.0.1:{9000 + i}") for i in range(2)], "m", 5.0, lambda: version[0]
    )
    first = replicas.replicas[0]
    replicas.note_start(first, 10.0, back=False)  # the first reading is adopted
    replicas.note_start(first, 20.0, back=False)  # a restart, with no version set: recorded only
    assert not first.stale and first.start_time == 20.0
    version[0] = 1
    replicas.note_start(first, None, back=False)  # unreadable: a healthy replica stays as it is
    replicas.note_start(first, 20.0, back=True)  # back in with the same process
    assert not first.stale
    replicas.note_start(first, None, back=True)  # back in, its start unknown: it may have restarted
    assert first.stale and not first.in_rotation
    replicas.enable(0)
    assert not first.stale and first.in_rotation
    replicas.note_start(first, 30.0, back=False)
    assert first.stale and replicas.pick("s").index == 1


def test_the_start_time_is_read_from_a_prometheus_page_labelled_or_not() -> None:
    page = "# HELP process_start_time_seconds x\nprocess_start_time_seconds_x 1\n"
    page += "process_start_time_seconds 12.5\n"
    assert process_start_time(page) == 12.5
    assert process_start_time('process_start_time_seconds{pid="a b"} 7e2\n') == 700.0
    assert process_start_time("vllm:num_requests_running 0\n") is None
