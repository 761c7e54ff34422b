"""The E2B SDK, an optional extra: imported on first use by the backend and the template builder alike."""

from __future__ import annotations

from typing import Any

from harness_trainer.sandboxes.base import SandboxStartError


def sdk() -> Any:
    """The ``e2b`` module; raises SandboxStartError naming the extra to install when it is missing."""
    try:
        import e2b
    except ImportError as exc:  # the SDK is an optional extra
        raise SandboxStartError(
            "the e2b backend needs the e2b SDK: pip install 'harness-trainer[e2b]'"
        ) from exc
    return e2b
