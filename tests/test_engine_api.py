"""The dev engine's behaviour over real HTTP, with the official openai client where one exists."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from openai import BadRequestError, NotFoundError, OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import EngineProcess, start_engine

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    }
]
CAPTURE = {"return_token_ids": True}
SCRIPT = [
    {
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "bash", "arguments": {"command": "ls"}}}],
    },
    {
        "content": "Let me look.",
        "tool_calls": [
            {"function": {"name": "bash", "arguments": '{"command": "cat a.txt"}'}},
            {"function": {"name": "bash", "arguments": {"command": "wc -l a.txt"}}},
        ],
    },
    {"content": "Done: a.txt has 3 lines."},
]


def client(engine: EngineProcess) -> OpenAI:
    return OpenAI(base_url=f"{engine.url}/v1", api_key="unused", max_retries=0)


def chat(engine: EngineProcess, content: str = "Say something.", **kwargs):
    return client(engine).chat.completions.create(
        model=engine.model,
        messages=[{"role": "user", "content": content}],
        logprobs=True,
        top_logprobs=0,
        extra_body=CAPTURE,
        **kwargs,
    )


@pytest.fixture(scope="module")
def scripted_engine(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcess]:
    script = tmp_path_factory.mktemp("script") / "replies.jsonl"
    script.write_text("\n".join(json.dumps(reply) for reply in SCRIPT) + "\n")
    running = start_engine(tiny_model_dir, "--script", str(script))
    yield running
    running.stop()


def test_logprobs_are_processed_logprobs_of_an_independent_forward_pass(
    engine: EngineProcess, tiny_model_dir: Path
) -> None:
    reply = chat(engine, max_tokens=24, temperature=0.7, seed=3)
    prompt = reply.model_extra["prompt_token_ids"]
    sampled = reply.choices[0].model_extra["token_ids"]
    served = torch.tensor([e.logprob for e in reply.choices[0].logprobs.content])
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + sampled])).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, torch.tensor(sampled)[:, None])[:, 0]
    assert len(sampled) == len(served) == reply.usage.completion_tokens
    assert torch.max(torch.abs(served - expected)).item() <= 1e-4


def test_same_seed_samples_the_same_tokens_and_another_seed_does_not(engine: EngineProcess) -> None:
    ids = [chat(engine, max_tokens=16, seed=s).choices[0].model_extra["token_ids"] for s in (5, 5, 6)]
    assert ids[0] == ids[1]
    assert ids[0] != ids[2]


@pytest.mark.slow
def test_greedy_decoding_is_deterministic_without_a_seed(engine: EngineProcess) -> None:
    first, second = (
        chat(engine, max_tokens=12, temperature=0).choices[0].model_extra["token_ids"] for _ in range(2)
    )
    assert first == second


def test_max_tokens_caps_the_reply_with_finish_reason_length(engine: EngineProcess) -> None:
    reply = chat(engine, max_tokens=5, seed=1)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == len(reply.choices[0].model_extra["token_ids"]) == 5


def test_tool_call_round_trips_through_the_openai_client(scripted_engine: EngineProcess) -> None:
    openai = client(scripted_engine)
    messages = [{"role": "user", "content": "What is here?"}]
    first = openai.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, logprobs=True, top_logprobs=0, extra_body=CAPTURE
    )
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls"
    assert (call.function.name, json.loads(call.function.arguments)) == ("bash", {"command": "ls"})
    token_ids = first.choices[0].model_extra["token_ids"]
    assert len(token_ids) == len(first.choices[0].logprobs.content) == first.usage.completion_tokens
    assert all(
        e.token == f"token_id:{t}" for e, t in zip(first.choices[0].logprobs.content, token_ids, strict=True)
    )
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "a.txt"},
    ]
    second = openai.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, extra_body=CAPTURE)
    assert (
        second.model_extra["prompt_token_ids"][: len(first.model_extra["prompt_token_ids"])]
        == first.model_extra["prompt_token_ids"]
    ), "an appended history keeps the earlier prompt as a prefix"
    assert [c.function.name for c in second.choices[0].message.tool_calls] == ["bash", "bash"]
    assert second.choices[0].message.content == "Let me look."


@pytest.mark.slow
def test_scripted_reply_streams_as_content_then_ends_and_the_script_runs_out(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # Its own engine and script: the module's scripted engine is the round-trip test's, whose replies it
    # consumes in order (sharing it made this test depend on which ran first).
    script = tmp_path / "script.json"
    script.write_text(json.dumps([SCRIPT[2]]))
    running = start_engine(tiny_model_dir, "--script", str(script))
    try:
        openai = client(running)
        stream = openai.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "Done: a.txt has 3 lines."
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        with pytest.raises(BadRequestError, match="script exhausted"):
            openai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "more"}])
        assert httpx.get(f"{running.url}/health").status_code == 200
    finally:
        running.stop()


@pytest.mark.slow
def test_streamed_tool_calls_accumulate_to_the_parsed_calls(tiny_model_dir: Path, tmp_path: Path) -> None:
    script = tmp_path / "script.json"
    script.write_text(json.dumps([SCRIPT[1]]))
    running = start_engine(tiny_model_dir, "--script", str(script))
    try:
        stream = client(running).chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "go"}],
            tools=TOOLS,
            stream=True,
            extra_body=CAPTURE,
        )
        calls: dict[int, dict] = {}
        content, finish, token_ids = "", None, []
        for chunk in stream:
            delta = chunk.choices[0].delta
            content += delta.content or ""
            token_ids += chunk.choices[0].model_extra.get("token_ids") or []
            finish = chunk.choices[0].finish_reason or finish
            for call in delta.tool_calls or []:
                slot = calls.setdefault(call.index, {"name": "", "arguments": ""})
                slot["name"] += call.function.name or ""
                slot["arguments"] += call.function.arguments or ""
        assert finish == "tool_calls"
        assert content.rstrip() == "Let me look."  # the newline before <tool_call> streams out, as in vLLM
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
            ("bash", {"command": "cat a.txt"}),
            ("bash", {"command": "wc -l a.txt"}),
        ]
        eos = AutoTokenizer.from_pretrained(tiny_model_dir).eos_token_id
        assert token_ids[-1] == eos  # <|im_end|>: the end-of-turn id is sampled and reported
    finally:
        running.stop()


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"n": 2}, 400, "n=2"),
        ({"top_p": 0.9}, 400, "top_p"),
        ({"presence_penalty": 0.5}, 400, "presence_penalty"),
        ({"logit_bias": {"5": 10}}, 400, "logit_bias"),
        ({"tool_choice": "required", "tools": TOOLS}, 400, "tool_choice"),
        ({"temperature": -1}, 400, "temperature"),
        ({"messages": []}, 400, "messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            400,
            "text content",
        ),
        ({"model": "gpt-9"}, 404, "does not exist"),
    ],
)
def test_bad_requests_get_a_clear_error_and_the_server_keeps_serving(
    engine: EngineProcess, body: dict, status: int, words: str
) -> None:
    request = {
        "model": engine.model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        **body,
    }
    reply = httpx.post(f"{engine.url}/v1/chat/completions", json=request, timeout=60)
    assert reply.status_code == status
    assert words in reply.json()["error"]["message"]
    assert chat(engine, max_tokens=1).usage.completion_tokens == 1


def test_openai_client_sees_unknown_model_as_not_found(engine: EngineProcess) -> None:
    with pytest.raises(NotFoundError):
        client(engine).chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


@pytest.mark.slow
def test_concurrent_requests_are_all_served_and_health_answers_during_generation(
    engine: EngineProcess,
) -> None:
    async def scenario() -> tuple[list[int], float, float]:
        async with httpx.AsyncClient(base_url=engine.url, timeout=300) as http:
            body = {
                "model": engine.model,
                "messages": [{"role": "user", "content": "go"}],
                "max_tokens": 200,
                "temperature": 1.0,
                "stop_token_ids": [],
                "return_token_ids": True,
            }
            loop = asyncio.get_running_loop()
            started = loop.time()
            requests = [
                asyncio.create_task(http.post("/v1/chat/completions", json={**body, "seed": i}))
                for i in range(4)
            ]
            await asyncio.sleep(0.2)
            health = await http.get("/health")
            health_at = loop.time() - started
            replies = await asyncio.gather(*requests)
            assert health.status_code == 200
            return [r.status_code for r in replies], health_at, loop.time() - started

    statuses, health_at, total = asyncio.run(scenario())
    assert statuses == [200, 200, 200, 200]
    assert health_at < total / 2, "the event loop must not wait for the model"


def test_text_completion_continues_a_token_id_prompt(engine: EngineProcess) -> None:
    tokenized = httpx.post(f"{engine.url}/tokenize", json={"prompt": "def main():"}).json()
    reply = httpx.post(
        f"{engine.url}/v1/completions",
        json={
            "model": engine.model,
            "prompt": tokenized["tokens"],
            "max_tokens": 6,
            "logprobs": 0,
            "return_token_ids": True,
            "seed": 0,
        },
    ).json()
    choice = reply["choices"][0]
    assert choice["prompt_token_ids"] == tokenized["tokens"]
    assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"]) == 6
    out_of_vocab = httpx.post(f"{engine.url}/v1/completions", json={"model": engine.model, "prompt": [10**6]})
    assert out_of_vocab.status_code == 400
