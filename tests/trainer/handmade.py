"""Sessions that return hand-made TrainingTraces: a loop-owning factory with no server, no agent, no engine.

Each session's trace is a deterministic function of (task, seed, member): an append-only chain of turns
whose completion ids say which member produced them, so rewards and data order can be checked. Faults are
switches on the factory: sessions that fail to start, time out, return malformed captures, hang, or raise a
given exception when waited on. Session ``n`` reports capture session ``cs-hand-n`` as ours do (in its
verify metrics, and on the ``RolloutUnscorable`` it raises from waiting).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from harness_trainer.rollouts.client.session import RolloutUnscorable, VerifyResult
from harness_trainer.trace import TrainingTrace, load_trace


def chain_trace(task: int, member: int, *, turns: int = 2, logp: float = -1.0) -> dict[str, Any]:
    """An append-only trace: each turn's prompt is the previous prompt + completion + one new token."""
    prompt = [10 + task, 11, 12]
    out = []
    for turn in range(turns):
        completion = [100 + member, 200 + turn, 300 + member]
        out.append({
            "node_id": f"n{turn}",
            "prompt_token_ids": list(prompt),
            "completion_token_ids": completion,
            "per_token_logps": [logp] * len(completion),
            "loss_mask": [0] * len(prompt) + [1] * len(completion),
            "request": {"messages": [{"role": "user", "content": f"task {task}"}]},
            "response": {"choices": [{"message": {"role": "assistant", "content": f"member {member}",
                                                  "tool_calls": [{"function": {"name": "bash"}}]}}]},
        })  # fmt: skip
        prompt = prompt + completion + [13]
    return {"schema_version": 1, "turns": out}


@dataclass
class HandmadeFactory:
    """``reward(task, member) -> float | None``; the member is the n-th session created for a group."""

    sampling: dict[str, Any] | None = None
    reward: Callable[[int, int], float | None] = lambda task, member: float(member % 2)
    num_tasks: int = 3
    fail_start: Callable[[int], bool] = lambda n: False
    time_out: Callable[[int], bool] = lambda n: False
    malformed: Callable[[int], bool] = lambda n: False
    hang: Callable[[int], bool] = lambda n: False
    fail_wait: Callable[[int], Exception | None] = lambda n: None
    delay_s: float = 0.0
    trace: Callable[[int, int], dict[str, Any]] = chain_trace
    created: list[tuple[int, int | None, str | None]] = field(default_factory=list)
    closed: int = 0
    live: set[Any] = field(default_factory=set)
    max_live: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    factory_closed: bool = False
    openenv: bool = False

    def prompt_rows(self) -> list[dict[str, Any]]:
        return [
            {"prompt": [{"role": "user", "content": f"task {i}"}], "task_index": i, "task_name": f"t{i}"}
            for i in range(self.num_tasks)
        ]

    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> HandmadeSession:
        index = task["task_index"] if isinstance(task, dict) else int(task)
        with self.lock:
            n = len(self.created)
            self.created.append((index, seed, episode_id))
            member = sum(1 for t, s, _ in self.created if (t, s) == (index, seed)) - 1
        if self.fail_start(n):
            raise RolloutUnscorable(f"sandbox {n} would not start")
        session = HandmadeSession(self, index, member, n)
        with self.lock:
            self.live.add(session)
            self.max_live = max(self.max_live, len(self.live))
        return session

    def close(self) -> None:
        self.factory_closed = True


class HandmadeSession:
    def __init__(self, factory: HandmadeFactory, task: int, member: int, n: int) -> None:
        self.factory, self.task, self.member, self.n = factory, task, member, n
        self.session_id = f"hand-{n}"
        self.capture_session_id = f"cs-hand-{n}"
        self._closed = threading.Event()

    def wait_for_completion(self, timeout_s: float | None = None) -> int:
        if self.factory.hang(self.n):
            if self._closed.wait(timeout_s if timeout_s is not None else 600):
                raise RolloutUnscorable("closed while running")
            raise TimeoutError("agent hung")
        time.sleep(self.factory.delay_s)
        error = self.factory.fail_wait(self.n)
        if isinstance(error, RolloutUnscorable):
            error.capture_session_id = self.capture_session_id
        if error is not None:
            raise error
        if self.factory.time_out(self.n):
            raise TimeoutError("agent timed out")
        return 0

    def fetch_training_trace(self) -> TrainingTrace:
        data = self.factory.trace(self.task, self.member)
        if self.factory.malformed(self.n):
            data["turns"][0]["per_token_logps"][0] = 0.5
        trace = load_trace(data, session_id=self.session_id)
        return trace.to_openenv() if self.factory.openenv else trace

    def verify(self, completion: Any = None, final_state: Any = None) -> Any:
        reward = self.factory.reward(self.task, self.member)
        if self.factory.openenv:
            from openenv.core.harness import VerifyResult as OpenEnvVerifyResult

            return OpenEnvVerifyResult(env_reward=reward)
        return VerifyResult(env_reward=reward, metrics={"capture_session_id": self.capture_session_id})

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        with self.factory.lock:
            self.factory.closed += 1
            self.factory.live.discard(self)
