"""White-box sessions on a rollout server: OpenEnv ``ResourceSession`` s, their tools run in its sandboxes.

The trainer owns sampling; an OpenEnv harness adapter (``MCPHarnessAdapter``) drives the episode and calls
the session's tools, which the rollout server runs in the task's sandbox (``POST
/sessions/{id}/environment``, ``GET …/tools``, ``POST …/tools/call``, ``POST …/verify``: the routes in
:mod:`harness_trainer.rollouts.server.routes`). Make sessions with a factory (or one alone with
:meth:`WhiteBoxSession.start`)::

    factory = WhiteBoxSessionFactory("http://127.0.0.1:8200", split="train", sandbox="local")
    session = factory.create(factory.prompt_rows()[0])   # a row, its messages, an instruction or an index
    session.initial_messages()                           # [{"role": "user", "content": instruction}]
    session.call_tool("bash", {"command": "ls"})         # OpenEnv ToolResult
    session.verify(transcript).env_reward                # the task's verifier; None = ungraded
    session.close()

What each call raises: a tool result with ``error`` set is the model's mistake, never an exception. A
sandbox that failed to start or died (the server's 410) raises
:class:`~harness_trainer.rollouts.errors.RolloutUnscorable` (``kind="sandbox"``): the episode is left out of
its group. Anything else the server refuses, or a server out of reach, raises
:class:`~harness_trainer.rollouts.client.factory.RolloutServerError`. ``verify`` ends the episode (the
server closes the sandbox) and is idempotent; ``close`` is idempotent and never raises. Sessions are
synchronous (as OpenEnv's protocol is) and each holds its own HTTP client, so sessions run in threads at
once.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import httpx

from harness_trainer.rollouts.client.factory import RolloutServerError
from harness_trainer.rollouts.client.servers import error_message
from harness_trainer.rollouts.client.session import task_reference
from harness_trainer.rollouts.errors import RolloutConfigError, RolloutUnscorable
from harness_trainer.rollouts.result import EnvironmentVerdict

try:
    from openenv.core.env_server.mcp_types import Tool
    from openenv.core.harness import ResourceSession, ResourceSessionFactory, ToolResult, VerifyResult
except ImportError as exc:  # an optional extra: only white-box sessions need it
    raise ImportError(
        "white-box sessions need the `openenv` extra: pip install 'harness-trainer[openenv]'"
    ) from exc

from harness_trainer.rollouts.run_options import DEFAULT_RUN
from harness_trainer.sandboxes.tools import ToolLimits


class WhiteBoxSession(ResourceSession):
    """One white-box episode on a rollout server (module docstring); made by :meth:`start`."""

    session_id: str
    """The server's session id."""

    def __init__(self, client: httpx.Client, session_id: str, started: dict[str, Any]) -> None:
        self.client = client
        self.session_id = session_id
        self.task: dict[str, Any] = dict(started["task"])
        """``name``, ``split``, ``index`` and ``instruction`` of the episode's task."""
        self.tools = [_tool(spec) for spec in started["tools"]]
        self.verdict: EnvironmentVerdict | None = None
        self._closed = False

    @classmethod
    def start(
        cls,
        server_url: str,
        *,
        split: str = DEFAULT_RUN.split,
        index: int | None = None,
        instruction: str | None = None,
        sandbox: str = DEFAULT_RUN.sandbox,
        episode_timeout_sec: float | None = None,
        reward_key: str = "",
        tool_limits: ToolLimits | None = None,
        seed: int | None = None,
        episode_id: str | None = None,
        setup_timeout_sec: float = 900.0,
        request_timeout_s: float | None = None,
    ) -> WhiteBoxSession:
        """Open a session on the server and start its environment for the task (``index``, else
        ``instruction``, of ``split``). ``request_timeout_s`` bounds each tool call (default: a minute
        beyond the tools' largest command timeout, ``tool_limits.max_timeout_s``); ``setup_timeout_sec``
        the sandbox start."""
        if request_timeout_s is None:
            request_timeout_s = (tool_limits or ToolLimits()).max_timeout_s + 60.0
        client = httpx.Client(base_url=server_url.rstrip("/"), timeout=request_timeout_s)
        session_id: str | None = None
        try:
            session_id = _request(client, "POST", "/sessions")["session_id"]
            body: dict[str, Any] = {"split": split, "sandbox": sandbox, "reward_key": reward_key}
            body.update(episode_timeout_sec=episode_timeout_sec, seed=seed, episode_id=episode_id)
            if index is not None:
                body["index"] = index
            else:
                body["instruction"] = instruction
            if tool_limits is not None:
                body["tool_limits"] = dataclasses.asdict(tool_limits)
            path = f"/sessions/{session_id}/environment"
            started = _request(client, "POST", path, json=body, timeout=setup_timeout_sec)
            return cls(client, session_id, started)
        except BaseException:
            if session_id is not None:
                _delete(client, session_id)
            client.close()
            raise

    def initial_messages(self) -> list[dict[str, Any]]:
        """The task's instruction as the user's message (the tools go to the model separately)."""
        return [{"role": "user", "content": self.task["instruction"]}]

    def list_tools(self) -> list[Tool]:
        """The tool manifest the server sent when the environment started (a copy)."""
        return [tool.model_copy(deep=True) for tool in self.tools]

    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        """Run tool ``name`` in the server's sandbox; see the module docstring for what raises."""
        path = f"/sessions/{self.session_id}/tools/call"
        body = self._request("POST", path, json={"name": name, "arguments": arguments})
        return ToolResult(
            data=body.get("data"),
            done=bool(body.get("done")),
            metadata=dict(body.get("metadata") or {}),
            error=body.get("error"),
        )

    def verify(self, transcript: list[dict[str, Any]] | None = None, final_state: Any = None) -> VerifyResult:
        """Run the task's verifier in the sandbox (once; again: the same verdict). ``env_reward`` None means
        ungraded; ``metrics`` carry the tool counters as the trainer reads them (``tool_calls_by_name``,
        ``tool_failure_count``)."""
        if self.verdict is None:
            reply = self._request("POST", f"/sessions/{self.session_id}/verify")
            self.verdict = EnvironmentVerdict.model_validate(reply)
        return verify_result(self.verdict, self.session_id)

    def close(self) -> None:
        """Delete the server session (its sandbox closed, the call in flight cancelled); idempotent."""
        if self._closed:
            return
        self._closed = True
        _delete(self.client, self.session_id)
        self.client.close()

    def __enter__(self) -> WhiteBoxSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        if self._closed:
            raise RolloutServerError(f"white-box session {self.session_id} is closed")
        return _request(self.client, method, path, **kwargs)


