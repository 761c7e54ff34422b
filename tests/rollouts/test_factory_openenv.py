"""``HarborSessionFactory`` with OpenEnv's keyword meanings, against a real ``harness-trainer serve`` that
serves two datasets and may forward to two engines: splits name datasets, ``llm_url``/``model`` pick the
engine per rollout (only allowed ones), and every bad setting is an error at construction that names the
value and the allowed ones."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from harness_trainer.net import free_port, wait_until_healthy
from harness_trainer.rollouts.client.factory import HarborSessionFactory, RolloutServerError
from harness_trainer.rollouts.errors import RolloutConfigError
from harness_trainer.rollouts.result import RolloutOptions
from tests.conftest import EngineProcess, start_engine
from tests.rollouts.conftest import EXAMPLES, bash_call, live_sandbox_processes

SOLVE = [bash_call("printf 'Hello, Harbor!\\n' > /app/hello.txt"), {"content": "Done."}]
GIVE_UP = [{"content": "I cannot do this."}]


@dataclass
class Stack:
    url: str
    engine_a: EngineProcess
    engine_b: EngineProcess
    extra: Path
    """The second dataset's folder (one split of one task, ``hello-file``)."""


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("openenv")
    extra = root / "extra-tasks"
    shutil.copytree(EXAMPLES / "train" / "hello-file", extra / "hello-file")
    engines: list[EngineProcess] = []
    for name, replies in (("a", SOLVE * 4), ("b", GIVE_UP * 4)):
        script = root / f"script-{name}.jsonl"
        script.write_text("\n".join(json.dumps(reply) for reply in replies))
        engines.append(start_engine(tiny_model_dir, "--script", str(script), name=f"tiny-{name}"))
    port = free_port()
    command = [sys.executable, "-m", "harness_trainer.cli", "serve", "--port", str(port)]
    command += ["--dataset", str(EXAMPLES), "--dataset", str(extra)]
    command += ["--upstream", engines[0].url, "--upstream", engines[1].url + "/v1"]
    command += ["--capture-port", str(free_port()), "--data-dir", str(root / "capture")]
    command += ["--max-concurrent-envs", "4"]
    environ = {k: v for k, v in os.environ.items() if k != "E2B_API_KEY"}
    process = subprocess.Popen(command, env=environ)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, process)
        yield Stack(url, engines[0], engines[1], extra)
    finally:
        process.terminate()
        process.wait(30)
        for engine in engines:
            engine.stop()


def factory(stack: Stack, **options: object) -> HarborSessionFactory:
    return HarborSessionFactory(stack.url, harness="toy", sandbox="local", **{"split": "train", **options})


@pytest.mark.slow
def test_splits_name_datasets_and_their_sub_folder_splits(stack: Stack) -> None:
    listed = httpx.get(stack.url + "/splits").json()
    assert listed["splits"] == [f"{EXAMPLES}:test", f"{EXAMPLES}:train", f"{stack.extra}:train"]
    assert [d["name"] for d in listed["datasets"]] == [str(EXAMPLES), str(stack.extra)]

    def names(split: str) -> set[str]:
        with factory(stack, split=split) as made:
            return {row["task_name"] for row in made.prompt_rows()}

    assert names(str(stack.extra)) == names("extra-tasks") == {"hello-file"}  # as given, or its base name
    assert names(f"{EXAMPLES}:test") == names("test") == {"greet-script", "sum-numbers"}
    assert names(str(EXAMPLES)) == names("train") == names("") != names("test")


def test_an_unknown_split_fails_at_construction_listing_the_known_ones(stack: Stack) -> None:
    with pytest.raises(RolloutConfigError) as raised:
        factory(stack, split="owner/missing-tasks")
    assert "owner/missing-tasks" in str(raised.value) and f"{stack.extra}:train" in str(raised.value)
    assert httpx.get(stack.url + "/health").json()["sessions"] == 0  # nothing was left open


def test_an_unreachable_server_fails_at_construction() -> None:
    with pytest.raises(RolloutServerError, match="unreachable"):
        HarborSessionFactory(f"http://127.0.0.1:{free_port()}", split="train")


