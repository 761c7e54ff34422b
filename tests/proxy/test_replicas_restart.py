"""An engine replica that restarts with its start-up weights while training runs (rule 8 of
``capture_proxy/replicas.py``), with real processes on loopback: two dev engines, ``python -m capture_proxy
--replicas`` and the trainer's :class:`EngineReplicas`. The proxy takes the restarted replica out (stale)
and places no new session on it until the trainer's next push has given it the current version and enabled
it; then what it samples carries that version."""

from __future__ import annotations

import pytest

from tests.engines.test_engine_replicas import weight_version
from tests.proxy.replica_rig import ReplicaRig, rig  # noqa: F401 - a fixture


@pytest.mark.slow
async def test_an_engine_restarted_between_steps_gets_no_new_session_until_the_next_push_enables_it(
    rig: ReplicaRig,  # noqa: F811 - the imported fixture
) -> None:
    await rig.step(1)
    first = rig.placed_on()
    second = rig.placed_on()
    assert [first["engine"], second["engine"]] == rig.urls  # one session on each replica
    assert second["weight_version"] == second["dispatch_version"] == 1

    rig.restart(1)  # no call of it failed: the proxy tells by its start time alone
    assert weight_version(rig.urls[1]) == 0
    await rig.wait_for(lambda table: table[1]["stale"])
    assert [(row["healthy"], row["stale"]) for row in await rig.table()] == [(True, False), (True, True)]

    placed = [rig.placed_on() for _ in range(3)]
    assert {record["engine"] for record in placed} == {rig.urls[0]}  # replica 1 held fewer, but is stale
    assert all(record["weight_version"] == 1 for record in placed)

    await rig.step(2)  # it takes version 2 and is enabled again
    assert [row["stale"] for row in await rig.table()] == [False, False]
    newcomer = rig.placed_on()
    assert newcomer["engine"] == rig.urls[1]  # the least loaded, back in rotation
    assert newcomer["weight_version"] == newcomer["dispatch_version"] == 2


@pytest.mark.slow
async def test_an_engine_found_down_by_a_call_comes_back_stale_when_it_restarted(rig: ReplicaRig) -> None:  # noqa: F811
    await rig.step(1)
    sessions = [rig.new_session() for _ in range(2)]
    for session in sessions:
        assert rig.call(session).status_code == 200
    rig.stop(1)
    assert rig.call(sessions[1]).status_code == 200  # failed over to replica 0
    assert [record["engine"] for record in rig.calls(sessions[1])] == rig.urls[::-1]
    assert [row["healthy"] for row in await rig.table()] == [True, False]

    rig.start(1)
    await rig.wait_for(lambda table: table[1]["healthy"])
    assert [(row["healthy"], row["stale"]) for row in await rig.table()] == [(True, False), (True, True)]
    assert rig.placed_on()["engine"] == rig.urls[0]

    await rig.step(2)
    assert rig.placed_on()["engine"] == rig.urls[1]
    assert weight_version(rig.urls[1]) == 2
