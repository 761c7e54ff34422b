"""The engine probes (``harness_trainer.launch.probes``) against real dev engines on the tiny model: each
passes against the dev engine, and each fails, with its one line, against an engine that returns raw
logprobs, a chat template that drops tool calls, and a tokenizer that is not the engine's; through the
launcher, a failure is ``preflight: <probe>: ...`` and ``--skip-probes`` skips them with a warning."""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from harness_trainer.dev_engine.process import EngineProcess, start_engine
from harness_trainer.launch.harbor_run import main
from harness_trainer.launch.preflight import PROBES_SKIPPED
from harness_trainer.launch.probes import (
    PROBE_STRINGS,
    ProbeError,
    check_rendered_tool_call,
    judge_logprobs,
    probe_logprobs,
    run_probes,
)
from harness_trainer.net import free_port
from tests.launch.fakes import FakeRolloutServer, serving

CONTENT_ONLY_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') "
    "+ '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)
"""A chat template that renders every message's text and nothing of its tool calls."""
SCRIPTED = {"content": "scripted reply kept for the run"}


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text, text
    return text


def model_folder(tiny_model_dir: Path, folder: Path, *, template: str | None = None) -> Path:
    """A model folder with the tiny model's files (linked) and, when given, another chat template."""
    folder.mkdir(parents=True)
    for path in tiny_model_dir.iterdir():
        if template is not None and path.name == "chat_template.jinja":
            (folder / path.name).write_text(template)
        else:
            (folder / path.name).symlink_to(path)
    return folder


@pytest.fixture(scope="module")
def plain_template_engine(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcess]:
    """A scripted dev engine on the tiny model whose chat template drops tool calls."""
    root = tmp_path_factory.mktemp("plain-template")
    folder = model_folder(tiny_model_dir, root / "model", template=CONTENT_ONLY_TEMPLATE)
    (root / "script.jsonl").write_text(json.dumps(SCRIPTED) + "\n")
    running = start_engine(folder, "--script", str(root / "script.jsonl"))
    yield running
    running.stop()


def raw_logprobs_app(upstream: str) -> web.Application:
    """An engine that returns raw logprobs: the real dev engine behind a loopback proxy that runs every chat
    completion at temperature 1, whatever it asked, so its logprobs are the unscaled model's (vLLM's
    ``raw_logprobs``); every other request and every reply passes through unchanged."""

    async def forward(request: web.Request) -> web.Response:
        body = await request.read()
        if request.path == "/v1/chat/completions":
            body = json.dumps({**json.loads(body), "temperature": 1.0}).encode()
        async with httpx.AsyncClient(timeout=60) as client:
            reply = await client.request(
                request.method, upstream + request.path_qs, content=body or None,
                headers={"content-type": "application/json"},
            )  # fmt: skip
        kind = reply.headers.get("content-type", "application/json").split(";")[0]
        return web.Response(status=reply.status_code, body=reply.content, content_type=kind)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def launcher_argv(engine_url: str, server_url: str, model: str, out: Path, *extra: str) -> list[str]:
    return [
        *("--server", server_url, "--vllm-url", engine_url, "--model", model, "--harness", "toy"),
        *("--sandbox", "local", "--num-generations", "2", "--max-concurrent-rollouts", "2"),
        *("--output-dir", str(out), "--preflight-only", *extra),
    ]


def test_every_probe_passes_against_the_dev_engine(engine: EngineProcess, tiny_model_dir: Path) -> None:
    verdicts = run_probes(engine.url, str(tiny_model_dir))
    saw = {verdict.probe: verdict.saw for verdict in verdicts}
    assert list(saw) == ["logprobs", "tool_calls", "identity"]
    assert (
        saw["logprobs"].startswith("processed (5 shared top candidates' logprob spread ")
        and "ratio 0.500" in saw["logprobs"]
    )
    assert saw["tool_calls"].startswith("a tool call and its result render in ")
    assert saw["identity"] == (
        f"'tiny' (root {tiny_model_dir}) is --model; vocabulary 4096 ids, its 9 added tokens at ids "
        f"4087–4095 on both; {len(PROBE_STRINGS)} probe strings tokenized alike"
    )