@pytest.mark.slow
def test_llm_url_and_model_pick_the_engine_of_each_rollout(stack: Stack) -> None:
    with factory(stack, llm_url=stack.engine_b.url + "/", model="tiny-b") as on_b:
        session = on_b.create({"task_index": 3})  # hello-file
        session.wait_for_completion()
        assert session.verify().env_reward == 0.0  # engine B's script gives up
        turns = session.fetch_training_trace().turns
        assert [t.request["model"] for t in turns] == ["tiny-b"]
        session.close()
    with factory(stack) as default:
        session = default.create({"task_index": 3})
        session.wait_for_completion()
        assert session.verify().env_reward == 1.0  # the first engine's script solves it
        session.close()
    assert live_sandbox_processes() == []


def test_an_engine_or_model_the_server_does_not_have_is_refused_naming_the_allowed_ones(stack: Stack) -> None:
    with pytest.raises(RolloutConfigError) as raised:
        factory(stack, llm_url="http://10.0.0.7:8000/v1")
    assert "10.0.0.7" in str(raised.value) and stack.engine_a.url in str(raised.value)
    with pytest.raises(RolloutConfigError, match=r"'other'.*tiny-b"):
        factory(stack, llm_url=stack.engine_b.url, model="other")

    # The server refuses it too (no open relay), for a client that skips the factory's checks.
    session_id = httpx.post(stack.url + "/sessions").json()["session_id"]
    body = {"split": "train", "index": 0, "harness": "toy", "sandbox": "local", "llm_url": "http://10.0.0.7"}
    refused = httpx.post(f"{stack.url}/sessions/{session_id}/rollout", json=body)
    assert refused.status_code == 400 and stack.engine_b.url in refused.json()["error"]["message"]
    httpx.delete(f"{stack.url}/sessions/{session_id}")


def test_a_trainer_engine_that_serves_another_model_is_refused(stack: Stack) -> None:
    with factory(stack, llm_url=stack.engine_b.url) as on_b:
        assert (on_b.rollout_engine, on_b.rollout_model) == (stack.engine_b.url, "tiny-b")
        on_b.check_engine(stack.engine_b.url + "/v1")
        with pytest.raises(RolloutConfigError, match=r"'tiny-b'.*\['tiny-a'\].*llm_url="):
            on_b.check_engine(stack.engine_a.url)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"agent_timeout_sec": -1}, "agent_timeout_sec=-1"),
        ({"indices": []}, r"indices=\[\] selects no task"),
        ({"indices": [1, 99]}, r"indices \[99\].*0\.\.4"),
        ({"keep_sandbox": True}, "keep_sandbox=True does not apply here: every sandbox is closed"),
        ({"provider": "anthropic"}, "provider='anthropic' does not apply"),
        ({"eval_sampling": {"temperature": 0}}, "eval_sampling"),
    ],
)
def test_bad_settings_fail_at_construction(stack: Stack, options: dict[str, object], message: str) -> None:
    with pytest.raises(RolloutConfigError, match=message):
        factory(stack, **options)


def test_a_misspelled_reward_key_stops_at_the_first_verifier_result_naming_its_keys(
    stack: Stack,
) -> None:
    with factory(stack, reward_key="acuracy, pass@1") as made:
        session = made.create({"task_index": 3})
        session.wait_for_completion()
        with pytest.raises(RolloutConfigError, match=r"'acuracy, pass@1'.*\['reward'\]"):
            session.verify()
        session.close()
    with factory(stack, reward_key="acuracy, reward") as made:  # a preference list: the first present wins
        session = made.create({"task_index": 3})
        session.wait_for_completion()
        assert session.verify().env_reward == 1.0
        session.close()


def test_the_wait_covers_setup_agent_and_verifier(stack: Stack) -> None:
    with factory(stack, agent_timeout_sec=0, setup_timeout_sec=300) as made:
        task = next(t for t in made.tasks() if t["index"] == 3)
        assert made.wait_timeout_s(3) == task["agent_timeout_sec"] + task["verifier_timeout_sec"] + 300
    with factory(stack, agent_timeout_sec=20, setup_timeout_sec=300) as made:
        assert made.wait_timeout_s(3) == 20 + task["verifier_timeout_sec"] + 300


def test_the_engine_credential_goes_to_the_capture_proxy_as_a_header() -> None:
    assert RolloutOptions(api_key="k").engine_headers() == {"Authorization": "Bearer k"}
    assert RolloutOptions(api_key="k", auth_header="X-Api-Key").engine_headers() == {"X-Api-Key": "k"}
    assert RolloutOptions().engine_headers() == {}
    assert "s3cret" not in repr(RolloutOptions(api_key="s3cret"))
