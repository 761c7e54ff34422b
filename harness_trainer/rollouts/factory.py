"""``HarborSessionFactory``: the trainer's client of a rollout server (``harness-trainer serve``).

Pass it as a builder: ``partial(HarborSessionFactory, server_url, split="train", harness="opencode",
sandbox="local", llm_url=..., model=...)``; the trainer calls ``builder(sampling=policy)``. It is
picklable (it holds settings only; HTTP clients are made on use). ``create(task, seed, episode_id)`` maps
the prompt back to its task (a row's ``task_index``, else the instruction text) and starts the rollout in
its own server session. The factory keeps one extra session open for metadata (listing tasks), so the
server needs ``MAX_CONCURRENT_ENVS >= max_concurrent_rollouts + 1``.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from harness_trainer.rollouts.result import RolloutResult
from harness_trainer.rollouts.session import (
    RolloutUnscorable,
    VerifyResult,
    exit_code_of,
    trace_of,
    verify_result,
)
from harness_trainer.trace import TrainingTrace

_POLL_S = 30.0


class RolloutServerError(RuntimeError):
    """The rollout server refused or could not be reached."""


class HarborSessionFactory:
    def __init__(
        self,
        server_url: str,
        *,
        split: str = "train",
        harness: str = "opencode",
        sandbox: str = "e2b",
        llm_url: str | None = None,
        model: str | None = None,
        sampling: dict[str, Any] | None = None,
        agent_timeout_sec: float = 600,
        agent_step_limit: int = 0,
        reward_key: str = "",
        num_tasks: int | None = None,
        indices: list[int] | None = None,
        request_timeout_s: float = 60.0,
    ) -> None:
        self.server_url = server_url.rstrip("/")
        self.split, self.harness, self.sandbox = split, harness, sandbox
        self.llm_url, self.model, self.sampling = llm_url, model, sampling
        self.agent_timeout_sec, self.agent_step_limit, self.reward_key = (
            agent_timeout_sec,
            agent_step_limit,
            reward_key,
        )
        self.num_tasks, self.indices = num_tasks, indices
        self.request_timeout_s = request_timeout_s
        self._client: httpx.Client | None = None
        self._metadata_session: str | None = None
        self._tasks: list[dict[str, Any]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_client=None, _metadata_session=None, _tasks=None)
        return state

    @property
    def client(self) -> httpx.Client:
        if self._client is None:
            self._client = httpx.Client(base_url=self.server_url, timeout=self.request_timeout_s + _POLL_S)
        return self._client

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self.client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise RolloutServerError(f"rollout server {self.server_url} unreachable: {exc!r}") from exc
        if response.status_code >= 400:
            raise RolloutServerError(f"{method} {path}: {response.status_code} {response.text[:500]}")
        return response.json()

    def set_policy(self, model: str, version: int) -> None:
        """Send every model call of the server's rollouts from now on to served model ``model``, recording
        ``version`` on its turn (the server's ``PUT /policy``, passed to its capture proxy)."""
        self.request("PUT", "/policy", json={"model": model, "version": version})

    def tasks(self) -> list[dict[str, Any]]:
        """The split's tasks (``index``, ``name``, ``instruction``), narrowed by ``indices``/``num_tasks``."""
        if self._tasks is None:
            if self._metadata_session is None:
                self._metadata_session = self.request("POST", "/sessions")["session_id"]
            listed = self.request("GET", f"/splits/{self.split}/tasks")["tasks"]
            if self.indices is not None:
                listed = [t for t in listed if t["index"] in set(self.indices)]
            self._tasks = listed[: self.num_tasks] if self.num_tasks is not None else listed
        return self._tasks

    def prompt_rows(self) -> list[dict[str, Any]]:
        """Dataset rows, one per task: ``prompt`` (a user message), ``task_index``, ``task_name``."""
        return [
            {
                "prompt": [{"role": "user", "content": t["instruction"]}],
                "task_index": t["index"],
                "task_name": t["name"],
            }
            for t in self.tasks()
        ]

    def task_index(self, task: Any) -> int:
        """Which task a prompt row, message list, instruction string or index means."""
        if isinstance(task, int):
            return task
        if isinstance(task, dict) and task.get("task_index") is not None:
            return int(task["task_index"])
        text = task.get("prompt", task) if isinstance(task, dict) else task
        if isinstance(text, list):
            text = next((m.get("content") for m in reversed(text) if m.get("role") == "user"), None)
        for listed in self.tasks():
            if listed["instruction"] == text:
                return int(listed["index"])
        raise LookupError(f"no task in split {self.split!r} has this instruction: {str(text)[:120]!r}")

    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> HarborSession:
        index = self.task_index(task)
        session_id = self.request("POST", "/sessions")["session_id"]
        body = {
            "split": self.split, "index": index, "harness": self.harness, "sandbox": self.sandbox,
            "sampling": self.sampling, "agent_timeout_sec": self.agent_timeout_sec,
            "agent_step_limit": self.agent_step_limit, "reward_key": self.reward_key, "seed": seed,
            "episode_id": episode_id,
        }  # fmt: skip
        try:
            self.request("POST", f"/sessions/{session_id}/rollout", json=body)
        except RolloutServerError:
            self.request("DELETE", f"/sessions/{session_id}")
            raise
        return HarborSession(self, session_id)

    def close(self) -> None:
        if self._metadata_session is not None:
            try:
                self.request("DELETE", f"/sessions/{self._metadata_session}")
            except RolloutServerError:
                pass  # the server may be gone; nothing of ours is left to leak there
            self._metadata_session = None
        if self._client is not None:
            self._client.close()
            self._client = None


class HarborSession:
    """One rollout running on the server (OpenEnv's ``TrainableSession``)."""

    def __init__(self, factory: HarborSessionFactory, session_id: str) -> None:
        self.factory = factory
        self.session_id = session_id
        self.result: RolloutResult | None = None
        self.timed_out = False
        self._closed = False

    def wait_for_completion(self, timeout_s: float | None = None) -> int:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.result is None:
            wait = _POLL_S if deadline is None else min(_POLL_S, max(deadline - time.monotonic(), 0.0))
            body = self.factory.request("GET", f"/sessions/{self.session_id}", params={"wait": wait})
            if body["status"] == "done":
                self.result = RolloutResult.model_validate(body["result"])
            elif deadline is not None and time.monotonic() >= deadline:
                self.factory.request("POST", f"/sessions/{self.session_id}/stop")
                self.timed_out = True
                deadline = None  # the agent is stopping; wait for the verifier and the trace
        self.timed_out = self.timed_out or self.result.timed_out
        if self.timed_out and self.result.error is None:
            raise TimeoutError(f"agent on {self.result.task_name} timed out; captured turns stay trainable")
        return exit_code_of(self.result)

    def fetch_training_trace(self) -> TrainingTrace:
        if self.result is None:
            self.wait_for_completion()
        assert self.result is not None
        if self.result.error is not None:
            raise RolloutUnscorable(f"rollout unscorable: {self.result.error}")
        self.result.trace = self.factory.request("GET", f"/sessions/{self.session_id}/trace")
        return trace_of(self.result, self.session_id)

    def verify(self, completion: list[dict[str, Any]] | None = None, final_state: Any = None) -> VerifyResult:
        if self.result is None:
            self.wait_for_completion()
        assert self.result is not None
        return verify_result(self.result)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.factory.request("DELETE", f"/sessions/{self.session_id}")
        except RolloutServerError:
            pass  # already gone (server restarted); closing twice or late is not an error
