"""Sandboxes: where an agent and its verifier run. One protocol (:mod:`.base`), one module per backend.

``SANDBOXES`` is the registry of backends by name; ``make_backend(name, **options)`` builds one with the
options its class documents. Each backend class declares its :class:`~.base.Capabilities` (credentials,
remote or not, what it builds, its isolation); :func:`capabilities`, :func:`missing_credentials` and
:func:`describe_backends` read them for preflight, the Jobs plan, ``serve`` and help texts, so adding a
backend is one module, one line here and its contract-test fixture. Importing this package never imports a
backend's optional SDK (``e2b``, ``docker``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from harness_trainer.sandboxes.base import (
    Capabilities,
    ExecResult,
    Isolation,
    Sandbox,
    SandboxBackend,
    SandboxError,
    SandboxStartError,
    SandboxTimeout,
)
from harness_trainer.sandboxes.docker import DockerSandboxBackend
from harness_trainer.sandboxes.e2b import E2BSandboxBackend
from harness_trainer.sandboxes.hf import HfSandboxBackend
from harness_trainer.sandboxes.local import LocalSandboxBackend
from harness_trainer.sandboxes.supervisor import SandboxSupervisor, StartRateLimiter

SANDBOXES: dict[str, type[Any]] = {
    "local": LocalSandboxBackend,
    "e2b": E2BSandboxBackend,
    "docker": DockerSandboxBackend,
    "hf": HfSandboxBackend,
}


def backend_class(name: str) -> type[Any]:
    """The class registered as ``name``; raises ValueError naming the known ones."""
    try:
        return SANDBOXES[name]
    except KeyError:
        raise ValueError(f"unknown sandbox backend {name!r}; known: {', '.join(sorted(SANDBOXES))}") from None


def make_backend(name: str, **options: Any) -> SandboxBackend:
    """The backend registered as ``name``, built with ``options``; raises ValueError for an unknown name."""
    return backend_class(name)(**options)


def capabilities(name: str) -> Capabilities:
    """What backend ``name`` needs and offers; raises ValueError for an unknown name."""
    return backend_class(name).capabilities


def missing_credentials(name: str, environ: Mapping[str, str]) -> list[str]:
    """The credential variables backend ``name`` needs that ``environ`` lacks (or has empty); none when
    the backend's stored login (its ``capabilities.login``) stands in for them."""
    caps = capabilities(name)
    missing = [variable for variable in caps.credentials if not environ.get(variable)]
    return [] if missing and caps.login is not None and caps.login.stored() else missing


def credential_variables() -> tuple[str, ...]:
    """Every registered backend's credential variables, each once, in registry order."""
    return tuple(dict.fromkeys(v for cls in SANDBOXES.values() for v in cls.capabilities.credentials))


def describe_backends() -> str:
    """One line for help texts: each backend, what it is, and what it needs."""
    parts = []
    for name, cls in SANDBOXES.items():
        caps: Capabilities = cls.capabilities
        credentials = " and ".join(caps.credentials)
        if credentials and caps.login is not None:
            credentials += f" (or a login stored by `{caps.login.command}`)"
        needs = [credentials] if credentials else []
        needs += ["a public URL for the capture proxy"] if caps.remote else []
        parts.append(f"{name} ({caps.summary}" + (f"; needs {' and '.join(needs)})" if needs else ")"))
    return "; ".join(parts)


__all__ = [
    "SANDBOXES",
    "Capabilities",
    "DockerSandboxBackend",
    "E2BSandboxBackend",
    "ExecResult",
    "HfSandboxBackend",
    "Isolation",
    "LocalSandboxBackend",
    "Sandbox",
    "SandboxBackend",
    "SandboxError",
    "SandboxStartError",
    "SandboxSupervisor",
    "SandboxTimeout",
    "StartRateLimiter",
    "backend_class",
    "capabilities",
    "credential_variables",
    "describe_backends",
    "make_backend",
    "missing_credentials",
]
