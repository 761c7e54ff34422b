"""Adaptive rollout concurrency: the rule on sequences of readings, the scheduler's adjustable limit, the
poller against pages that read and pages that do not and over two real dev engines, the config's knobs, a
short run against a real dev engine, and a resumed run that starts at its checkpoint's limit."""

from __future__ import annotations

import http.server
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harness_trainer import HarnessAsyncGRPOTrainer
from harness_trainer.dev_engine.process import EngineProcess, start_engine
from harness_trainer.engines.engine_metrics import EngineLoad
from harness_trainer.net import free_port
from harness_trainer.trainer.config.async_grpo import AsyncGRPOConfig
from harness_trainer.trainer.config.problems import ConfigProblems
from harness_trainer.trainer.feed.concurrency import GROW_WAIT, AdaptiveConcurrency, ConcurrencyRule
from harness_trainer.trainer.feed.load_poller import ConcurrencyPoller, metrics_url
from harness_trainer.trainer.feed.scheduling import RolloutScheduler, SchedulerConfig
from tests.trainer.handmade import HandmadeFactory
from tests.trainer.test_trainer import builder, config, metrics_lines


def load(kv: float = 0.0, running: int = 0, waiting: int = 0, preemptions: int = 0) -> EngineLoad:
    return EngineLoad(kv_cache_usage=kv, running=running, waiting=waiting, preemptions_total=preemptions)


def controller(floor: int = 1, ceiling: int = 20, start: int | None = None) -> AdaptiveConcurrency:
    return AdaptiveConcurrency(ConcurrencyRule(floor=floor, ceiling=ceiling), start=start)


# -- the rule -------------------------------------------------------------------------------------------


def test_an_idle_engine_with_rollouts_waiting_grows_the_limit_by_an_eighth_to_the_ceiling() -> None:
    c = controller(floor=1, ceiling=20)
    limits = [c.update(load(kv=0.1), in_flight=c.limit, queued=5).limit for _ in range(16)]
    assert limits == [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 18]
    assert [c.update(load(kv=0.1), in_flight=c.limit, queued=5).limit for _ in range(3)] == [20, 20, 20]


@pytest.mark.parametrize(
    ("reading", "queued", "why"),
    [
        (load(kv=0.1), 0, "no rollout waits for a slot: the limit does not bind"),
        (load(kv=0.1, waiting=2), 5, "requests wait in the engine: its batch is full already"),
        (load(kv=0.85), 5, "inside the band"),
        (load(kv=0.8), 5, "at the low-water mark, not below it"),
        (load(kv=0.9), 5, "at the high-water mark, not above it"),
    ],
)
def test_the_limit_holds(reading: EngineLoad, queued: int, why: str) -> None:
    c = controller(start=8)
    decisions = [c.update(reading, in_flight=8, queued=queued) for _ in range(5)]
    assert {d.limit for d in decisions} == {8} and {d.change for d in decisions} == {"hold"}, why


def test_above_the_high_water_mark_the_limit_shrinks_by_an_eighth_once_each_took_effect() -> None:
    c = controller(floor=2, ceiling=32, start=32)
    assert c.update(load(kv=0.95), in_flight=32, queued=0).limit == 28
    # 32 rollouts still run: the lower limit has not taken effect, so a second shrink would only overshoot.
    pending = c.update(load(kv=0.95), in_flight=32, queued=0)
    assert pending.change == "hold" and "pending" in pending.reason
    assert c.update(load(kv=0.95), in_flight=28, queued=0).limit == 25
    limits = [c.update(load(kv=0.99), in_flight=c.limit, queued=0).limit for _ in range(30)]
    assert limits[-1] == 2 and min(limits) == 2  # never below the floor


def test_a_preemption_shrinks_by_a_quarter_and_the_counter_is_read_as_a_difference() -> None:
    c = controller(floor=1, ceiling=32, start=16)
    assert c.update(load(kv=0.5, preemptions=7), in_flight=16, queued=0).change == "hold"  # first: noted
    shrink = c.update(load(kv=0.5, preemptions=9), in_flight=16, queued=0)
    assert (shrink.limit, shrink.change) == (12, "shrink") and "2 preemption(s)" in shrink.reason
    assert c.update(load(kv=0.5, preemptions=9), in_flight=12, queued=0).change == "hold"
    # The engine restarted: its counter starts again, which is no preemption.
    assert c.update(load(kv=0.5, preemptions=0), in_flight=12, queued=0).change == "hold"
    assert c.update(load(kv=0.5, preemptions=1), in_flight=12, queued=0).limit == 9


def test_a_grow_waits_a_few_readings_after_a_shrink() -> None:
    c = controller(floor=1, ceiling=20, start=10)
    c.update(load(kv=0.95), in_flight=10, queued=0)
    limits = [c.update(load(kv=0.1), in_flight=c.limit, queued=3).limit for _ in range(GROW_WAIT + 1)]
    assert limits == [9] * (GROW_WAIT - 1) + [10, 11]


