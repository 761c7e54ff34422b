"""One ``HarborSessionFactory`` over several rollout servers: real ``harness-trainer serve`` processes on
loopback (scripted dev engine, toy harness, local sandbox). A group stays on one server, groups spread by
free capacity (each server's own ``MAX_CONCURRENT_ENVS``), a server killed mid-run loses only its own
rollouts, and one that comes back takes the last policy before any rollout. The placement rules alone:
the unit tests at the top (no server)."""

from __future__ import annotations

import concurrent.futures
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from harness_trainer.net import free_port, wait_until_healthy
from harness_trainer.rollouts.client import servers as pool_module
from harness_trainer.rollouts.client.factory import HarborSession, HarborSessionFactory, RolloutServerError
from harness_trainer.rollouts.client.servers import ServerPool, group_of, pick_server
from harness_trainer.rollouts.errors import RolloutConfigError
from tests.rollouts.conftest import EXAMPLES, bash_call, live_sandbox_processes
from tests.rollouts.test_server import Server

# One model call per rollout (agent_step_limit=1), so concurrent rollouts may take the replies in any order.
SOLVE = bash_call("sleep 2; printf 'Hello, Harbor!\\n' > /app/hello.txt")
HELLO_FILE = {"task_index": 3}


# --- placement alone -------------------------------------------------------------------------------------


def test_the_up_server_with_most_free_capacity_is_picked_ties_by_order() -> None:
    assert pick_server([(True, 3, 1), (True, 3, 0)]) == 1
    assert pick_server([(True, 3, 1), (True, 4, 2)]) == 0  # 2 free each: the first
    assert pick_server([(False, 9, 0), (True, 1, 1)]) == 1  # a full server is still a pick (it answers 429)
    assert pick_server([(False, 3, 0), (False, 3, 0)]) is None
    assert group_of("group12-member3") == "group12"
    assert group_of("episode-7") is None and group_of(None) is None and group_of("group1-member") is None


