"""``GET /metrics``: the dev engine's load in Prometheus text, under vLLM's names and labels.

What the numbers mean here (the worker runs one generation at a time, with a cache that grows per request
rather than a preallocated pool of KV blocks):

- ``vllm:num_requests_running``: 1 while a generation runs, else 0;
- ``vllm:num_requests_waiting``: generations queued behind it (also while paused for a weight update);
- ``vllm:kv_cache_usage_perc``: the running generation's tokens (prompt and sampled so far) over
  ``max_model_len``: the share of the one sequence's worth of context the engine serves at a time. 0 when
  idle;
- ``vllm:num_preemptions_total``: always 0: nothing is ever evicted;
- ``process_start_time_seconds`` (unlabelled): when the engine's process started, in unix seconds, as
  prometheus_client's process collector gives it on vLLM's page. The capture proxy reads it to tell a
  replica that restarted with its start-up weights (rule 8 of ``capture_proxy/replicas.py``).

Labels are vLLM's: ``model_name`` (the served name) and ``engine="0"``. The format is Prometheus text
0.0.4, as :func:`harness_trainer.engines.engine_metrics.engine_load` reads it.
"""

from __future__ import annotations

from functools import cache

import psutil
from aiohttp import web

from harness_trainer.dev_engine.state import STATE
from harness_trainer.dev_engine.worker import WorkerLoad
from harness_trainer.engines.engine_metrics import KV_CACHE_USAGE, PREEMPTIONS, RUNNING, WAITING

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def render_metrics(load: WorkerLoad, *, model_name: str, max_model_len: int) -> str:
    """The ``/metrics`` page for ``load`` (module docstring)."""
    labels = f'engine="0",model_name="{_escape(model_name)}"'
    counter = PREEMPTIONS.removesuffix("_total")
    rows = [
        (RUNNING, "gauge", "Number of requests in model execution batches.", load.running),
        (WAITING, "gauge", "Number of requests waiting to be processed.", load.waiting),
        (
            KV_CACHE_USAGE,
            "gauge",
            "KV-cache usage. 1 means 100 percent usage.",
            load.held_tokens / max_model_len,
        ),
    ]
    lines = []
    for name, kind, text, value in rows:
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name}{{{labels}}} {float(value)!r}"]
    lines += [
        f"# HELP {counter} Cumulative number of preemption from the engine.",
        f"# TYPE {counter} counter",
        f"{PREEMPTIONS}{{{labels}}} 0.0",
        "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.",
        "# TYPE process_start_time_seconds gauge",
        f"process_start_time_seconds {process_start_time()!r}",
    ]
    return "\n".join(lines) + "\n"


@cache
def process_start_time() -> float:
    """This process's start, in unix seconds (it never changes while the process lives)."""
    return psutil.Process().create_time()


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    page = render_metrics(
        state.worker.load(),
        model_name=state.config.served_model_name,
        max_model_len=state.config.max_model_len,
    )
    return web.Response(body=page.encode(), headers={"Content-Type": CONTENT_TYPE})
