"""The E2B backend's manual smoke test, for users with ``E2B_API_KEY`` (the CI cannot reach E2B).

    python -m harness_trainer.sandboxes.e2b --smoke [--template base]

Starts one real sandbox, checks exec (output, env, exit code), a timeout that must kill the whole process
group, and a file round trip through ``/logs``, then closes it. Prints one line per check; exit status 0
when all pass.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
from pathlib import Path

from harness_trainer.sandboxes.e2b import E2BSandboxBackend
from harness_trainer.tasks.task import bare_task


async def smoke(template: str) -> int:
    """Start one real E2B sandbox, exercise it, close it; prints each check. Returns the exit status."""
    with tempfile.TemporaryDirectory() as folder:
        task = bare_task("e2b-smoke", Path(folder))
        backend = E2BSandboxBackend(template=template)
        sandbox = await backend.start(task, lifetime_s=120, env={"HT_SMOKE": "1"})
        try:
            checks = {
                "exec": (await sandbox.exec("echo $HT_SMOKE $X", env={"X": "2"})).stdout.strip() == "1 2",
                "exit code": (await sandbox.exec("exit 7")).exit_code == 7,
                "timeout": (await sandbox.exec("sleep 30 & sleep 30", timeout_s=2)).timed_out,
                "group killed": (await sandbox.exec("pgrep -x sleep || true")).stdout.strip() == "",
            }
            await sandbox.write_file("/logs/verifier/reward.txt", "1\n")
            checks["files"] = await sandbox.read_file("/logs/verifier/reward.txt") == b"1\n"
        finally:
            await sandbox.close()
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    return 0 if all(checks.values()) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="E2B sandbox backend tools")
    parser.add_argument("--smoke", action="store_true", help="run the manual smoke test (needs E2B_API_KEY)")
    parser.add_argument("--template", default="base", help="E2B template for the smoke test")
    args = parser.parse_args(argv)
    if not args.smoke:
        parser.print_help()
        return 2
    if not os.environ.get("E2B_API_KEY"):
        print("E2B_API_KEY is not set: the smoke test needs an E2B account", file=sys.stderr)
        return 2
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(smoke(args.template))
    return 130


if __name__ == "__main__":
    sys.exit(main())
