"""The process measures the benchmarks share: a server's CPU with the processes below it."""

from __future__ import annotations

import os
import subprocess
import sys

from benchmarks.common import children, cpu_seconds, tree_cpu_seconds

BURN = (
    "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\n"
    "print(1, flush=True)\n"
)


def test_tree_cpu_counts_live_and_reaped_children() -> None:
    before, own = tree_cpu_seconds(os.getpid()), cpu_seconds(os.getpid())
    live = subprocess.Popen(
        [sys.executable, "-c", BURN + "import sys\nsys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert live.stdout is not None and live.stdout.readline() == "1\n"
        assert live.pid in children(os.getpid())
        with_live = tree_cpu_seconds(os.getpid()) - before
        assert with_live >= 0.25 + (cpu_seconds(os.getpid()) - own)
    finally:
        assert live.stdin is not None
        live.stdin.close()
        live.wait()
    subprocess.run([sys.executable, "-c", BURN], check=True, capture_output=True)
    assert tree_cpu_seconds(os.getpid()) - before >= 0.5  # both, reaped: in cutime/cstime
