"""``python -m tests.hardening.devloop_spy KEYFILE ARGS…``: the ``harness-trainer`` CLI, with every rollout
runtime's generated capture-proxy admin key appended to KEYFILE, so a test can look for it in the run's
files (the key never leaves the process otherwise)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def main(argv: list[str]) -> int:
    from harness_trainer.cli import main as cli_main
    from harness_trainer.rollouts.server.runtime import RolloutRuntime

    keyfile = Path(argv[0])
    original = RolloutRuntime.__init__

    def recording_init(self: RolloutRuntime, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        with keyfile.open("a") as out:
            out.write(self.admin_key + "\n")

    RolloutRuntime.__init__ = recording_init  # type: ignore[method-assign]
    return cli_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
