"""Preflight through the launcher's ``main``: each failure is one line on stderr and exit code 2, and
nothing is started (no rollout session, no weight push, no ``launch.json``); a pass says what it found."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from huggingface_hub import constants

from harness_trainer.launch.harbor_run import main
from harness_trainer.launch.preflight import LAUNCH_FILE, PROBES_SKIPPED, PreflightError, check_credentials
from harness_trainer.launch.preflight_engine import check_capture_shapes
from harness_trainer.net import free_port
from harness_trainer.sandboxes import missing_credentials
from tests.launch.fakes import FIXTURES, FakeEngine, FakeRolloutServer, serving

READ_ONLY_ENGINE_ROUTES = {
    "GET /weight_version",
    "GET /v1/models",
    "POST /v1/chat/completions",
    "GET /server_info",
}


@dataclass
class Services:
    engine: FakeEngine
    server: FakeRolloutServer
    engine_url: str
    server_url: str
    output_dir: Path

    def argv(self, *extra: str) -> list[str]:
        return [
            *("--server", self.server_url, "--vllm-url", self.engine_url, "--model", "tiny-model"),
            *("--harness", "toy", "--sandbox", "local", "--num-generations", "2"),
            *(
                "--max-concurrent-rollouts",
                "2",
                "--output-dir",
                str(self.output_dir),
                "--skip-probes",
                *extra,
            ),
        ]  # the fake engine only says what it is: tests/launch/test_probes.py probes real engines

    def assert_nothing_started(self) -> None:
        assert "POST /sessions" not in self.server.requests
        assert set(self.engine.requests) <= READ_ONLY_ENGINE_ROUTES
        assert self.engine.requests.count("POST /v1/chat/completions") <= 1
        assert not (self.output_dir / LAUNCH_FILE).exists()


@pytest.fixture
def services(tmp_path: Path) -> Iterator[Callable[..., Services]]:
    """Start a fake engine and a fake rollout server (defaults: both healthy); stopped after the test."""
    with ExitStack() as stack:

        def start(engine: FakeEngine | None = None, server: FakeRolloutServer | None = None) -> Services:
            engine, server = engine or FakeEngine(), server or FakeRolloutServer()
            engine_url = stack.enter_context(serving(engine.app()))
            server_url = stack.enter_context(serving(server.app()))
            return Services(engine, server, engine_url, server_url, tmp_path / "out")

        yield start


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_refused(result: tuple[int, str, str], expected: str) -> None:
    code, _, err = result
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("preflight: ") and expected in lines[0], lines[0]


def _edit(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """Set (or, for ``...``, delete) the field at a dotted path of the engine's reply."""

    def edit(reply: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = reply
        for key in parents:
            node = node[int(key)] if key.isdigit() else node[key]
        if value is ...:
            del node[last]
        else:
            node[last] = value

    return edit


LOGPROB = "choices.0.logprobs.content.0"
ENGINE_FAILURES = {
    "no_prompt_ids": (FakeEngine(reply_edit=_edit("prompt_token_ids", None)), "no prompt_token_ids"),
    "no_completion_ids": (
        FakeEngine(reply_edit=_edit("choices.0.token_ids", ...)),
        "no completion token_ids",
    ),
    "no_logprobs": (FakeEngine(reply_edit=_edit("choices.0.logprobs", None)), "0 logprob entries for 1"),
    "tokens_as_text": (
        FakeEngine(reply_edit=_edit(f"{LOGPROB}.token", " paiwoka")),
        "not 'token_id:N': start vLLM with --return-tokens-as-token-ids",
    ),
    "positive_logprob": (FakeEngine(reply_edit=_edit(f"{LOGPROB}.logprob", 0.5)), "not a number ≤ 0"),
    "infinite_logprob": (
        FakeEngine(reply_edit=_edit(f"{LOGPROB}.logprob", -math.inf)),
        "not a finite number",
    ),
    "tools_refused": (FakeEngine(chat_status=400), "vLLM needs --enable-auto-tool-choice"),
    "no_dev_mode": (FakeEngine(server_info=None), "start it with VLLM_SERVER_DEV_MODE=1"),
    "raw_logprobs": (
        FakeEngine(server_info={"vllm_config": {"model_config": {"logprobs_mode": "raw_logprobs"}}}),
        "returns raw_logprobs: start it with --logprobs-mode processed_logprobs",
    ),
    "no_weight_transfer": (
        FakeEngine(server_info={"vllm_config": {"model_config": {}, "weight_transfer_config": None}}),
        "start it with --weight-transfer-config",
    ),
}
# Flags a case runs with: the NCCL transfer engine is only needed when the weights go by NCCL.
ENGINE_FAILURE_FLAGS = {"no_weight_transfer": ("--weight-sync", "nccl")}


@pytest.mark.parametrize("case", ENGINE_FAILURES)
def test_an_engine_that_breaks_a_capture_promise_is_refused(case, services, capsys) -> None:
    engine, expected = ENGINE_FAILURES[case]
    running = services(engine=engine)
    assert_refused(run(running.argv(*ENGINE_FAILURE_FLAGS.get(case, ())), capsys), expected)
    running.assert_nothing_started()


def test_a_vllm_without_a_transfer_engine_passes_when_weights_go_by_file(services, capsys) -> None:
    engine = FakeEngine(server_info={"vllm_config": {"model_config": {}, "weight_transfer_config": None}})
    running = services(engine=engine)
    code, out, err = run(running.argv("--preflight-only"), capsys)
    assert code == 0, err
    assert "preflight ok: vllm engine" in out


SERVER_FAILURES = {
    "capacity_unknown": (FakeRolloutServer(max_concurrent_envs=None), [], "does not report its capacity"),
    "capacity_too_small": (
        FakeRolloutServer(max_concurrent_envs=2),
        [],
        "holds at most 2 sessions (MAX_CONCURRENT_ENVS) but --max-concurrent-rollouts 2 needs 3",
    ),
    "sessions_already_open": (
        FakeRolloutServer(max_concurrent_envs=4, sessions=2),
        [],
        "already has 2 of 4 sessions open",
    ),
    "other_engine": (FakeRolloutServer(model="qwen-7b"), [], "agents call model 'qwen-7b'"),
    "unknown_split": (FakeRolloutServer(), ["--split", "nope"], "no split 'nope'"),
    "unknown_task": (FakeRolloutServer(), ["--task-indices", "1,7"], "--task-indices [7] are not in"),
}


@pytest.mark.parametrize("case", SERVER_FAILURES)
def test_a_rollout_server_that_cannot_hold_the_run_is_refused(case, services, capsys) -> None:
    server, extra, expected = SERVER_FAILURES[case]
    running = services(server=server)
    assert_refused(run(running.argv(*extra), capsys), expected)
    running.assert_nothing_started()


@pytest.mark.parametrize("which", ["engine", "rollout server"])
def test_an_unreachable_service_is_named(which, services, capsys) -> None:
    running = services()
    dead = f"http://127.0.0.1:{free_port()}"
    if which == "engine":
        running.engine_url = dead
    else:
        running.server_url = dead
    assert_refused(run(running.argv(), capsys), f"{which} at {dead}")
    running.assert_nothing_started()


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (
            ["--harness", "no-such-agent"],
            "unknown harness 'no-such-agent'; known: aider, claude-code, codex, gemini-cli, mini-swe-agent",
        ),
        (["--sandbox", "docker2"], "unknown sandbox 'docker2'; known: docker, e2b, hf, local"),
        (["--sandbox", "e2b"], "--sandbox e2b needs E2B_API_KEY in the environment (here"),
        (
            ["--sandbox", "hf"],
            "--sandbox hf needs HF_TOKEN in the environment or a login stored by `hf auth login` (here",
        ),
    ],
)
def test_bad_names_and_a_missing_key_are_refused_before_any_request(
    extra, expected, services, capsys, monkeypatch, tmp_path
) -> None:
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-login" / "token"))
    running = services()
    assert_refused(run(running.argv(*extra), capsys), expected)
    assert running.engine.requests == [] and running.server.requests == []