def test_the_launcher_runs_the_probes_and_reports_them(
    engine: EngineProcess, tiny_model_dir: Path, tmp_path: Path, capsys
) -> None:
    with serving(FakeRolloutServer().app()) as server_url:
        code = main(launcher_argv(engine.url, server_url, str(tiny_model_dir), tmp_path / "out"))
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    assert "; logprobs: processed (" in out and "; tool_calls: a tool call and its result render in " in out
    assert f"; identity: 'tiny' (root {tiny_model_dir}) is --model; vocabulary 4096 ids" in out


def test_an_engine_returning_raw_logprobs_is_refused(engine: EngineProcess) -> None:
    with serving(raw_logprobs_app(engine.url)) as url, pytest.raises(ProbeError) as refused:
        run_probes(url, None)
    assert refused.value.probe == "logprobs"
    assert one_line(refused.value).startswith(
        "logprobs: raw, not processed (5 shared top candidates' logprob spread "
    )
    assert "ratio 1.000; processed logprobs halve it)" in str(refused.value)
    assert str(refused.value).endswith("start vLLM with --logprobs-mode processed_logprobs")


def test_the_launcher_stops_at_a_failed_probe_and_skip_probes_skips_them(
    engine: EngineProcess, tiny_model_dir: Path, tmp_path: Path, capsys, caplog
) -> None:
    server = FakeRolloutServer()
    with serving(raw_logprobs_app(engine.url)) as url, serving(server.app()) as server_url:
        argv = launcher_argv(url, server_url, str(tiny_model_dir), tmp_path / "out")
        refused = main(argv)
        captured = capsys.readouterr()
        with caplog.at_level(logging.WARNING):
            skipped = main([*argv, "--skip-probes"])
        out = capsys.readouterr().out
    assert refused == 2 and captured.out == ""
    assert (
        captured.err.startswith("preflight: logprobs: raw, not processed (") and captured.err.count("\n") == 1
    )
    assert "POST /sessions" not in server.requests
    assert skipped == 0 and out.strip().endswith(f"3 task(s) in split 'train'; {PROBES_SKIPPED}")
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [PROBES_SKIPPED]


def test_a_template_that_drops_tool_calls_is_refused(plain_template_engine: EngineProcess) -> None:
    with pytest.raises(ProbeError) as refused:
        run_probes(plain_template_engine.url, None)
    assert refused.value.probe == "tool_calls"
    assert one_line(refused.value).startswith(
        "tool_calls: the chat template does not render the assistant's tool call: after the user turn the "
        "prompt lacks the call's name 'read_probe_file', its argument 'path', the argument's value "
        "'probe-input-4417.txt' ("
    )


def test_the_probes_leave_a_scripted_engines_replies_to_the_run(plain_template_engine: EngineProcess) -> None:
    with httpx.Client(timeout=60) as client:
        assert probe_logprobs(client, plain_template_engine.url, "tiny").saw.startswith("processed (")
        reply = client.post(
            f"{plain_template_engine.url}/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
        ).json()
    assert reply["choices"][0]["message"]["content"] == SCRIPTED["content"]


def test_a_tokenizer_that_is_not_the_engines_is_refused(
    engine: EngineProcess, tiny_model_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """``--model tiny``, the engine's served name, is here a local folder holding another tokenizer: the same
    vocabulary and added tokens, without the BPE merges."""
    folder = tmp_path / "tiny"
    folder.mkdir()
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_model_dir / name, folder / name)
    tokenizer = json.loads((tiny_model_dir / "tokenizer.json").read_text())
    tokenizer["model"].update(merges=[], ignore_merges=False)
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ProbeError) as refused:
        run_probes(engine.url, "tiny")
    assert refused.value.probe == "identity"
    assert one_line(refused.value).startswith(f"identity: the engine tokenizes {PROBE_STRINGS[0]!r} as [")
    assert ", the tokenizer of --model tiny as [" in str(refused.value)
    assert str(refused.value).endswith(": the engine serves another model")


