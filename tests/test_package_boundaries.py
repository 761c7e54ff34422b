"""Import boundaries, checked in fresh interpreters: the proxy stands alone, and the CLI imports late."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def modules_after(statement: str, watched: list[str]) -> list[str]:
    """Which of ``watched`` are in ``sys.modules`` after running ``statement`` in a fresh interpreter."""
    program = (
        f"import json, sys\n{statement}\nprint(json.dumps([m for m in {watched!r} if m in sys.modules]))"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_probe_sees_a_module_that_was_imported() -> None:
    assert modules_after("import harness_trainer.models.tiny", ["harness_trainer", "torch"]) == [
        "harness_trainer"
    ]


def test_importing_capture_proxy_loads_neither_harness_trainer_nor_torch() -> None:
    assert modules_after("import capture_proxy", ["harness_trainer", "torch"]) == []


@pytest.mark.parametrize(
    "statement", ["import harness_trainer.cli", "from harness_trainer.cli import build_parser"]
)
def test_importing_the_cli_loads_neither_torch_nor_transformers(statement: str) -> None:
    assert modules_after(statement, ["torch", "transformers", "tokenizers", "aiohttp", "openai"]) == []


def test_building_the_cli_parser_loads_neither_torch_nor_transformers() -> None:
    statement = "from harness_trainer.cli import build_parser\nbuild_parser().format_help()"
    assert modules_after(statement, ["torch", "transformers"]) == []


def test_tasks_are_pure_data_and_the_rollout_client_needs_no_server() -> None:
    server_side = ["harness_trainer.sandboxes", "harness_trainer.rollouts.server", "aiohttp", "torch"]
    assert modules_after("import harness_trainer.tasks", server_side) == []
    statement = "from harness_trainer.rollouts.client.factory import HarborSessionFactory"
    assert modules_after(statement, server_side) == []