def test_a_token_stored_by_hf_auth_login_stands_in_for_hf_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A user who ran `hf auth login` and exported nothing: the hf backend reads the stored token, so the
    # checks of its credentials (preflight's, and serve's through missing_credentials) let the run go on.
    token_path = tmp_path / "hf-home" / "token"
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(token_path))
    assert missing_credentials("hf", {}) == ["HF_TOKEN"]
    with pytest.raises(PreflightError, match=r"^--sandbox hf needs HF_TOKEN in the environment or a login"):
        check_credentials("hf", {})
    token_path.parent.mkdir()
    token_path.write_text("  \n")  # an empty file is no login
    assert missing_credentials("hf", {}) == ["HF_TOKEN"]
    token_path.write_text("hf_stored_by_login\n")
    assert missing_credentials("hf", {}) == []
    check_credentials("hf", {})
    # A stored HF token is no other backend's credential.
    assert missing_credentials("e2b", {}) == ["E2B_API_KEY"]
    with pytest.raises(PreflightError, match=r"^--sandbox e2b needs E2B_API_KEY in the environment \(here"):
        check_credentials("e2b", {})


def fake_checkpoint(output_dir: Path, step: int, config: dict[str, Any], model: str | None) -> Path:
    """The parts a complete checkpoint has (contents beside the point: preflight reads only the JSON)."""
    path = output_dir / f"checkpoint-{step}"
    (path / "model").mkdir(parents=True)
    (path / "model" / "model.safetensors").write_bytes(b"")
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pt"):
        (path / name).write_bytes(b"")
    state = {"step": step, "groups_consumed": step, "policy_version": step, "extra": {"config": config}}
    (path / "trainer_state.json").write_text(json.dumps(state))
    if model is not None:
        (output_dir / LAUNCH_FILE).write_text(json.dumps({"model": model}))
    return path


