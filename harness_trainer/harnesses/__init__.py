"""Harness adapters: one module per agent program, registered by name in ``HARNESSES``."""

from __future__ import annotations

from typing import Any

from harness_trainer.harnesses.toy import ToyHarness

HARNESSES: dict[str, type[Any]] = {"toy": ToyHarness}
