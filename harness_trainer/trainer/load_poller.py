"""Adaptive rollout concurrency's I/O: read the engine's ``GET /metrics`` on a timer, set the limit.

A :class:`ConcurrencyPoller` thread reads the page every ``interval_s`` seconds (the first at once),
turns it into an :class:`~harness_trainer.engines.engine_metrics.EngineLoad`, lets
:class:`~harness_trainer.trainer.concurrency.AdaptiveConcurrency` decide, and hands the limit to the
scheduler (:meth:`~harness_trainer.trainer.scheduling.RolloutScheduler.set_concurrency_limit`). The trainer
logs :meth:`ConcurrencyPoller.metrics` with each step.

A page that cannot be fetched or read (engine down, no such route, not vLLM's names) never stops the run:
the first such failure is warned about, later ones logged at debug level (a reading that works again is
logged at info level); meanwhile the limit stays where it is. A bug in here (any other exception) is
logged with its traceback and ends the polling, the limit kept.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

import httpx

from harness_trainer.engines.engine_metrics import EngineLoad, MetricsPageError, engine_load
from harness_trainer.trainer.concurrency import AdaptiveConcurrency, Decision

logger = logging.getLogger(__name__)


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
    """Polls ``base_url``'s ``/metrics`` and applies ``controller``'s limit to ``target`` (module docstring).

    Args:
        base_url: the engine's URL (``vllm_server_base_url``).
        controller: decides the limit; its starting limit should be the target's already.
        target: the scheduler.
        interval_s: seconds between readings.
        timeout_s: the bound of one fetch (default: the interval, at most 10 s).
    """

    def __init__(
        self,
        base_url: str,
        controller: AdaptiveConcurrency,
        target: ConcurrencyTarget,
        *,
        interval_s: float,
        timeout_s: float | None = None,
    ) -> None:
        self.url = metrics_url(base_url)
        self.controller = controller
        self.target = target
        self.interval_s = interval_s
        self._client = httpx.Client(timeout=min(interval_s, 10.0) if timeout_s is None else timeout_s)
        self._lock = threading.Lock()
        self._load: EngineLoad | None = None
        self._failing = False
        self._warned = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="concurrency-poller", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop polling (waits for a reading in progress, at most its timeout) and close the client."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._client.close()

    def metrics(self) -> dict[str, float]:
        """``rollout/concurrency_limit`` and, once a reading worked, the last one's ``engine/*``."""
        with self._lock:
            out = {"rollout/concurrency_limit": float(self.controller.limit)}
            if self._load is not None:
                out.update({
                    "engine/kv_cache_usage": self._load.kv_cache_usage,
                    "engine/running": float(self._load.running),
                    "engine/waiting": float(self._load.waiting),
                    "engine/preemptions_total": float(self._load.preemptions_total),
                })  # fmt: skip
        return out

    def poll_once(self) -> Decision | None:
        """Read the page once and apply the decision; None when the page could not be read (the limit
        stays)."""
        try:
            reply = self._client.get(self.url)
            reply.raise_for_status()
            load = engine_load(reply.text)
        except (httpx.HTTPError, MetricsPageError) as exc:
            self._unreadable(exc)
            return None
        if self._failing:
            logger.info("the engine's %s reads again: adaptive concurrency goes on", self.url)
            self._failing = False
        in_flight, queued = self.target.slot_counts()
        with self._lock:
            before = self.controller.limit
            decision = self.controller.update(load, in_flight=in_flight, queued=queued)
            self._load = load
        if decision.limit != before:
            self.target.set_concurrency_limit(decision.limit)
            logger.info("rollout concurrency %d -> %d (%s)", before, decision.limit, decision.reason)
        return decision

    def _unreadable(self, exc: Exception) -> None:
        if self._failing:
            logger.debug("the engine's %s is still unreadable: %s", self.url, exc)
            return
        self._failing = True
        level = logging.DEBUG if self._warned else logging.WARNING
        self._warned = True
        logger.log(
            level,
            "cannot read the engine's %s (%s: %s): the rollout concurrency limit stays at %d until it reads "
            "(adaptive_concurrency)",
            self.url, type(exc).__name__, exc, self.controller.limit,
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
