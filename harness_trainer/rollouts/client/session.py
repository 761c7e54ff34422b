"""One rollout as the trainer sees it: OpenEnv's loop-owning session protocol (its Protocols:
:mod:`harness_trainer.rollouts.client.contract`), and the pieces the factories share.

``wait_for_completion(timeout_s)`` → the agent's exit code (raises ``TimeoutError`` on timeout: the agent
is stopped, its captured turns stay trainable and ``timed_out`` is set; a failed rollout raises what
:func:`~harness_trainer.rollouts.errors.error_for` maps its ``error_kind`` to: :class:`RolloutUnscorable`,
or ``CaptureContractError`` for a malformed capture); ``fetch_training_trace()`` → the validated
:class:`~harness_trainer.trace.TrainingTrace`; ``verify(completion)`` → :class:`VerifyResult` with the
task verifier's reward (None = ungraded); ``close()`` (idempotent). The in-process sessions also have
async twins, which the trainer uses when a factory has a coroutine ``acreate``: ``await session.wait()``,
``await session.afetch_training_trace()``, ``await session.averify()``, ``await session.aclose()``.

The rollout's capture session id (its journal: ``DATA_DIR/sessions/ID``) reaches the trainer with the
result: in ``VerifyResult.metrics["capture_session_id"]``, and on :class:`RolloutUnscorable` as
``capture_session_id`` when the rollout minted one before it failed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from capture_proxy.sampling import SamplingPolicy
from harness_trainer.rollouts.errors import RolloutConfigError, RolloutUnscorable, error_for
from harness_trainer.rollouts.result import RolloutResult
from harness_trainer.tasks.reward import reward_keys
from harness_trainer.trace import TrainingTrace, load_trace

__all__ = [
    "RolloutUnscorable",
    "VerifyResult",
    "check_reward_key",
    "exit_code_of",
    "sampling_policy",
    "task_reference",
    "trace_of",
    "verify_result",
]


@dataclass
class VerifyResult:
    """Mirrors ``openenv.core.harness.VerifyResult``: ``env_reward`` None means ungraded, never 0."""

    env_reward: float | None = None
    done: bool = True
    metrics: dict[str, Any] = field(default_factory=dict)
    artifacts: dict[str, Any] = field(default_factory=dict)


def verify_result(result: RolloutResult) -> VerifyResult:
    metrics = {
        "timed_out": result.timed_out,
        "exit_code": result.exit_code,
        "tool_calls_by_name": dict(result.tool_calls_by_name),
        "tool_failure_count": result.tool_failure_count,
        "model_calls": result.model_calls,
        "phase_seconds": dict(result.phase_seconds),
        "sandbox_seconds": result.sandbox_seconds,
        "snapshot": result.snapshot,
        "group_setup_note": result.group_setup_note,
        "rewards": dict(result.rewards),
        "capture_session_id": result.capture_session_id,
        "harness": result.harness,
        "agreement": None if result.agreement is None else result.agreement.model_dump(),
    }
    artifacts = {
        "reward_detail": result.reward_detail,
        "findings": result.findings,
        "log_tail": result.log_tail,
    }
    return VerifyResult(env_reward=result.reward, done=True, metrics=metrics, artifacts=artifacts)


def trace_of(result: RolloutResult, session_id: str | None = None) -> TrainingTrace:
    """The result's trace, validated (errors name its capture session, else ``session_id``);
    :class:`RolloutUnscorable` when it has none."""
    if result.error is not None or result.trace is None:
        raise error_for(result)
    return load_trace(result.trace, session_id=result.capture_session_id or session_id)


def exit_code_of(result: RolloutResult) -> int:
    if result.error is not None:
        raise error_for(result)
    if result.timed_out:
        raise TimeoutError(f"agent on {result.task_name} timed out; its captured turns stay trainable")
    return result.exit_code if result.exit_code is not None else -1


@dataclass
class RewardKeyCheck:
    """A factory's ``reward_key`` check, made once: on the first result whose verifier wrote named scores
    (:func:`check_reward_key`); later results are not checked again."""

    reward_key: str
    done: bool = False

    def __call__(self, result: RolloutResult) -> None:
        if not self.done and result.rewards:
            self.done = True
            check_reward_key(self.reward_key, result)


def check_reward_key(reward_key: str, result: RolloutResult) -> None:
    """:class:`RolloutConfigError` when ``reward_key`` names none of the scores ``result``'s verifier
    wrote (a misspelled key would leave every rollout ungraded)."""
    keys = reward_keys(reward_key)
    if keys and result.rewards and not any(key in result.rewards for key in keys):
        raise RolloutConfigError(
            f"reward_key {reward_key!r} names no score the verifier of {result.task_name} wrote; "
            f"it wrote {sorted(result.rewards)}"
        )


def sampling_policy(sampling: SamplingPolicy | Mapping[str, Any] | None) -> SamplingPolicy | None:
    """A factory's ``sampling``, the trainer's policy or its JSON, validated once (None: the capture
    proxy's default); :class:`RolloutConfigError` naming what the policy refuses."""
    if sampling is None:
        return None
    if isinstance(sampling, SamplingPolicy):
        return sampling
    try:
        return SamplingPolicy.model_validate(dict(sampling))
    except ValidationError as exc:
        reasons = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'policy'}: {e['msg']}" for e in exc.errors())
        raise RolloutConfigError(f"sampling={dict(sampling)!r} is not a sampling policy: {reasons}") from None


def task_reference(task: Any) -> int | str:
    """What a factory's ``create(task)`` names: a task index (an int, or a prompt row's ``task_index``), else
    the instruction (a row's ``prompt``, a message list's last user message, or the string itself)."""
    if isinstance(task, int):
        return task
    if isinstance(task, dict) and task.get("task_index") is not None:
        return int(task["task_index"])
    text = task.get("prompt", task) if isinstance(task, dict) else task
    if isinstance(text, list):
        text = next((m.get("content") for m in reversed(text) if m.get("role") == "user"), None)
    return str(text)
