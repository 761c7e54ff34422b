"""The engine benchmark runs end to end in a tiny configuration and leaves no server behind."""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path

import pytest

from tests.benchmark_scripts import check_section, load_benchmark

benchmark_engine = load_benchmark("engine")


def live_children() -> set[int]:
    """Pids of this process's children that are still running (Linux ``/proc``)."""
    pids: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that ended while we looked
            pids.update(int(pid) for pid in (task / "children").read_text().split())
    return pids


@pytest.mark.slow
def test_engine_benchmark_measures_both_sides_and_stops_its_server(tmp_path: Path) -> None:
    out = tmp_path / "result.json"

    result = benchmark_engine.main(
        ["--prompts", "2", "--max-tokens", "8", "--repeats", "1", "--json", str(out)]
    )

    assert result["baseline_tps"]["median"] > 0
    assert result["server_tps"]["median"] > 0
    assert math.isfinite(result["ratio"]["median"]) and result["ratio"]["median"] > 0
    assert result["overhead"] == pytest.approx(1 - result["ratio"]["median"])
    assert out.is_file()
    check_section("engine", json.loads(out.read_text()))
    assert result["server_pid"] not in live_children()
    with pytest.raises(ChildProcessError):  # reaped: no such child is left, running or zombie
        os.waitpid(result["server_pid"], os.WNOHANG)
