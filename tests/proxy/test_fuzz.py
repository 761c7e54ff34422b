"""Hypothesis-generated bodies, headers and paths never get a 5xx from the proxy itself, nor kill it.

A 502 is allowed only when it is the engine's failure surfaced (the fake engine may choke on nonsense the
proxy rightly forwards); every other answer must be < 500.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.proxy.conftest import Stack
from tests.proxy.fake_engine import ServerThread

ROUTES = [
    "/v1/chat/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/v1/models",
    "/sessions",
    "/health",
    "/metrics",
    "/s/x/v1/chat/completions",
]
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "developer", "bogus"]) | json_values},
    optional={
        "content": json_values,
        "tool_calls": json_values,
        "tool_call_id": json_values,
        "type": json_values,
    },
)
chat_like = st.fixed_dictionaries(
    {},
    optional={
        "model": json_values,
        "messages": st.lists(message, max_size=3) | json_values,
        "input": json_values,
        "tools": json_values,
        "tool_choice": json_values,
        "stream": st.booleans() | json_values,
        "max_tokens": st.integers(-5, 100) | json_values,
        "system": json_values,
        "stop": json_values,
        "temperature": json_values,
        "instructions": json_values,
        "max_output_tokens": json_values,
    },
)


@pytest.fixture(scope="module")
def fuzz_stack(
    servers: ServerThread, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Stack, dict[str, Any]]]:
    stack = Stack(servers, Path(tmp_path_factory.mktemp("fuzz")) / "data")
    yield stack, stack.new_session()
    stack.close()
    for runner in list(servers.runners):
        servers.stop_runner(runner)


def check(response: httpx.Response) -> None:
    if response.status_code == 502:
        assert "engine" in response.text, response.text
    else:
        assert response.status_code < 500, (response.status_code, response.text)


FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.slow
@FUZZ
@given(body=chat_like, route=st.sampled_from(ROUTES), authorized=st.booleans())
def test_structured_nonsense_never_gets_a_5xx(
    fuzz_stack: tuple[Stack, dict[str, Any]], body: Any, route: str, authorized: bool
) -> None:
    stack, session = fuzz_stack
    headers = {"Authorization": f"Bearer {session['session_id']}"} if authorized else {}
    check(httpx.post(stack.url + route, json=body, headers=headers, timeout=30))


@pytest.mark.slow
@FUZZ
@given(raw=st.binary(max_size=300) | json_values.map(lambda v: httpx.Request("POST", "/", json=v).read()))
def test_raw_bytes_never_get_a_5xx(fuzz_stack: tuple[Stack, dict[str, Any]], raw: bytes) -> None:
    stack, session = fuzz_stack
    for route in ("/v1/chat/completions", "/v1/messages", "/v1/responses", "/sessions"):
        headers = {"Authorization": f"Bearer {session['session_id']}", "Content-Type": "application/json"}
        check(httpx.post(stack.url + route, content=raw, headers=headers, timeout=30))


@pytest.mark.slow
@FUZZ
@given(
    path=st.text(
        alphabet=st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="?#"), max_size=40
    ),
    method=st.sampled_from(["GET", "POST", "DELETE", "PUT", "PATCH"]),
    # h11 refuses to send header values with surrounding whitespace; what it sends is fair game.
    header=st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=60).map(str.strip),
)
def test_random_paths_methods_and_headers_never_get_a_5xx(
    fuzz_stack: tuple[Stack, dict[str, Any]], path: str, method: str, header: str
) -> None:
    stack, _ = fuzz_stack
    headers = {"Authorization": header, "x-api-key": header}
    check(httpx.request(method, stack.url + "/" + path.lstrip("/"), headers=headers, timeout=30))
    assert httpx.get(stack.url + "/health").status_code == 200
