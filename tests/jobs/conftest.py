"""The job launcher run for real with fake processes, and a fake ``HfApi`` with the real signatures."""

from __future__ import annotations

import inspect
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from harness_trainer.jobs.install import build_wheel
from harness_trainer.net import free_port

ROOT = Path(__file__).resolve().parents[2]
FAKE = Path(__file__).parent / "fake_process.py"
SECRETS = {
    "HF_TOKEN": "hf_fake_token_4c1d9e",
    "E2B_API_KEY": "e2b_fake_key_77a0b3",
    "WANDB_API_KEY": "wandb_fake_key_5e2f18",
}


def fake(name: str, *options: str) -> str:
    """A ``--*-command`` value that runs :mod:`fake_process` as ``name``."""
    return shlex.join([sys.executable, str(FAKE), name, *options])


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until(condition: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@dataclass
class Launch:
    """A running launcher: its process, the fakes' events, its ports."""

    process: subprocess.Popen[bytes]
    events_path: Path
    stderr_path: Path
    ports: dict[str, int]

    def events(self) -> list[dict[str, Any]]:
        if not self.events_path.exists():
            return []
        return [json.loads(line) for line in self.events_path.read_text().splitlines()]

    def event(self, name: str, event: str) -> dict[str, Any] | None:
        return next((e for e in self.events() if e["name"] == name and e["event"] == event), None)

    def wait_for(self, name: str, event: str, timeout: float = 30.0) -> dict[str, Any]:
        assert wait_until(lambda: self.event(name, event) is not None, timeout), (name, event, self.stderr())
        found = self.event(name, event)
        assert found is not None
        return found

    def pids(self) -> dict[str, int]:
        """Every process a fake recorded: ``name`` for each fake, ``name/grandchild`` for what it left."""
        pids = {}
        for e in self.events():
            if e["event"] == "start":
                pids[e["name"]] = e["pid"]
            elif e["event"] == "grandchild":
                pids[f"{e['name']}/grandchild"] = e["child"]
        return pids

    def stderr(self) -> str:
        return self.stderr_path.read_text() if self.stderr_path.exists() else ""

    def finish(self, timeout: float = 60.0) -> int:
        return self.process.wait(timeout=timeout)


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Callable[..., Launch]]:
    """Start ``python -m harness_trainer.jobs.job_launcher`` with fake commands; all killed after."""
    started: list[Launch] = []

    def start(
        *,
        vllm: Sequence[str] = (),
        serve: Sequence[str] = (),
        trainer: Sequence[str] = (),
        warm: Sequence[str] = (),
        trainer_args: Sequence[str] = (),
        options: Sequence[str] = (),
    ) -> Launch:
        index = len(started)
        events, stderr = tmp_path / f"events-{index}.jsonl", tmp_path / f"stderr-{index}.txt"
        ports = {"vllm": free_port(), "serve": free_port(), "capture": free_port()}
        argv = [sys.executable, "-m", "harness_trainer.jobs.job_launcher", "--dataset", str(tmp_path)]
        argv += ["--vllm-command", fake("vllm", *vllm), "--serve-command", fake("serve", *serve)]
        argv += ["--trainer-command", fake("trainer", *trainer), "--warm-command", fake("warm", *warm)]
        argv += ["--vllm-port", str(ports["vllm"]), "--server-port", str(ports["serve"])]
        argv += ["--capture-port", str(ports["capture"]), "--vllm-ready-timeout", "30"]
        argv += ["--serve-ready-timeout", "30", "--stop-timeout", "5", "--trainer-stop-timeout", "5"]
        argv += [*options, "--", "--model", "fake/model", "--sandbox", "local", *trainer_args]
        env = {key: value for key, value in os.environ.items() if not key.startswith("HT_")}
        env |= SECRETS | {"FAKE_EVENTS": str(events), "HT_SECRET_NAMES": ",".join(SECRETS)}
        with stderr.open("wb") as err:
            process = subprocess.Popen(argv, env=env, stdout=err, stderr=err)
        running = Launch(process, events, stderr, ports)
        started.append(running)
        return running

    yield start
    for running in started:
        if running.process.poll() is None:
            running.process.kill()
            running.process.wait()
        for pid in running.pids().values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def project_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real wheel of this checkout, built once per test session (it takes seconds)."""
    return build_wheel(ROOT, tmp_path_factory.mktemp("wheel"))


@pytest.fixture
def cached_build(project_wheel: Path) -> Callable[[Path], Path]:
    """A ``jobs submit`` wheel builder that copies :func:`project_wheel` instead of building again."""

    def build(wheel_dir: Path) -> Path:
        wheel_dir.mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy2(project_wheel, wheel_dir / project_wheel.name))

    return build


def _job(job_id: str) -> SimpleNamespace:
    return SimpleNamespace(id=job_id, url=f"https://huggingface.co/jobs/me/{job_id}", status=None)


class FakeHfApi:
    """Records ``run_job``, ``sync_job_volume`` and ``list_jobs`` calls, each bound to the installed
    ``huggingface_hub``'s signature of the method (a call the real ``HfApi`` would refuse fails the test),
    with the defaults filled in. ``uploads`` keeps what each sync sent: the bucket folder, and in it each
    file's bytes, read at the call (the submitter deletes its upload folder afterwards)."""

    def __init__(self, *, jobs: list[Any] | None = None, error: Exception | None = None) -> None:
        self.run_job_calls: list[dict[str, Any]] = []
        self.sync_calls: list[dict[str, Any]] = []
        self.list_calls: list[dict[str, Any]] = []
        self.uploads: dict[str, dict[str, bytes]] = {}
        self.jobs = jobs or []
        self.error = error

    def run_job(
        self,
        *,
        image: str,
        command: list[str],
        env: dict[str, Any] | None = None,
        secrets: dict[str, Any] | None = None,
        flavor: Any = None,
        timeout: int | float | str | None = None,
        attempts: int | None = None,
        name: str | None = None,
        labels: dict[str, str] | None = None,
        volumes: list[Any] | None = None,
        expose: list[int] | None = None,
        expose_public: list[int] | None = None,
        ssh: bool = False,
        network_group: str | None = None,
        network_aliases: list[str] | None = None,
        resource_group_id: str | None = None,
        namespace: str | None = None,
        token: bool | str | None = None,
    ) -> SimpleNamespace:
        self.run_job_calls.append(_bound("run_job", locals()))
        if self.error is not None:
            raise self.error
        return _job("6a0000000000000000000001")

    def sync_job_volume(
        self,
        source: str | Path,
        mount_path: str,
        *,
        remote_name: str | None = None,
        read_only: bool = True,
        namespace: str | None = None,
        token: bool | str | None = None,
    ) -> Any:
        self.sync_calls.append(_bound("sync_job_volume", locals()))
        from huggingface_hub import Volume

        folder = remote_name or "synced"
        root = Path(source)
        self.uploads[folder] = {
            str(path.relative_to(root)): path.read_bytes()
            for path in sorted(root.rglob("*"))
            if path.is_file()
        }
        return Volume(
            type="bucket",
            source=f"{namespace or 'me'}/jobs-artifacts",
            mount_path=mount_path,
            read_only=read_only,
            path=folder,
        )

    def list_jobs(
        self,
        *,
        status: Any = None,
        labels: dict[str, str] | None = None,
        timeout: int | None = None,
        namespace: str | None = None,
        token: bool | str | None = None,
    ) -> list[Any]:
        self.list_calls.append(_bound("list_jobs", locals()))
        return [job for job in self.jobs if labels is None or labels.items() <= job.labels.items()]


def _bound(method: str, call: dict[str, Any]) -> dict[str, Any]:
    """``call`` (a fake method's ``locals()``, taken first thing) bound to the real ``HfApi.<method>``, its
    defaults applied."""
    from huggingface_hub import HfApi

    bound = inspect.signature(getattr(HfApi, method)).bind(**call)
    bound.apply_defaults()
    return {name: value for name, value in bound.arguments.items() if name != "self"}