@pytest.mark.parametrize(
    ("extra", "checkpoint", "expected"),
    [
        (["--resume"], None, "--resume: resume_from_checkpoint asks for the latest checkpoint"),
        (["--resume", "/nonexistent/checkpoint-3"], None, "no checkpoint folder at /nonexistent"),
        ([], ({"use_peft": False}, "tiny-model"), "already holds checkpoint-2: pass --resume"),
        (["--resume"], ({"use_peft": False}, "other-model"), "trained from --model 'other-model'"),
        (["--resume", "--lora"], ({"use_peft": False}, "tiny-model"), "trained with use_peft=False"),
    ],
    ids=["nothing_to_resume", "no_such_checkpoint", "fresh_run_over_a_checkpoint", "other_model", "lora"],
)
def test_an_output_dir_that_belongs_to_another_run_is_refused(
    extra, checkpoint, expected, services, capsys
) -> None:
    running = services()
    if checkpoint is not None:
        fake_checkpoint(running.output_dir, 2, *checkpoint)
    launch_before = (running.output_dir / LAUNCH_FILE).read_text() if checkpoint else None
    assert_refused(run(running.argv(*extra), capsys), expected)
    assert running.engine.requests == [] and running.server.requests == []
    if launch_before is not None:
        assert (running.output_dir / LAUNCH_FILE).read_text() == launch_before


def test_a_resume_of_the_same_model_passes_and_says_where_from(services, capsys) -> None:
    running = services()
    checkpoint = fake_checkpoint(running.output_dir, 2, {"use_peft": False}, "tiny-model")
    code, out, _ = run(running.argv("--resume", "--preflight-only"), capsys)
    assert code == 0 and f"resuming from {checkpoint}" in out


