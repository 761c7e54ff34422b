"""harness-trainer: async GRPO on the captured behaviour of black-box coding agents."""

from __future__ import annotations

__version__ = "0.1.0"
