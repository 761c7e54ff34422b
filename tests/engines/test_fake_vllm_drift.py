"""The fake vLLM control plane answers every control route as real vLLM 0.32 did, in every test run.

Real vLLM's answers (status and JSON shape, per step of ``vllm_control_routes.steps``) are on record in
``tests/fixtures/vllm_cpu/control_routes.json``; ``test_vllm_cpu_control.py`` checks the real server
against the same record, so neither the fake nor the record can drift from vLLM unseen.
"""

from __future__ import annotations

from pathlib import Path

from tests.engines import vllm_control_routes as routes
from tests.engines.conftest import Served


async def test_the_fake_answers_every_control_route_as_recorded_from_real_vllm(
    serve_fake, drift_adapter: Path
) -> None:
    served: Served = await serve_fake()
    served.fake.init_info = {"master_address": "127.0.0.1"}  # its one extra rule, met up front

    answers = await routes.replay(served.url, drift_adapter)

    assert routes.differences(routes.recorded(), answers) == []
    statuses = [step["status"] for step in answers]
    assert 400 in statuses and 404 in statuses and 500 in statuses  # the error shapes are on record too
