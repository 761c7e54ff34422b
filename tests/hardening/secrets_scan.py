"""Canary secrets and a scan for them: raw, base64 (any alignment) and URL-encoded, in files and text.

A canary is a unique random value put where a real secret would be (an environment variable); if any
form of it shows up in a file or an output, that secret leaked.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

# Every secret-looking variable the code (or a library it drives) reads: the jobs' routed secrets, the
# proxy's admin key, the sandbox provider's key, trackers' keys, and the agents' API keys, which in a
# sandbox must only ever hold the capture session id.
SECRET_ENV_NAMES = (
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "E2B_API_KEY",
    "CAPTURE_PROXY_ADMIN_KEY",
    "WANDB_API_KEY",
    "OPENAI_API_KEY",
    "ANTHROPIC_API_KEY",
    "HARNESS_TRAINER_API_KEY",
)


def canaries(names: Iterable[str] = SECRET_ENV_NAMES) -> dict[str, str]:
    """One unique random value per name; ``/``, ``+`` and ``=`` make its URL-encoded form differ."""
    return {name: f"ht-canary-{secrets.token_hex(16)}/+={name.lower()}" for name in names}


def _base64_cores(value: bytes) -> list[bytes]:
    """Substrings that any standard or URL-safe base64 encoding of a text containing ``value`` holds."""
    cores = []
    for shift in range(3):
        encoded = base64.b64encode(b"\0" * shift + value)
        # drop the characters that mix in the unknown neighbours on either side
        start = (shift * 4 + 2) // 3 + 1 if shift else 0
        core = encoded[start : len(encoded) - 4]
        cores += [core, core.replace(b"+", b"-").replace(b"/", b"_")]
    return [core for core in cores if len(core) >= 16]


@dataclass(frozen=True)
class Form:
    secret: str
    encoding: str
    needle: bytes


def forms(values: Mapping[str, str]) -> list[Form]:
    """Every form searched for, per secret name."""
    found = []
    for name, value in values.items():
        raw = value.encode()
        found.append(Form(name, "raw", raw))
        found.append(Form(name, "url-encoded", quote(value, safe="").encode()))
        found += [Form(name, "base64", core) for core in _base64_cores(raw)]
    return found


def leaks_in_bytes(data: bytes, values: Mapping[str, str], where: str) -> list[str]:
    return [f"{f.secret} ({f.encoding}) in {where}" for f in forms(values) if f.needle in data]


def leaks_in_files(roots: Iterable[Path], values: Mapping[str, str], newer_than: float = 0.0) -> list[str]:
    """Every leak in every regular file under ``roots`` (modified at or after ``newer_than``), names too."""
    leaks: list[str] = []
    for root in roots:
        if not root.exists():
            continue
        for path in [root, *root.rglob("*")]:
            leaks += leaks_in_bytes(str(path).encode(), values, f"the file name {path}")
            if path.is_symlink() or not path.is_file() or path.stat().st_mtime < newer_than:
                continue
            leaks += leaks_in_bytes(path.read_bytes(), values, str(path))
    return leaks


def count_files(roots: Iterable[Path]) -> int:
    return sum(1 for root in roots if root.exists() for path in root.rglob("*") if path.is_file())
