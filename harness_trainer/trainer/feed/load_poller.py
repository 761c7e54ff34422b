"""Adaptive rollout concurrency's I/O: read the engines' ``GET /metrics`` on a timer, set the limit.

A :class:`ConcurrencyPoller` thread reads the page of every engine replica every ``interval_s`` seconds
(the first at once; the replicas concurrently, each fetch bounded by ``timeout_s``), turns the pages into
:class:`~harness_trainer.engines.engine_metrics.EngineLoad` readings, combines those that read into the
pool's load (:func:`~harness_trainer.engines.engine_metrics.pool_load`: mean KV usage, summed queues,
preemptions since polling started), lets
:class:`~harness_trainer.trainer.feed.concurrency.AdaptiveConcurrency`
decide, and hands the limit to the scheduler
(:meth:`~harness_trainer.trainer.feed.scheduling.RolloutScheduler.set_concurrency_limit`). The trainer logs
:meth:`ConcurrencyPoller.metrics` with each step.

A page that cannot be fetched or read (replica down, no such route, not vLLM's names) never stops the run:
the poll goes on with the replicas that read. A replica that starts failing is warned about once; while it
keeps failing, later polls log it at debug level; once it reads again that is logged at info level, and a
new failure after that is warned about again. When no replica reads, the limit stays where it is. A bug in
here (any other exception) is logged with its traceback and ends the polling, the limit kept.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import httpx

from harness_trainer.engines.engine_metrics import (
    EngineLoad,
    MetricsPageError,
    PreemptionTally,
    engine_load,
    pool_load,
)
from harness_trainer.trainer.feed.concurrency import AdaptiveConcurrency, Decision

logger = logging.getLogger(__name__)

MAX_READERS = 8
"""The most replicas read at once (threads of the poller's pool)."""


class ConcurrencyTarget(Protocol):
    """What the poller steers: the scheduler."""

    def set_concurrency_limit(self, limit: int) -> None: ...

    def slot_counts(self) -> tuple[int, int]:
        """Rollouts in flight, rollouts waiting for a slot."""
        ...


def metrics_url(base_url: str) -> str:
    """The ``/metrics`` route of the engine at ``base_url`` (with or without ``/v1``)."""
    return base_url.rstrip("/").removesuffix("/v1") + "/metrics"


class ConcurrencyPoller:
    """Polls the replicas' ``/metrics`` and applies ``controller``'s limit to ``target`` (module docstring).

    Args:
        base_urls: the engine's URL, or its replicas' (``vllm_server_base_url`` and ``vllm_replica_urls``);
            two naming one ``/metrics`` are read once.
        controller: decides the limit; its starting limit should be the target's already.
        target: the scheduler.
        interval_s: seconds between readings.
        timeout_s: the bound of one fetch (default: the interval, at most 10 s).

    Raises:
        ValueError: no URL.
    """

    def __init__(
        self,
        base_urls: str | Sequence[str],
        controller: AdaptiveConcurrency,
        target: ConcurrencyTarget,
        *,
        interval_s: float,
        timeout_s: float | None = None,
    ) -> None:
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        self.urls = list(dict.fromkeys(metrics_url(url) for url in urls))
        if not self.urls:
            raise ValueError("ConcurrencyPoller needs at least one engine URL")
        self.controller = controller
        self.target = target
        self.interval_s = interval_s
        self._client = httpx.Client(timeout=min(interval_s, 10.0) if timeout_s is None else timeout_s)
        self._readers = ThreadPoolExecutor(
            max_workers=min(len(self.urls), MAX_READERS), thread_name_prefix="concurrency-reader"
        )
        self._lock = threading.Lock()
        self._load: EngineLoad | None = None
        self._replicas_read = 0
        self._tally = PreemptionTally()
        self._polls = self._busy_polls = 0  # since the last metrics(): the sampled idle fraction's window
        self._failing: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="concurrency-poller", daemon=True)

    @property
    def limit(self) -> int:
        """The concurrency limit now."""
        with self._lock:
            return self.controller.limit

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop polling (waits for a reading in progress, at most its timeout), then close the readers and
        the client."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._readers.shutdown(wait=True)
        self._client.close()

    def metrics(self) -> dict[str, float]:
        """``rollout/concurrency_limit``, ``engine/replicas_read`` (replicas read by the last poll, 0 before
        the first), once a poll read one, the last such poll's pooled ``engine/*``, and
        ``engine/idle_frac_sampled``: the share of the polls since the last call (one a step) that found
        no request running in any replica read (a sample every ``interval_s``, not a measured time)."""
        with self._lock:
            out = {
                "rollout/concurrency_limit": float(self.controller.limit),
                "engine/replicas_read": float(self._replicas_read),
            }
            if self._polls:
                out["engine/idle_frac_sampled"] = 1.0 - self._busy_polls / self._polls
            self._polls = self._busy_polls = 0
            if self._load is not None:
                out.update({
                    "engine/kv_cache_usage": self._load.kv_cache_usage,
                    "engine/running": float(self._load.running),
                    "engine/waiting": float(self._load.waiting),
                    "engine/preemptions_total": float(self._load.preemptions_total),
                })  # fmt: skip
        return out

    def poll_once(self) -> Decision | None:
        """Read every replica once and apply the decision; None when none could be read (the limit
        stays)."""
        pages = dict(zip(self.urls, self._readers.map(self._read, self.urls), strict=True))
        readings = {url: page for url, page in pages.items() if isinstance(page, EngineLoad)}
        for url, page in pages.items():
            self._note(url, page, others_read=len(readings) - isinstance(page, EngineLoad))
        with self._lock:
            self._replicas_read = len(readings)
        if not readings:
            return None
        load, self._tally = pool_load(readings, self._tally)
        in_flight, queued = self.target.slot_counts()
        with self._lock:
            before = self.controller.limit
            decision = self.controller.update(load, in_flight=in_flight, queued=queued)
            self._load = load
            self._polls += 1
            self._busy_polls += load.running > 0
        if decision.limit != before:
            self.target.set_concurrency_limit(decision.limit)
            logger.info("rollout concurrency %d -> %d (%s)", before, decision.limit, decision.reason)
        return decision

    def _read(self, url: str) -> EngineLoad | Exception:
        """One replica's load, or why it could not be read (any other exception is a bug: raised)."""
        try:
            reply = self._client.get(url)
            reply.raise_for_status()
            return engine_load(reply.text)
        except (httpx.HTTPError, MetricsPageError) as exc:
            return exc

    def _note(self, url: str, page: EngineLoad | Exception, *, others_read: int) -> None:
        """Log a replica that starts failing (a warning), keeps failing (debug) or reads again (info)."""
        if isinstance(page, EngineLoad):
            if url in self._failing:
                self._failing.discard(url)
                logger.info("the engine's %s reads again: adaptive concurrency goes on with it", url)
            return
        if url in self._failing:
            logger.debug("the engine's %s is still unreadable: %s", url, page)
            return
        self._failing.add(url)
        if others_read:
            meanwhile = f"the load is read from the other {others_read} replica(s) until it reads"
        else:
            which = "it reads" if len(self.urls) == 1 else "one reads"
            meanwhile = f"the rollout concurrency limit stays at {self.controller.limit} until {which}"
        logger.warning(
            "cannot read the engine's %s (%s: %s): %s (adaptive_concurrency)",
            url, type(page).__name__, page, meanwhile,
        )  # fmt: skip

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.poll_once()
                self._stop.wait(self.interval_s)
        except Exception:  # a bug here must not take the run down: the limit stays as it is
            logger.exception(
                "adaptive concurrency stopped on an unexpected error; the limit stays at %d",
                self.controller.limit,
            )
