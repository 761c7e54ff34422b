"""Sandboxes: where an agent and its verifier run. One protocol (:mod:`.base`), one module per backend.

``SANDBOXES`` is the registry of backends by name; ``make_backend(name, **options)`` builds one with the
options its class documents. Importing this package never imports a backend's optional SDK (``e2b``).
"""

from __future__ import annotations

from typing import Any

from harness_trainer.sandboxes.base import (
    ExecResult,
    Sandbox,
    SandboxBackend,
    SandboxError,
    SandboxStartError,
    SandboxTimeout,
)
from harness_trainer.sandboxes.e2b import E2BSandboxBackend
from harness_trainer.sandboxes.local import LocalSandboxBackend
from harness_trainer.sandboxes.supervisor import SandboxSupervisor, StartRateLimiter

SANDBOXES: dict[str, type[Any]] = {"local": LocalSandboxBackend, "e2b": E2BSandboxBackend}


def make_backend(name: str, **options: Any) -> SandboxBackend:
    """The backend registered as ``name``, built with ``options``; raises ValueError for an unknown name."""
    try:
        backend_class = SANDBOXES[name]
    except KeyError:
        raise ValueError(f"unknown sandbox backend {name!r}; known: {', '.join(sorted(SANDBOXES))}") from None
    return backend_class(**options)


__all__ = [
    "SANDBOXES",
    "E2BSandboxBackend",
    "ExecResult",
    "LocalSandboxBackend",
    "Sandbox",
    "SandboxBackend",
    "SandboxError",
    "SandboxStartError",
    "SandboxSupervisor",
    "SandboxTimeout",
    "StartRateLimiter",
    "make_backend",
]
