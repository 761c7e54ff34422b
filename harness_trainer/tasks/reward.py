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
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


@dataclass(frozen=True)
class RewardResult:
    """``reward`` None means ungraded (excluded from the group baseline); ``detail`` says why or whence."""

    reward: float | None
    rewards: dict[str, float] = field(default_factory=dict)
    detail: str = ""


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