def test_a_group_is_pinned_until_its_last_session_closes_and_moves_off_a_down_server() -> None:
    pool = ServerPool([f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"], 5.0)
    for server, capacity in zip(pool.servers, (2, 3), strict=True):
        server.capacity = capacity
    first = pool.place("group0")
    assert first.server is pool.servers[1]  # 3 free beats 2
    second = pool.place("group0")
    assert second.server is first.server  # the group stays, though both now have 2 free
    other = pool.place("group1")
    assert other.server is pool.servers[0]  # ties by order
    pool.release(first)
    pool.release(first)  # twice is once
    assert pool.place("group0").server is pool.servers[1]  # still pinned: one member open
    pool.mark_down(pool.servers[1], RuntimeError("test"))
    moved = pool.place("group0")  # its later members go elsewhere
    assert moved.server is pool.servers[0]
    with pytest.raises(RolloutServerError, match="went away during this rollout"):
        pool.session_call(second, "GET", "/health")  # a session placed before the server went down
    report = pool.report()
    assert [(r["up"], r["placed"], r["lost"]) for r in report] == [(True, 2, 0), (False, 3, 1)]
    pool.mark_down(pool.servers[0], RuntimeError("test"))
    with pytest.raises(RolloutServerError, match="no rollout server is up: all 2"):
        pool.place(None)  # both probed at once (none up), both refuse
    with pytest.raises(RolloutServerError, match="no rollout server is up to take the policy"):
        pool.set_policy({"version": 1})
    pool.close()


def test_members_placed_from_many_threads_at_once_keep_their_group_together() -> None:
    pool = ServerPool([f"http://127.0.0.1:{free_port()}" for _ in range(3)], 5.0)
    for server in pool.servers:
        server.capacity = 40
    members = [f"group{g}-member{m}" for m in range(4) for g in range(20)]
    with concurrent.futures.ThreadPoolExecutor(8) as threads:
        placed = list(threads.map(lambda episode: (episode, pool.place(group_of(episode))), members))
    by_group: dict[str, set[str]] = {}
    for episode, placement in placed:
        by_group.setdefault(group_of(episode) or "", set()).add(placement.server.url)
    assert all(len(urls) == 1 for urls in by_group.values())
    opened = [r["open"] for r in pool.report()]  # 20 whole groups of 4, spread (the order is the threads')
    assert sum(opened) == 80 and all(count % 4 == 0 and count > 0 for count in opened)
    with concurrent.futures.ThreadPoolExecutor(8) as threads:
        list(threads.map(pool.release, [placement for _, placement in placed]))
    assert [r["open"] for r in pool.report()] == [0, 0, 0] and pool._pins == {} and pool._members == {}


def test_refused_server_lists_fail_before_any_request() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    for given in ([url, url + "/"], []):
        with pytest.raises(RolloutConfigError, match="without repeats"):
            HarborSessionFactory(given, split="train")


# --- real servers ----------------------------------------------------------------------------------------


class Serve(Server):
    """``harness-trainer serve`` on loopback, started without waiting for it (``ready`` waits); ``port``
    given to restart one where it was. Stopped as ``test_server.Server`` is."""

    def __init__(  # not Server's: several start at once, then each is waited for
        self, engine_url: str, data_dir: Path, limit: int, dataset: Path = EXAMPLES, port: int = 0
    ) -> None:
        self.port = port or free_port()
        command = [sys.executable, "-m", "harness_trainer.cli", "serve", "--dataset", str(dataset)]
        command += ["--upstream", engine_url, "--port", str(self.port), "--capture-port", str(free_port())]
        command += ["--data-dir", str(data_dir), "--max-concurrent-envs", str(limit)]
        environ = {k: v for k, v in os.environ.items() if k != "E2B_API_KEY"}
        self.process = subprocess.Popen(command, env=environ)
        self.url = f"http://127.0.0.1:{self.port}"

    def ready(self) -> Serve:
        try:
            wait_until_healthy(self.url, self.process)
        except BaseException:
            self.stop()
            raise
        return self

    def health(self) -> dict:
        return httpx.get(self.url + "/health").json()

    def descendants(self) -> list[int]:
        """Its child processes and theirs (capture proxy, sandboxes) that are alive now."""
        children: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
        found, todo = [], [self.process.pid]
        while todo:
            for child in children.get(todo.pop(), []):
                found.append(child)
                todo.append(child)
        return found


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., list[Serve]]]:
    """Start servers (all at once, then wait); every one is stopped on every path."""
    started: list[Serve] = []

    def start(engine_url: str, *limits: int, dataset: Path = EXAMPLES, port: int = 0) -> list[Serve]:
        made = [
            Serve(engine_url, tmp_path / f"capture-{len(started) + i}", limit, dataset, port)
            for i, limit in enumerate(limits)
        ]
        started.extend(made)
        return [server.ready() for server in made]

    yield start
    for server in started:
        server.stop()


def factory(*servers: Serve, **options: object) -> HarborSessionFactory:
    options = {"harness": "toy", **options}
    return HarborSessionFactory(
        [s.url for s in servers], split="train", sandbox="local", agent_step_limit=1, agent_timeout_sec=120,
        **options,
    )  # fmt: skip


def on(session: HarborSession) -> str:
    assert session.placement is not None
    return session.placement.server.url


def finish(session: HarborSession) -> float | None:
    session.wait_for_completion(timeout_s=120)
    reward = session.verify().env_reward
    session.close()
    return reward