def test_another_model_name_is_refused_and_a_tokenizer_not_at_hand_is_skipped(
    engine: EngineProcess, tiny_model_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    with pytest.raises(ProbeError) as refused:
        run_probes(engine.url, "Qwen/Qwen3-8B")
    assert one_line(refused.value) == (
        f"identity: --model 'Qwen/Qwen3-8B' is not what the engine serves ('tiny' loaded from "
        f"{tiny_model_dir}): pass the model the engine loaded"
    )
    monkeypatch.chdir(tmp_path)  # no folder "tiny" here, nor a cached hub model of that name
    identity = run_probes(engine.url, "tiny")[-1]
    assert str(identity).startswith(
        "identity: 'tiny' is --model; tokenizer skipped: cannot load the tokenizer of 'tiny' without "
        "downloading it ("
    )


@pytest.mark.parametrize(
    ("at_2", "expected"),
    [
        (
            {"a": -0.5, "b": -1.0, "c": -1.5},
            "processed (3 shared top candidates' logprob spread 2 at T=1, 1 at T=2, ratio 0.500",
        ),
        (
            {"a": -1.0, "b": -2.0, "c": -5.0},
            "logprobs: raw, not processed (3 shared top candidates' logprob spread 2 at T=1, 4",
        ),
        (
            {"a": -1.0, "b": -1.8, "c": -2.6},
            "logprobs: undecidable (3 shared top candidates' logprob spread 2 at T=1, 1.6 at T=2",
        ),
        ({"a": -1.0, "z": -2.0}, "logprobs: undecidable: the top candidates at T=1 and T=2 share 1 token(s)"),
    ],
)
def test_the_logprobs_rule_tells_processed_from_raw_and_refuses_in_between(at_2, expected) -> None:
    at_1 = {"a": -1.0, "b": -2.0, "c": -3.0}
    try:
        saw = judge_logprobs(at_1, at_2)
    except ProbeError as exc:
        saw = one_line(exc)
    assert saw.startswith(expected), saw
    with pytest.raises(
        ProbeError, match=r"^logprobs: undecidable: 2 shared top candidates' logprob spread 0\.0001 at T=1"
    ):
        judge_logprobs({"a": -1.0, "b": -1.0001}, {"a": -1.0, "b": -1.00005})


def test_a_rendered_prompt_without_the_call_or_its_result_is_refused() -> None:
    rendered = "user: probe-question-5103: read the probe file.\n"
    check_rendered_tool_call(rendered + 'read_probe_file {"path": "probe-input-4417.txt"} probe-result-8812')
    with pytest.raises(ProbeError, match="lacks the tool result 'probe-result-8812'"):
        check_rendered_tool_call(rendered + 'read_probe_file {"path": "probe-input-4417.txt"}')
    with pytest.raises(ProbeError, match=r"^tool_calls: the rendered prompt lacks the user turn"):
        check_rendered_tool_call("read_probe_file")


def test_serve_prepare_probes_each_engine_that_answers_and_stops_at_a_failed_one(
    engine: EngineProcess, capsys, caplog
) -> None:
    from harness_trainer.launch.serve import _probe_engines, add_serve_arguments, run_serve
    from tests.rollouts.conftest import EXAMPLES

    dead = f"http://127.0.0.1:{free_port()}"
    with caplog.at_level(logging.INFO):
        assert _probe_engines([dead, engine.url]) is None
    said = [record.getMessage() for record in caplog.records]
    assert any(line.startswith(f"engine at {dead} does not answer (") for line in said), said
    assert any(line.startswith(f"engine at {engine.url}: logprobs: processed (") for line in said), said
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    with serving(raw_logprobs_app(engine.url)) as url:
        args = parser.parse_args(["--dataset", str(EXAMPLES), "--upstream", url, "--prepare", "train"])
        assert run_serve(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"error: probe of the engine at {url}: logprobs: raw, not processed"
    )