def verify_result(verdict: EnvironmentVerdict, session_id: str) -> VerifyResult:
    """A white-box verdict as OpenEnv's ``VerifyResult``, for both white-box sessions (over HTTP and in
    process): the tool counters the trainer reads (``tool_calls_by_name``, ``tool_failure_count``), the
    verifier's details and the session's id."""
    metrics = {
        "tool_calls_by_name": dict(verdict.tool_calls_by_name),
        "tool_failures_by_name": dict(verdict.tool_failures_by_name),
        "tool_failure_count": verdict.tool_failure_count,
        "rewards": dict(verdict.rewards),
        "submitted": verdict.submitted,
        "verifier_exit_code": verdict.verifier_exit_code,
        "verifier_timed_out": verdict.verifier_timed_out,
        "phase_seconds": dict(verdict.phase_seconds),
        "sandbox_seconds": verdict.sandbox_seconds,
        "session_id": session_id,
    }
    artifacts = {
        "reward_detail": verdict.reward_detail,
        "verifier_output_tail": verdict.verifier_output_tail,
        "summary": verdict.summary,
    }
    return VerifyResult(env_reward=verdict.reward, done=True, metrics=metrics, artifacts=artifacts)


class WhiteBoxSessionFactory(ResourceSessionFactory[WhiteBoxSession]):
    """OpenEnv's session factory for white-box episodes of one split of a rollout server's tasks; keywords
    as :meth:`WhiteBoxSession.start`. Holds settings only (picklable); each session its own client. A
    :class:`~harness_trainer.rollouts.client.contract.SessionFactory` of OpenEnv ``ResourceSession`` s,
    which :mod:`harness_trainer.trainer.feed.whitebox` turns into rollouts."""

    def __init__(self, server_url: str, *, split: str = DEFAULT_RUN.split, **options: Any) -> None:
        """Raises TypeError for a keyword :meth:`WhiteBoxSession.start` does not take (or one ``create``
        sets: ``index``, ``instruction``, ``seed``, ``episode_id``), :class:`RolloutConfigError` for a split
        the server does not serve, :class:`RolloutServerError` for a server out of reach."""
        if taken := sorted(set(options) & {"index", "instruction", "seed", "episode_id"}):
            raise TypeError(f"WhiteBoxSessionFactory: {', '.join(taken)} are create()'s, not the factory's")
        inspect.signature(WhiteBoxSession.start).bind_partial(server_url, **options)
        self.server_url, self.split, self.options = server_url.rstrip("/"), split, options
        self.prompt_rows()  # the server answers and serves the split

    def prompt_rows(self) -> list[dict[str, Any]]:
        """Dataset rows, one per task: ``prompt`` (a user message), ``task_index``, ``task_name``."""
        with httpx.Client(base_url=self.server_url, timeout=60) as client:
            try:
                listed = _request(client, "GET", f"/splits/{self.split}/tasks")["tasks"]
            except RolloutServerError as exc:
                if exc.status != 404:
                    raise
                raise RolloutConfigError(
                    f"split {self.split!r} is not served by {self.server_url}: {exc}"
                ) from None
        return [
            {
                "prompt": [{"role": "user", "content": t["instruction"]}],
                "task_index": t["index"],
                "task_name": t["name"],
            }
            for t in listed
        ]

    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> WhiteBoxSession:
        """A session on ``task``: a task index, a prompt row (its ``task_index``), its messages, or the
        instruction (the server finds the task by it)."""
        ref = task_reference(task)
        which = {"index": ref} if isinstance(ref, int) else {"instruction": ref}
        return WhiteBoxSession.start(
            self.server_url, split=self.split, seed=seed, episode_id=episode_id, **which, **self.options
        )


def _tool(spec: dict[str, Any]) -> Tool:
    return Tool(name=spec["name"], description=spec["description"], input_schema=spec["inputSchema"])


def _request(client: httpx.Client, method: str, path: str, **kwargs: Any) -> Any:
    try:
        response = client.request(method, path, **kwargs)
    except httpx.HTTPError as exc:
        raise RolloutServerError(f"rollout server {client.base_url} unreachable: {exc!r}") from exc
    if response.status_code == 410:  # the sandbox failed to start or died: not the model's fault
        raise RolloutUnscorable(f"{method} {path}: {error_message(response)}", kind="sandbox")
    if response.status_code >= 400:
        message = f"{method} {path}: {response.status_code} {error_message(response)}"
        raise RolloutServerError(message, status=response.status_code)
    return response.json()


def _delete(client: httpx.Client, session_id: str) -> None:
    try:
        client.delete(f"/sessions/{session_id}")
    except httpx.HTTPError:
        pass  # the server may be gone; nothing of ours is left to leak there
