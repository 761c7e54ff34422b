"""The errors that make a rollout unscorable without being a bug, from every layer a session stands on.

One tuple, so the trainer's judge of failed rollouts (:mod:`harness_trainer.trainer.feed.failures`) imports
the rollout side once instead of each layer's error tree. It sits beside the sessions, above the sandboxes,
harnesses and the capture proxy's admin client whose errors it names; the rollout client
(:mod:`.client.factory`) does not import it, so the client still loads no sandbox code.
"""

from __future__ import annotations

import asyncio
import concurrent.futures

from capture_proxy.admin_client import CaptureError
from harness_trainer.harnesses.base import HarnessError
from harness_trainer.rollouts.client.servers import RolloutServerError
from harness_trainer.rollouts.errors import RolloutUnscorable
from harness_trainer.sandboxes.base import SandboxError

INFRASTRUCTURE_ERRORS: tuple[type[BaseException], ...] = (
    RolloutUnscorable,  # the session's own verdict: sandbox, install, proxy or engine failure
    RolloutServerError,  # the rollout server refused or could not be reached
    SandboxError,
    HarnessError,
    CaptureError,
    ConnectionError,
    TimeoutError,
    concurrent.futures.CancelledError,  # a rollout cancelled under us (its factory closing)
    asyncio.CancelledError,  # the same, seen from the event loop
)
"""What makes a rollout unscorable without counting as unexpected."""