@pytest.mark.slow
def test_groups_stay_whole_and_spread_by_each_servers_free_capacity(scripted_engine, serve) -> None:
    engine = scripted_engine([SOLVE] * 12)
    a, b = serve(engine.url, 3, 3)  # a: 2 rollouts + the metadata session; b: 3 rollouts
    made = factory(a, b)
    try:
        made.tasks()  # the metadata session: on the first server
        group0 = [made.create(HELLO_FILE, episode_id=f"group0-member{m}") for m in range(2)]
        group1 = [made.create(HELLO_FILE, episode_id=f"group1-member{m}") for m in range(2)]
        assert [on(s) for s in group0] == [b.url] * 2  # 3 free beats 2
        assert [on(s) for s in group1] == [a.url] * 2  # then 2 beats 1
        assert (a.health()["sessions"], b.health()["sessions"]) == (3, 2)
        assert [finish(s) for s in group0 + group1] == [1.0] * 4
        assert [(r["open"], r["placed"], r["lost"]) for r in made.servers_report()] == [(1, 2, 0), (0, 2, 0)]

        # Single creates (no group) fill by free capacity, ties by order: b, a, b, a, b; then both are full.
        singles = [made.create(HELLO_FILE) for _ in range(5)]
        assert [on(s) for s in singles] == [b.url, a.url, b.url, a.url, b.url]
        assert (a.health()["sessions"], b.health()["sessions"]) == (3, 3)
        with pytest.raises(RolloutServerError, match=r"429.*MAX_CONCURRENT_ENVS"):
            made.create(HELLO_FILE)
        assert [finish(s) for s in singles] == [1.0] * 5
        report = made.servers_report()
        assert [(r["url"], r["up"], r["open"], r["capacity"]) for r in report] == [
            (a.url, True, 1, 3),
            (b.url, True, 0, 3),
        ]

        # Another process's factory: settings only, nothing open, the same placement.
        copy = pickle.loads(pickle.dumps(made))
        assert [(r["open"], r["placed"], r["capacity"]) for r in copy.servers_report()] == [(0, 0, 3)] * 2
        session = copy.create(HELLO_FILE, episode_id="group5-member0")
        assert on(session) == b.url and finish(session) == 1.0  # its own metadata session is on a
        copy.close()
    finally:
        made.close()
    assert a.health()["sessions"] == b.health()["sessions"] == 0
    assert live_sandbox_processes() == []


@pytest.mark.slow
def test_servers_that_list_different_tasks_are_refused_naming_both(
    scripted_engine, serve, tmp_path: Path
) -> None:
    fewer = tmp_path / "fewer"
    shutil.copytree(EXAMPLES, fewer)
    shutil.rmtree(fewer / "train" / "rename-notes")
    engine = scripted_engine([SOLVE])
    a, b = serve(engine.url, 2, 2)
    (c,) = serve(engine.url, 2, dataset=fewer)
    with pytest.raises(RolloutConfigError) as raised:
        factory(a, c)
    assert (
        a.url in str(raised.value) and c.url in str(raised.value) and "different tasks" in str(raised.value)
    )
    with pytest.raises(RolloutServerError, match="unreachable"):  # one server gone at construction
        factory(a, b, _gone())
    assert a.health()["sessions"] == b.health()["sessions"] == c.health()["sessions"] == 0


def _gone() -> Serve:
    ghost = Serve.__new__(Serve)
    ghost.url = f"http://127.0.0.1:{free_port()}"
    return ghost