def steady_engine(footprint: float, readings: int, c: AdaptiveConcurrency) -> list[int]:
    """The limits chosen when each rollout holds ``footprint`` of the KV cache and the limit is always
    full (rollouts wait for a slot)."""
    limits = []
    for _ in range(readings):
        kv = min(1.0, footprint * c.limit)
        limits.append(c.update(load(kv=kv), in_flight=c.limit, queued=4).limit)
    return limits


def test_a_steady_load_settles_and_stays() -> None:
    limits = steady_engine(0.07, 200, controller(floor=1, ceiling=64))
    assert limits[-1] == limits[100] and set(limits[100:]) == {limits[-1]}
    assert 0.8 <= 0.07 * limits[-1] <= 0.9


def test_rollouts_bigger_than_the_band_change_the_limit_ever_more_rarely() -> None:
    # Each rollout holds a quarter of the cache: 3 is too few (0.75 < 0.8), 4 too many (1.0 > 0.9).
    limits = steady_engine(0.25, 300, controller(floor=1, ceiling=8))
    changes = [i for i in range(1, len(limits)) if limits[i] != limits[i - 1]]
    assert set(limits[10:]) <= {3, 4}
    # Without the backing off: two changes every 4 readings, about 150.
    assert len(changes) <= 16 and len([i for i in changes if i >= 100]) <= 4


def test_a_starting_limit_is_kept_within_the_bounds() -> None:
    assert [controller(floor=2, ceiling=4, start=start).limit for start in (None, 1, 3, 9)] == [2, 2, 3, 4]


def test_a_rule_out_of_bounds_is_refused() -> None:
    with pytest.raises(ValueError, match="floor 0"):
        ConcurrencyRule(floor=0, ceiling=4)
    with pytest.raises(ValueError, match="floor 5"):
        ConcurrencyRule(floor=5, ceiling=4)
    with pytest.raises(ValueError, match="water marks"):
        ConcurrencyRule(floor=1, ceiling=4, low_water=0.9, high_water=0.8)


# -- the scheduler's adjustable limit -----------------------------------------------------------------


@dataclass
class GatedFactory(HandmadeFactory):
    """Sessions that finish one per ``release`` token."""

    release: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))

    def create(self, task, seed=None, episode_id=None):
        session = super().create(task, seed=seed, episode_id=episode_id)
        session.wait_for_completion = lambda timeout_s=None: self.release.acquire(timeout=30) and 0
        return session


def eventually(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.01)


def test_the_limit_grows_at_once_and_shrinks_without_cancelling_rollouts_in_flight() -> None:
    factory = GatedFactory(num_tasks=1)
    scheduler = RolloutScheduler(
        factory, factory.prompt_rows(),
        SchedulerConfig(num_generations=4, max_concurrent_rollouts=4, admission_limit=1, rollout_timeout=30.0,
                        seed=0, close_timeout_s=10.0, concurrency_limit=1),
    )  # fmt: skip
    scheduler.start()
    try:
        eventually(lambda: scheduler.slot_counts() == (1, 3))
        scheduler.set_concurrency_limit(3)
        eventually(lambda: scheduler.slot_counts() == (3, 1))
        # a slot is taken before its worker creates the session: wait for the sessions, not the slots
        eventually(lambda: len(factory.live) == 3)
        assert factory.max_live == 3
        scheduler.set_concurrency_limit(1)  # three in flight stay; the fourth waits until none is
        for expected in [(2, 1), (1, 1), (1, 0)]:
            factory.release.release()
            eventually(lambda expected=expected: scheduler.slot_counts() == expected)
        factory.release.release()
        group = scheduler.next_group(timeout=10)
        assert group is not None and len(group.scored) == 4  # none was cancelled
        with pytest.raises(ValueError, match=r"in \[1, max_concurrent_rollouts=4\], got 5"):
            scheduler.set_concurrency_limit(5)
    finally:
        for _ in range(8):
            factory.release.release()
        scheduler.stop()
    assert factory.max_live == 3


# -- the poller ------------------------------------------------------------------------------------------


@dataclass
class Target:
    in_flight: int = 1
    queued: int = 4
    limits: list[int] = field(default_factory=list)

    def set_concurrency_limit(self, limit: int) -> None:
        self.limits.append(limit)

    def slot_counts(self) -> tuple[int, int]:
        return self.in_flight, self.queued


PAGE = """# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
vllm:num_preemptions_total{engine="0",model_name="m"} 0.0
"""


