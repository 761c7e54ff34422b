"""What both steps' checks share: reading the environment file the agent wrote."""

import os
import sys
from pathlib import Path


def env_lines() -> list[str]:
    path = Path(os.environ.get("SERVICE_ENV", "/app/service.env"))
    if not path.is_file():
        sys.exit(f"{path} does not exist")
    return [line for line in path.read_text().splitlines() if line.strip()]


def expect(lines: list[str], wanted: list[str]) -> None:
    if lines != wanted:
        sys.exit(f"expected {wanted}, got {lines}")