@pytest.mark.parametrize("kind", ["vllm", "dev"])
def test_preflight_only_reports_what_it_found_and_starts_nothing(kind, services, capsys) -> None:
    running = services(engine=FakeEngine(kind=kind))
    code, out, err = run(running.argv("--preflight-only"), capsys)
    assert (code, err) == (0, "")
    unchecked = (  # the weight pushes' folder: the test's model is no local folder of weights
        "; room in /dev/shm for the weight pushes not checked: neither 'tiny-model' nor the model vLLM "
        "serves is a local folder of safetensors or complete in the Hugging Face cache"
    )
    assert out.strip() == (
        f"preflight ok: {kind} engine at {running.engine_url} serves 'tiny'; rollout server at "
        f"{running.server_url}: 3 of 3 sessions free, 3 needed; 3 task(s) in split 'train'; {PROBES_SKIPPED}"
        + (unchecked if kind == "vllm" else "")
    )
    assert ("GET /server_info" in running.engine.requests) == (kind == "vllm")
    running.assert_nothing_started()


def test_a_forced_engine_kind_is_not_detected(services, capsys) -> None:
    running = services(engine=FakeEngine(kind="dev"))
    code, out, _ = run(running.argv("--engine", "dev", "--preflight-only", "--num-tasks", "1"), capsys)
    assert code == 0 and "dev engine" in out and "1 task(s)" in out
    assert "GET /weight_version" not in running.engine.requests


def test_real_vllm_replies_pass_the_shape_check_and_one_without_ids_does_not() -> None:
    check_capture_shapes(json.loads((FIXTURES / "chat_nonstream.json").read_text()), "http://vllm")
    without_ids = json.loads((FIXTURES / "chat_no_return_token_ids.json").read_text())
    with pytest.raises(PreflightError, match="no prompt_token_ids"):
        check_capture_shapes(without_ids, "http://vllm")


@contextlib.contextmanager
def two_servers(services: Callable[..., Services], **second: Any) -> Iterator[tuple[Services, list[str]]]:
    """The services with a first server holding 2 sessions and a second fake server (``second``: its
    settings), and a run's arguments giving both to ``--server``."""
    running = services(server=FakeRolloutServer(max_concurrent_envs=2))
    with serving(FakeRolloutServer(**{"max_concurrent_envs": 2, **second}).app()) as url:
        argv = running.argv()
        at = argv.index(running.server_url)
        yield running, [*argv[: at + 1], url, *argv[at + 1 :]]


def test_several_servers_are_checked_each_and_their_free_sessions_add_up(services, capsys) -> None:
    with two_servers(services) as (running, argv):
        # 3 sessions needed (2 rollouts + metadata): neither server holds them alone, both together do.
        code, out, err = run([*argv, "--preflight-only"], capsys)
        second = argv[argv.index(running.server_url) + 1]
        assert (code, err) == (0, "")
        assert f"rollout servers at {running.server_url}, {second}: 4 of 4 sessions free, 3 needed" in out
        running.assert_nothing_started()


@pytest.mark.parametrize(
    ("second", "expected"),
    [
        ({"sessions": 2}, "the rollout servers have 2 sessions free in all"),
        ({"tasks": ["hello-file"]}, "the rollout servers list different tasks for split 'train'"),
        ({"model": "qwen-7b"}, "agents call model 'qwen-7b'"),
    ],
)
def test_several_servers_that_cannot_hold_the_run_together_are_refused(
    second, expected, services, capsys
) -> None:
    with two_servers(services, **second) as (running, argv):
        assert_refused(run(argv, capsys), expected)
        running.assert_nothing_started()


def test_white_box_mode_takes_one_server(services, capsys) -> None:
    with two_servers(services) as (running, argv):
        code, _, err = run([*argv, "--mode", "white-box"], capsys)
        assert code == 2 and err.strip() == (
            "error: --mode white-box runs its sessions on one rollout server; --server gave 2"
        )
        running.assert_nothing_started()