@pytest.fixture
def page_server() -> Iterator[dict]:
    """A server whose ``/metrics`` answers ``served["status"]`` and ``served["page"]``."""
    served = {"status": 200, "page": PAGE}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = served["page"].encode()
            self.send_response(served["status"] if self.path == "/metrics" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    served["url"] = f"http://127.0.0.1:{server.server_address[1]}/v1"
    yield served
    server.shutdown()
    server.server_close()


def test_a_reading_sets_the_limit_and_is_in_the_metrics(page_server) -> None:
    target = Target()
    poller = ConcurrencyPoller(page_server["url"], controller(floor=1, ceiling=4), target, interval_s=1.0)
    try:
        assert poller.metrics() == {"rollout/concurrency_limit": 1.0, "engine/replicas_read": 0.0}
        decision = poller.poll_once()
        assert decision is not None and decision.change == "grow" and target.limits == [2]
        assert poller.limit == 2
        assert poller.metrics() == {
            "rollout/concurrency_limit": 2.0, "engine/replicas_read": 1.0, "engine/kv_cache_usage": 0.25,
            "engine/running": 3.0, "engine/waiting": 0.0, "engine/preemptions_total": 0.0,
            "engine/idle_frac_sampled": 0.0,
        }  # fmt: skip
        # The idle share is over the polls since the last metrics (a step): three that found nothing running.
        page_server["page"] = PAGE.replace(
            'running{engine="0",model_name="m"} 3.0', 'running{engine="0",model_name="m"} 0.0'
        )
        for _ in range(3):
            poller.poll_once()
        assert poller.metrics()["engine/idle_frac_sampled"] == 1.0
        assert "engine/idle_frac_sampled" not in poller.metrics()  # no poll since
    finally:
        poller.stop()


@pytest.mark.parametrize(
    ("status", "page", "said"),
    [
        (200, "<html>hello</html>\n", "not a Prometheus sample"),
        (200, "up 1\n", "has no vllm:kv_cache_usage_perc, vllm:num_requests_running"),
        (404, "", "404"),
    ],
)
def test_a_page_that_does_not_read_is_warned_about_once_per_failure_and_keeps_the_limit(
    page_server, caplog, status, page, said
) -> None:
    page_server.update(status=status, page=page)
    target = Target()
    poller = ConcurrencyPoller(page_server["url"], controller(floor=2, ceiling=4), target, interval_s=1.0)
    try:
        with caplog.at_level(logging.DEBUG, logger="harness_trainer.trainer.feed.load_poller"):
            assert [poller.poll_once() for _ in range(3)] == [None, None, None]
            assert len(warnings_of(caplog)) == 1  # the first failure, not each poll
            page_server.update(status=200, page=PAGE)
            assert poller.poll_once() is not None
            page_server.update(status=status, page=page)
            assert [poller.poll_once() for _ in range(2)] == [None, None]
    finally:
        poller.stop()
    warnings = warnings_of(caplog)
    assert len(warnings) == 2  # it read in between: a new failure is warned about again
    assert all(said in w.getMessage() for w in warnings)
    assert "limit stays at 2" in warnings[0].getMessage() and "limit stays at 3" in warnings[1].getMessage()
    assert target.limits == [3] and poller.metrics()["rollout/concurrency_limit"] == 3.0
    assert poller.metrics()["engine/replicas_read"] == 0.0


def warnings_of(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno == logging.WARNING and "load_poller" in r.name]


def test_an_engine_that_is_not_there_stops_nothing(caplog) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    target = Target()
    poller = ConcurrencyPoller(url, controller(floor=1, ceiling=4), target, interval_s=0.01)
    with caplog.at_level(logging.WARNING, logger="harness_trainer.trainer.feed.load_poller"):
        poller.start()
        time.sleep(0.3)
        poller.stop()
    assert target.limits == []
    assert poller.metrics() == {"rollout/concurrency_limit": 1.0, "engine/replicas_read": 0.0}
    said = [r.getMessage() for r in caplog.records if r.name == "harness_trainer.trainer.feed.load_poller"]
    assert len(said) == 1 and metrics_url(url) in said[0]


def test_urls_that_name_one_metrics_page_are_read_once() -> None:
    poller = ConcurrencyPoller(
        ["http://127.0.0.1:9/v1", "http://127.0.0.1:9/", "http://127.0.0.1:8"], controller(), Target(),
        interval_s=1.0,
    )  # fmt: skip
    try:
        assert poller.urls == ["http://127.0.0.1:9/metrics", "http://127.0.0.1:8/metrics"]
    finally:
        poller.stop()
    with pytest.raises(ValueError, match="at least one engine URL"):
        ConcurrencyPoller([], controller(), Target(), interval_s=1.0)


@pytest.mark.slow
def test_the_poller_reads_every_replica_and_warns_once_about_one_that_stops(
    engine: EngineProcess, tiny_model_dir: Path, caplog
) -> None:
    second = start_engine(tiny_model_dir)
    target = Target(in_flight=1, queued=4)
    poller = ConcurrencyPoller([engine.url, f"{second.url}/v1"], controller(floor=1, ceiling=8), target,
                               interval_s=1.0)  # fmt: skip
    try:
        with caplog.at_level(logging.DEBUG, logger="harness_trainer.trainer.feed.load_poller"):
            first = poller.poll_once()
            assert first is not None and first.change == "grow"  # two idle engines, rollouts waiting
            both = poller.metrics()
            second.stop()
            later = [poller.poll_once() for _ in range(3)]
    finally:
        second.stop()
        poller.stop()
    assert both["engine/replicas_read"] == 2.0
    assert (both["engine/kv_cache_usage"], both["engine/running"], both["engine/waiting"]) == (0.0, 0.0, 0.0)
    assert all(decision is not None for decision in later)  # the engine still up is read and decides
    assert poller.metrics()["engine/replicas_read"] == 1.0
    assert target.limits == [2, 3, 4, 5]
    warnings = warnings_of(caplog)
    assert len(warnings) == 1 and metrics_url(second.url) in warnings[0].getMessage()
    assert "read from the other 1 replica(s)" in warnings[0].getMessage()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("concurrency-")]  # readers closed


