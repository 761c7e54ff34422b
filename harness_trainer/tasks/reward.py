"""A task's reward: what its verifier wrote, and running the verifier in a sandbox.

Contract of :func:`parse_reward` (pure):

- ``reward_key`` given and ``reward.json`` present → ``reward.json[key]`` for the first of
  :func:`reward_keys` it holds (none → None): a key, or a comma-separated preference list.
- else ``reward.txt`` present → the one number it holds (surrounding whitespace allowed).
- else ``reward.json`` present → its only entry, else its ``"reward"`` entry, else None.
- neither file → None ("the verifier wrote no reward").

Anything unusable (not a number, NaN or infinity, a bool, JSON that is not an object of numbers, bytes
that are not UTF-8) gives reward None with a ``detail`` saying what was wrong: an ungraded rollout,
never a zero. ``rewards`` holds every named score that parsed (reward.txt's number is named ``reward``).

Contract of :func:`run_verifier`: clears ``/logs/verifier``, replaces ``/tests`` with the task's
``tests/`` (so nothing the agent wrote there is run or read), runs ``bash /tests/test.sh`` with the
verifier timeout and ``[verifier] env``, then parses what it wrote. The verifier's own failures (non-zero
exit, timeout → ``timed_out`` and reward None, garbage or no reward file) are results; only a
:class:`~harness_trainer.sandboxes.base.SandboxError` (the sandbox itself failed) propagates.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from harness_trainer.tasks.task import HarborTask

if TYPE_CHECKING:  # the sandboxes package imports tasks; keep this edge type-only
    from harness_trainer.sandboxes.base import Sandbox

VERIFIER_LOG_DIR = "/logs/verifier"
REWARD_TXT = f"{VERIFIER_LOG_DIR}/reward.txt"
REWARD_JSON = f"{VERIFIER_LOG_DIR}/reward.json"
TESTS_DIR = "/tests"
OUTPUT_TAIL_CHARS = 4096
_SETUP_TIMEOUT_S = 60.0
_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


@dataclass(frozen=True)
class RewardResult:
    """``reward`` None means ungraded (excluded from the group baseline); ``detail`` says why or whence."""

    reward: float | None
    rewards: dict[str, float] = field(default_factory=dict)
    detail: str = ""


@dataclass(frozen=True)
class VerifierOutcome:
    """One verifier run. ``exit_code`` is None when it was killed on timeout (``timed_out``)."""

    reward: float | None
    rewards: dict[str, float]
    detail: str
    exit_code: int | None
    timed_out: bool
    output_tail: str
    duration_s: float = 0.0


def parse_reward(reward_txt: bytes | None, reward_json: bytes | None, reward_key: str = "") -> RewardResult:
    """The reward from the verifier's files' bytes (None = file absent); see the module docstring."""
    if reward_key and reward_json is not None:
        return _from_json(reward_json, reward_key)
    if reward_txt is not None:
        return _from_txt(reward_txt)
    if reward_json is not None:
        return _from_json(reward_json, "")
    return RewardResult(None, {}, "the verifier wrote no reward")


def reward_keys(reward_key: str) -> list[str]:
    """A ``reward_key``'s candidates in order: the whole text (a key may hold a comma), then each
    comma-separated part (OpenEnv's preference list)."""
    if not reward_key:
        return []
    parts = [part.strip() for part in reward_key.split(",") if part.strip()]
    return list(dict.fromkeys([reward_key, *parts]))


def _from_txt(data: bytes) -> RewardResult:
    try:
        text = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        return RewardResult(None, {}, f"reward.txt is not UTF-8 text: {_preview(data)}")
    if not text:
        return RewardResult(None, {}, "reward.txt is empty")
    if not _NUMBER.fullmatch(text):
        return RewardResult(None, {}, f"reward.txt does not hold one number: {_preview(text)}")
    value = float(text)
    if not math.isfinite(value):
        return RewardResult(None, {}, f"reward.txt holds a non-finite number: {_preview(text)}")
    return RewardResult(value, {"reward": value}, "reward.txt")


def _from_json(data: bytes, reward_key: str) -> RewardResult:
    try:
        parsed = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        return RewardResult(None, {}, f"reward.json is not valid JSON ({exc}): {_preview(data)}")
    if not isinstance(parsed, dict):
        return RewardResult(None, {}, f"reward.json is not an object of named numbers: {_preview(parsed)}")
    rewards = {key: float(value) for key, value in parsed.items() if _is_score(value)}
    if reward_key:
        found = [key for key in reward_keys(reward_key) if key in parsed]
        if not found:
            return RewardResult(None, rewards, f"reward.json has no {reward_key!r} (keys: {sorted(parsed)})")
        key = found[0]
    elif len(parsed) == 1:
        key = next(iter(parsed))
    elif "reward" in parsed:
        key = "reward"
    else:
        detail = f"reward.json has {len(parsed)} scores and none named 'reward'; set reward_key to one of"
        return RewardResult(None, rewards, f"{detail} {sorted(parsed)}")
    if key not in rewards:
        return RewardResult(None, rewards, f"reward.json[{key!r}] is not a finite number: {parsed[key]!r}")
    return RewardResult(rewards[key], rewards, f"reward.json[{key!r}]")


def _is_score(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _preview(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


async def upload_tests(sandbox: Sandbox, task: HarborTask) -> None:
    """Empty the verifier's folders in ``sandbox`` and copy ``task``'s ``tests/`` in (only now: the agent
    never sees them).

    Raises:
        SandboxError: the sandbox could not run commands or copy files (not the verifier's fault).
    """
    from harness_trainer.sandboxes.base import SandboxError  # late: sandboxes imports tasks

    prepared = await sandbox.exec(
        # empty rather than remove: either folder may be a mount point in the sandbox
        f"mkdir -p {VERIFIER_LOG_DIR} {TESTS_DIR} && find {VERIFIER_LOG_DIR} {TESTS_DIR} -mindepth 1 -delete",
        timeout_s=_SETUP_TIMEOUT_S,
    )
    if prepared.exit_code != 0:
        output = _tail(prepared.stdout + prepared.stderr)
        raise SandboxError(f"could not prepare {VERIFIER_LOG_DIR} and {TESTS_DIR}: {output}")
    await sandbox.upload_dir(task.tests_dir, TESTS_DIR)


async def run_verifier(
    sandbox: Sandbox,
    task: HarborTask,
    *,
    timeout_s: float | None = None,
    reward_key: str = "",
    upload: bool = True,
) -> VerifierOutcome:
    """Run ``task``'s verifier in ``sandbox`` and read its reward; see the module docstring. ``upload``:
    copy the tests in first (:func:`upload_tests`); False when the caller did, to time it on its own.

    Raises:
        SandboxError: the sandbox could not run commands or copy files (not the verifier's fault).
    """
    if upload:
        await upload_tests(sandbox, task)
    limit = task.verifier_timeout_sec if timeout_s is None else timeout_s
    started = time.monotonic()
    result = await sandbox.exec(
        f"bash {TESTS_DIR}/test.sh", timeout_s=limit, env=dict(task.verifier_env) or None
    )
    duration = time.monotonic() - started
    output_tail = _tail(result.stdout + result.stderr)
    if result.timed_out:
        detail = f"the verifier timed out after {limit:g} s"
        return VerifierOutcome(None, {}, detail, result.exit_code, True, output_tail, duration)

    parsed = parse_reward(
        await _read_optional(sandbox, REWARD_TXT), await _read_optional(sandbox, REWARD_JSON), reward_key
    )
    return VerifierOutcome(
        parsed.reward, parsed.rewards, parsed.detail, result.exit_code, False, output_tail, duration
    )


async def _read_optional(sandbox: Sandbox, path: str) -> bytes | None:
    try:
        return await sandbox.read_file(path)
    except FileNotFoundError:
        return None


def _tail(text: str, limit: int = OUTPUT_TAIL_CHARS) -> str:
    return text if len(text) <= limit else text[-limit:]
