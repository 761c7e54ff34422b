"""Prometheus text metrics for ``GET /metrics``: counters, gauges and latency histograms, no dependencies.

Exposed: ``capture_proxy_requests_total{route,status}``, ``capture_proxy_errors_total{kind}``,
``capture_proxy_upstream_seconds``, ``capture_proxy_added_seconds`` and ``capture_proxy_journal_seconds``
(histograms: time waiting for the engine, the rest of each forwarded call's time in the proxy, and the
durable append of one journal line), ``capture_proxy_open_sessions`` and
``capture_proxy_journal_bytes_total``; with replicas, per replica (labels ``replica``, its index, and
``engine``, its base URL): ``capture_proxy_replica_sessions`` (pinned), ``capture_proxy_replica_calls_total``,
``capture_proxy_replica_failures_total``, ``capture_proxy_replica_healthy``, ``capture_proxy_replica_stale``
and ``capture_proxy_replica_in_rotation`` (0/1), rendered by :meth:`capture_proxy.replicas.ReplicaSet.render`.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict

_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    def __init__(self, name: str, help_text: str) -> None:
        self.name, self.help = name, help_text
        self.counts = [0] * (len(_BUCKETS) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(_BUCKETS, seconds)] += 1
        self.sum += seconds
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, count in zip(_BUCKETS, self.counts, strict=False):
            running += count
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {running}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines += [f"{self.name}_sum {self.sum:.6f}", f"{self.name}_count {self.count}"]
        return lines


class Metrics:
    """The proxy's counters; updated on the event loop, rendered on demand."""

    def __init__(self) -> None:
        self.requests: defaultdict[tuple[str, int], int] = defaultdict(int)
        self.errors: defaultdict[str, int] = defaultdict(int)
        self.upstream = Histogram("capture_proxy_upstream_seconds", "Time waiting for the engine per call")
        self.added = Histogram("capture_proxy_added_seconds", "Time a forwarded call spent in the proxy")
        self.journal = Histogram("capture_proxy_journal_seconds", "Time to append and sync one journal line")
        self.journal_bytes = 0

    def request(self, route: str, status: int) -> None:
        self.requests[(route, status)] += 1

    def error(self, kind: str) -> None:
        self.errors[kind] += 1

    def render(self, open_sessions: int, extra: list[str] | None = None) -> str:
        """The text for ``GET /metrics``; ``extra`` lines (other families) go at the end."""
        lines = [
            "# HELP capture_proxy_requests_total Requests answered, by route and status",
            "# TYPE capture_proxy_requests_total counter",
        ]
        for (route, status), count in sorted(self.requests.items()):
            lines.append(f'capture_proxy_requests_total{{route="{route}",status="{status}"}} {count}')
        lines += [
            "# HELP capture_proxy_errors_total Errors, by kind",
            "# TYPE capture_proxy_errors_total counter",
        ]
        for kind, count in sorted(self.errors.items()):
            lines.append(f'capture_proxy_errors_total{{kind="{kind}"}} {count}')
        lines += self.upstream.render() + self.added.render() + self.journal.render()
        lines += [
            "# HELP capture_proxy_open_sessions Sessions minted and not deleted",
            "# TYPE capture_proxy_open_sessions gauge",
            f"capture_proxy_open_sessions {open_sessions}",
            "# HELP capture_proxy_journal_bytes_total Bytes appended to journals since start",
            "# TYPE capture_proxy_journal_bytes_total counter",
            f"capture_proxy_journal_bytes_total {self.journal_bytes}",
        ]
        lines += extra or []
        return "\n".join(lines) + "\n"