@pytest.mark.slow
def test_a_killed_server_loses_only_its_rollouts_and_comes_back_only_with_the_last_policy(
    scripted_engine, serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = scripted_engine([SOLVE] * 12)
    a, b = serve(engine.url, 4, 4)
    made = factory(a, b, request_timeout_s=5)
    children: list[int] = []
    try:
        made.tasks()
        doomed = [made.create(HELLO_FILE, episode_id=f"group0-member{m}") for m in range(2)]
        kept = [made.create(HELLO_FILE, episode_id=f"group1-member{m}") for m in range(2)]
        assert [on(s) for s in doomed + kept] == [b.url] * 2 + [a.url] * 2
        deadline = time.monotonic() + 60
        while len(agents := [pid for pid in b.descendants() if "toy_agent.py" in _command(pid)]) < 2:
            assert time.monotonic() < deadline, "b's two agents did not start"
            time.sleep(0.1)
        children += b.descendants()  # its capture proxy, the two sandboxes and their agents
        assert set(agents) <= set(children)
        b.process.send_signal(signal.SIGKILL)  # mid-run: each agent sleeps 2 s in its one step
        b.process.wait()
        for session in doomed:
            with pytest.raises(RolloutServerError):
                session.wait_for_completion(timeout_s=60)
            session.close()
        assert [finish(s) for s in kept] == [1.0, 1.0]  # the other server's rollouts complete
        made.set_policy_version(3)  # taken by the server that is up
        moved = made.create(HELLO_FILE, episode_id="group2-member0")
        assert on(moved) == a.url and finish(moved) == 1.0
        report = made.servers_report()
        assert [(r["up"], r["placed"], r["lost"], r["open"]) for r in report] == [
            (True, 3, 0, 1),
            (False, 2, 2, 0),
        ]
        deadline = time.monotonic() + 20
        while (
            alive := [pid for pid in children if Path(f"/proc/{pid}").exists()]
        ) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert alive == [] or all(_zombie(pid) for pid in alive)  # its proxy and sandboxes died with it

        # Restarted where it was: not probed yet, so not used; then probed, sent the last policy first.
        monkeypatch.setattr(pool_module, "PROBE_EVERY_S", 1000.0)
        (back,) = serve(engine.url, 4, port=b.port)
        waiting = made.create(HELLO_FILE, episode_id="group3-member0")
        assert on(waiting) == a.url and finish(waiting) == 1.0
        made.set_policy_version(9)  # b misses this one while down
        monkeypatch.setattr(pool_module, "PROBE_EVERY_S", 0.0)
        revived = made.create(HELLO_FILE, episode_id="group4-member0")
        assert on(revived) == back.url  # back up, 4 free beats 3
        revived.wait_for_completion(timeout_s=120)
        turns = revived.fetch_training_trace().turns
        assert [turn.metadata["dispatch_version"] for turn in turns] == [9]
        assert finish(revived) == 1.0
        assert [r["up"] for r in made.servers_report()] == [True, True]
    finally:
        made.close()
        for pid in children:  # had they outlived the server (no setpriv here), stop them: ours to stop
            if not _zombie(pid):
                os.kill(pid, signal.SIGKILL)
    assert a.health()["sessions"] == back.health()["sessions"] == 0
    assert live_sandbox_processes() == []


def _zombie(pid: int) -> bool:
    """Gone, or a zombie (dead, not yet reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.slow
def test_a_factory_of_several_harnesses_runs_each_group_on_its_harness_or_the_one_asked_for(
    scripted_engine, serve
) -> None:
    engine = scripted_engine([SOLVE] * 6)
    (server,) = serve(engine.url, 3)
    made = factory(server, harness=["toy", "mini-swe-agent"])
    try:
        assert [made.harness_for_group(g) for g in range(3)] == ["toy", "mini-swe-agent", "toy"]
        ran = {}
        # Groups 0 and 1 on their own harnesses; group 2 (toy's) asked for mini-swe-agent, as evaluation asks.
        for group, asked in ((0, None), (1, None), (2, "mini-swe-agent")):
            session = made.create(HELLO_FILE, episode_id=f"group{group}-member0", harness=asked)
            session.wait_for_completion(timeout_s=120)
            ran[group] = session.verify().metrics["harness"]  # what the server ran
            session.close()
        assert ran == {0: "toy", 1: "mini-swe-agent", 2: "mini-swe-agent"}
        with pytest.raises(RolloutConfigError, match="'codex' is not one of this run's: toy, mini-swe-agent"):
            made.create(HELLO_FILE, episode_id="group3-member0", harness="codex")
    finally:
        made.close()
    assert server.health()["sessions"] == 0


def test_options_for_a_harness_the_mix_does_not_have_are_refused_before_any_request() -> None:
    unreachable = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RolloutConfigError, match="'codex' is not one of them"):
        HarborSessionFactory(unreachable, harness=["toy", "mini-swe-agent"], harness_options={"codex": {}})
    with pytest.raises(RolloutConfigError, match="the weight of 'toy' must be positive"):
        HarborSessionFactory(unreachable, harness={"toy": -1, "mini-swe-agent": 1})
