"""capture_proxy: the token-capturing proxy between black-box agents and an inference engine.

Stands alone: it never imports ``harness_trainer`` or torch.
"""

from __future__ import annotations

__version__ = "0.1.0"