# -- the config ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"min_concurrent_rollouts": 0},
            r"min_concurrent_rollouts must be in \[1, max_concurrent_rollouts=8\]",
        ),
        ({"min_concurrent_rollouts": 9}, "got 9"),
        ({"kv_cache_low_water": 0.95}, r"0 < kv_cache_low_water \(0.95\) ≤ kv_cache_high_water \(0.9\) ≤ 1"),
        ({"kv_cache_high_water": 1.5}, "kv_cache_high_water"),
        ({"concurrency_poll_interval": 0}, "concurrency_poll_interval must be a positive"),
        (
            {"adaptive_concurrency": True, "engine": "none", "vllm_server_base_url": None},
            "adaptive_concurrency reads the engine's /metrics",
        ),
    ],
)
def test_bad_adaptive_settings_are_refused(overrides, message) -> None:
    with pytest.raises(ConfigProblems, match=message):
        AsyncGRPOConfig(**overrides)


# -- a run ---------------------------------------------------------------------------------------------


def test_a_run_with_adaptive_concurrency_logs_the_limit_within_its_bounds(tmp_path, tiny_model_dir, engine):
    factory = HandmadeFactory(delay_s=0.1)
    settings = config(
        tmp_path, engine="none", vllm_server_base_url=engine.url, adaptive_concurrency=True,
        max_concurrent_rollouts=4, min_concurrent_rollouts=1, concurrency_poll_interval=0.05,
    )  # fmt: skip
    trainer = HarnessAsyncGRPOTrainer(str(tiny_model_dir), builder(factory), settings)
    trainer.train()
    lines = metrics_lines(tmp_path / "out")
    limits = [line["rollout/concurrency_limit"] for line in lines]
    assert len(limits) == 3 and all(1 <= limit <= 4 for limit in limits)
    assert max(limits) > 1  # the idle engine let it grow while rollouts waited for a slot
    assert all(0.0 <= line["engine/kv_cache_usage"] <= 1.0 for line in lines)
    assert all(line["engine/preemptions_total"] == 0 for line in lines)
    assert factory.max_live <= 4 and not factory.live
    assert trainer.poller is None  # stopped at cleanup


def test_a_resumed_run_starts_at_its_checkpoints_limit(tmp_path, tiny_model_dir) -> None:
    # No engine there: no reading ever moves the limit, so each run's limit is where it started.
    nowhere = f"http://127.0.0.1:{free_port()}"
    adaptive = dict(
        engine="none", vllm_server_base_url=nowhere, adaptive_concurrency=True, max_concurrent_rollouts=4,
        concurrency_poll_interval=0.05,
    )  # fmt: skip
    first = config(tmp_path, max_steps=2, min_concurrent_rollouts=3, **adaptive)
    HarnessAsyncGRPOTrainer(str(tiny_model_dir), builder(HandmadeFactory()), first).train()
    state = json.loads((tmp_path / "out" / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["extra"]["concurrency_limit"] == 3
    resumed = config(
        tmp_path, max_steps=4, min_concurrent_rollouts=1, resume_from_checkpoint="latest", **adaptive
    )
    HarnessAsyncGRPOTrainer(str(tiny_model_dir), builder(HandmadeFactory()), resumed).train()
    lines = metrics_lines(tmp_path / "out")
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    assert [line["rollout/concurrency_limit"] for line in lines] == [3.0] * 4  # not the new floor, 1
    assert all(line["engine/replicas_read"] == 0.0 for line in lines)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("concurrency-")]
