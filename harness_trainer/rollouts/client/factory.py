"""``HarborSessionFactory``: the trainer's client of a rollout server (``harness-trainer serve``).

Pass it as a builder, as with OpenEnv: ``partial(HarborSessionFactory, server_url, split="owner/tasks",
harness="opencode", sandbox="local", llm_url=..., model=...)``; the trainer calls
``builder(sampling=policy)`` (a :class:`~capture_proxy.sampling.SamplingPolicy`, or its JSON: validated once,
here; each rollout sends its JSON). ``server_url`` is one server's URL, or a list of them (below).
Keywords keep OpenEnv's meanings:

- ``split``: a dataset the server serves (``serve --dataset A --dataset B``), ``A:test`` for one of its
  sub-folder splits, or a bare split of its first dataset (``train``); see
  :mod:`harness_trainer.tasks.catalog`. ``GET /splits`` lists them.
- ``llm_url`` / ``model``: the engine and served model this factory's rollouts sample from; the server
  forwards only to engines it was allowed (``serve --upstream``, repeatable). Omitted: the server's first.
  ``api_key`` / ``auth_header``: that engine's credential (``Authorization: Bearer KEY``, or ``KEY``
  under ``auth_header``), sent by the capture proxy, never shown to the agent.
- ``agent_timeout_sec``: 0 (the default) = each task file's ``[agent] timeout_sec``.
- ``harness``: a registered harness, or several (a list: round-robin; a mapping of weights: weighted),
  each GRPO group's members all using one (:mod:`harness_trainer.rollouts.harness_mix`; the group comes
  from the trainer's episode id, and other episodes use the first harness); ``harness_for_group(g)`` says
  which, for the trainer's per-harness metrics. ``create(..., harness=NAME)`` runs that one of the mix
  instead (evaluation asks for each in turn).
- ``harness_options``: keyword options of the harness's class (e.g. mini-swe-agent's ``agent_config``:
  other prompts), checked here and by the server; with several harnesses, keyed by harness name.
- ``reward_key``: which named score of ``reward.json`` is the reward: a key, or a comma-separated
  preference list; checked against the first verifier result that writes scores (a key it does not
  hold stops the run with a :class:`RolloutConfigError` naming the keys it wrote).
- ``indices`` / ``num_tasks``: which tasks of the split (``indices=[]`` is refused: it would train on
  nothing); ``create(task)`` maps a prompt row to its task by its ``task_index``, else by its instruction.
- OpenEnv keywords that do not apply here (``keep_sandbox``, ``force_build``, a ``provider`` other than
  ``openai``, ``purpose="eval"``, ``eval_sampling``) are refused with the reason, never dropped.

Everything that can be checked is checked at construction, against the server: it answers, the split
exists, ``llm_url`` is allowed and serves ``model``, ``indices`` are in range. Each is a
:class:`RolloutConfigError` naming the value and the allowed ones (an unreachable server: a
:class:`RolloutServerError`).

A session's wait covers the whole rollout, not only its agent: ``wait_for_completion()`` without a
timeout waits the agent's timeout plus the task's verifier timeout plus ``setup_timeout_sec`` (sandbox
start and agent install), then stops the agent (its captured turns stay trainable). The factory is
picklable (it holds settings only; HTTP clients are made on use) and keeps one extra server session open
for metadata, so the server needs ``MAX_CONCURRENT_ENVS >= max_concurrent_rollouts + 1``.

Several servers (``server_url=[URL, URL, ...]``, no URL twice): each is checked as above at construction,
and all must list the same tasks for the split (indices and instructions) and sample from the same engine
and model, else a :class:`RolloutConfigError` naming the two that differ. A GRPO group's members run on
one server; groups go where most capacity is free (each server's own ``MAX_CONCURRENT_ENVS``); a server
that goes away loses only the rollouts it held (:class:`RolloutServerError`, unscorable) and comes back
only after taking the last policy sent. The contract: :mod:`harness_trainer.rollouts.client.servers`.
The metadata session is held by the first server that is up when the tasks are first listed (size that
one ``+1``); ``servers_report()`` counts, per server, what was placed and lost there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from capture_proxy.config import engine_root
from capture_proxy.sampling import SamplingPolicy
from harness_trainer.rollouts.client.servers import (
    POLL_S,
    Placement,
    RolloutServerError,
    Server,
    ServerPool,
    group_index,
    group_of,
)
from harness_trainer.rollouts.client.session import (
    RewardKeyCheck,
    VerifyResult,
    exit_code_of,
    sampling_policy,
    task_reference,
    trace_of,
    verify_result,
)
from harness_trainer.rollouts.errors import RolloutConfigError, error_for
from harness_trainer.rollouts.harness_mix import HarnessMix, HarnessValue, harness_mix
from harness_trainer.rollouts.result import RolloutResult
from harness_trainer.rollouts.run_options import DEFAULT_RUN
from harness_trainer.trace import TrainingTrace

__all__ = ["HarborSession", "HarborSessionFactory", "RolloutServerError"]
_OPENENV_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    # OpenEnv keyword: (the values that apply here, why others do not)
    "keep_sandbox": ((False,), "every sandbox is closed when its rollout ends, on every path (none is left "
                     "to pay for); a rollout's journal and log tail say what happened in it"),
    "force_build": ((False,), "E2B templates are built once per task environment, on first use or by "
                    "`harness-trainer e2b build-templates`, not per rollout"),
    "provider": (("openai",), "agents reach the engine through the capture proxy, which speaks each "
                 "harness's own dialect; only 'openai' (the engine's wire) applies"),
    "purpose": (("auto", "train"), "every rollout of a training factory is a training rollout"),
    "eval_sampling": ((None,), "the sampling policy is the trainer's (temperature only), so that the "
                      "engine's logprobs describe what is trained"),
}  # fmt: skip


class HarborSessionFactory:
    """The rollout server's rollouts as a :class:`~harness_trainer.rollouts.client.contract.SessionFactory`
    of :class:`HarborSession` s (module docstring)."""

    def __init__(
        self,
        server_url: str | Sequence[str],
        *,
        split: str = DEFAULT_RUN.split,
        harness: HarnessValue | HarnessMix = DEFAULT_RUN.harness,
        harness_options: dict[str, Any] | None = None,
        sandbox: str = DEFAULT_RUN.sandbox,
        llm_url: str | None = None,
        model: str | None = None,
        api_key: str | None = None,
        auth_header: str | None = None,
        sampling: SamplingPolicy | Mapping[str, Any] | None = None,
        agent_timeout_sec: float = 0,
        agent_step_limit: int = 0,
        reward_key: str = "",
        num_tasks: int | None = None,
        indices: list[int] | None = None,
        setup_timeout_sec: float = 900.0,
        request_timeout_s: float = 60.0,
        keep_sandbox: bool = False,
        force_build: bool = False,
        provider: str = "openai",
        purpose: str = "auto",
        eval_sampling: dict[str, Any] | None = None,
    ) -> None:
        """See the module docstring. ``setup_timeout_sec``: what a rollout may take beyond its agent and
        verifier (sandbox start, agent install, trace export) before the trainer stops waiting."""
        given = {"keep_sandbox": keep_sandbox, "force_build": force_build, "provider": provider}
        given.update(purpose=purpose, eval_sampling=eval_sampling)
        for name, value in given.items():
            applies, why = _OPENENV_ONLY[name]
            if value not in applies:
                raise RolloutConfigError(f"{name}={value!r} does not apply here: {why}")
        if agent_timeout_sec is None or agent_timeout_sec < 0:
            raise RolloutConfigError(
                f"agent_timeout_sec={agent_timeout_sec!r}: give seconds, or 0 for each task's own timeout"
            )
        if agent_step_limit < 0 or setup_timeout_sec <= 0 or request_timeout_s <= 0:
            raise RolloutConfigError("agent_step_limit must be ≥ 0, setup and request timeouts positive")
        if indices is not None and len(indices) == 0:
            raise RolloutConfigError("indices=[] selects no task: give task indices, or None for all")
        if num_tasks is not None and num_tasks < 1:
            raise RolloutConfigError(f"num_tasks={num_tasks}: give at least 1, or None for all")
        self.sampling = sampling_policy(sampling)
        """The trainer's sampling policy, sent with each rollout (None: the capture proxy's default)."""
        urls = [server_url] if isinstance(server_url, str) else list(server_url)
        self.server_urls = tuple(url.rstrip("/") for url in urls)
        if not self.server_urls or len(set(self.server_urls)) < len(self.server_urls):
            raise RolloutConfigError(
                f"server_url={server_url!r}: give one rollout server URL, or a list of them without repeats"
            )
        self.server_url = self.server_urls[0]
        """The (first) server's URL; ``server_urls`` holds them all."""
        try:
            self.harness_mix = harness_mix(harness)
        except ValueError as exc:
            raise RolloutConfigError(str(exc)) from None
        self.harness_options = dict(harness_options or {})
        problems = self.harness_mix.options_problems(self.harness_options)
        if problems:
            raise RolloutConfigError("; ".join(problems))
        if self.harness_options:
            # The server checks them too; here a bad one fails before any rollout is asked for. Only when
            # given: the client otherwise needs none of the server side (the harnesses import sandboxes).
            from harness_trainer.harnesses import make_harness

            for name in self.harness_mix.names:
                try:
                    make_harness(name, **self.harness_mix.options_for(self.harness_options, name))
                except ValueError as exc:
                    raise RolloutConfigError(str(exc)) from None
        self.split, self.sandbox = split, sandbox
        self.llm_url, self.model = llm_url or None, model or None
        self.api_key, self.auth_header = api_key or None, auth_header or None
        self.agent_timeout_sec, self.agent_step_limit, self.reward_key = (
            float(agent_timeout_sec),
            agent_step_limit,
            reward_key,
        )
        self.num_tasks, self.indices = num_tasks, None if indices is None else list(indices)
        self.setup_timeout_sec, self.request_timeout_s = setup_timeout_sec, request_timeout_s
        self.pool = ServerPool(self.server_urls, request_timeout_s)
        self._tasks: list[dict[str, Any]] | None = None
        self._tasks_lock = threading.Lock()  # rollout threads list tasks at once: one metadata session
        self.check_reward_key = RewardKeyCheck(reward_key)
        """Called by each session's ``verify`` (checks once)."""
        self.rollout_engine: str | None = None
        self.rollout_model: str | None = None
        """The engine and served model this factory's rollouts sample from (learned at construction)."""
        try:
            self._check_servers()
        except BaseException:
            self.close()
            raise

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_tasks=None, _tasks_lock=None)  # the pool pickles its settings only
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _tasks_lock=threading.Lock())

    @property
    def client(self) -> httpx.Client:
        """The first up server's HTTP client (made on use)."""
        return self.pool.primary().http(self.request_timeout_s)

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        """One request to the first server that is up (:class:`RolloutServerError` if it fails)."""
        return self.pool.call(self.pool.primary(), method, path, **kwargs)

    def servers_report(self) -> list[dict[str, Any]]:
        """Per server: ``url``, ``up``, ``open``, ``capacity``, ``placed``, ``lost`` (see
        :meth:`ServerPool.report <harness_trainer.rollouts.client.servers.ServerPool.report>`)."""
        return self.pool.report()

    def _check_servers(self) -> None:
        """Each server's checks; then all must list the same tasks and sample from one engine and model."""
        seen: list[tuple[str, list[tuple[int, str]], tuple[str | None, str | None]]] = []
        for server in self.pool.servers:
            listed = [(t["index"], t["instruction"]) for t in self._check_server(server)]
            seen.append((server.url, listed, (self.rollout_engine, self.rollout_model)))
            (first, first_tasks, first_engine), (url, tasks, engine) = seen[0], seen[-1]
            if tasks != first_tasks:
                raise RolloutConfigError(
                    f"rollout servers {first} and {url} list different tasks for split {self.split!r} "
                    f"({len(first_tasks)} and {len(tasks)} tasks, or other instructions): serve one dataset"
                )
            if engine != first_engine:
                raise RolloutConfigError(
                    f"rollout servers {first} and {url} sample from different engines or models "
                    f"({first_engine} and {engine}): their rollouts must sample from one policy"
                )

    def _check_server(self, server: Server) -> list[dict[str, Any]]:
        """One server's checks (module docstring); its task listing of the split."""
        health = self.pool.call(server, "GET", "/health")
        server.capacity = int(health.get("max_concurrent_envs", 0))
        engines = {engine_root(e["url"]): list(e["models"]) for e in health.get("engines", [])}
        if engines:
            url = engine_root(self.llm_url) if self.llm_url else next(iter(engines))
            if url not in engines:
                raise RolloutConfigError(
                    f"llm_url {self.llm_url!r} is not an engine the rollout server at {server.url} "
                    f"forwards to; allowed: {', '.join(engines)} (start it with --upstream {self.llm_url})"
                )
            if self.model is not None and self.model not in engines[url]:
                raise RolloutConfigError(
                    f"model {self.model!r} is not served by the engine at {url}; it serves {engines[url]}"
                )
            self.rollout_engine, self.rollout_model = (
                url,
                self.model or (health.get("model") if url == next(iter(engines)) else engines[url][0]),
            )
        if not self.split:  # OpenEnv's default: the (first) server's first dataset
            self.split = self.pool.call(server, "GET", "/splits")["datasets"][0]["name"]
        try:  # listed without the metadata session: a factory built only to be pickled holds none
            listed = self.pool.call(server, "GET", f"/splits/{self.split}/tasks")["tasks"]
        except RolloutServerError as exc:
            if exc.status != 404:
                raise
            known = self.pool.call(server, "GET", "/splits").get("splits", [])
            raise RolloutConfigError(
                f"split {self.split!r} is not served by {server.url}; splits: {known}"
            ) from None
        have = {t["index"] for t in listed}
        if self.indices is not None and (missing := sorted(set(self.indices) - have)):
            raise RolloutConfigError(
                f"indices {missing} are not in split {self.split!r} (it has tasks 0..{len(have) - 1})"
            )
        if not listed:
            raise RolloutConfigError(f"split {self.split!r} of {server.url} has no task to run")
        return listed

    def check_engine(self, engine_url: str) -> None:
        """The trainer's engine at ``engine_url`` must serve the model this factory's rollouts sample from
        (else the trainer would learn from another model's tokens); :class:`RolloutConfigError` if not."""
        if self.rollout_model is None:
            return
        root = engine_root(engine_url)
        try:
            reply = httpx.get(root + "/v1/models", timeout=self.request_timeout_s)
            served = [str(entry["id"]) for entry in reply.json()["data"]]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            raise RolloutServerError(
                f"the trainer's engine at {root} does not list its models: {exc!r}"
            ) from exc
        if self.rollout_model not in served:
            raise RolloutConfigError(
                f"the rollout server's agents sample from model {self.rollout_model!r} at "
                f"{self.rollout_engine}, which the trainer's engine at {root} does not serve ({served}): "
                f"they must be one engine (pass llm_url={root!r})"
            )

    def set_policy(self, model: str, version: int) -> None:
        """Send every model call of the server's rollouts from now on to served model ``model``, recording
        ``version`` on its turn (the server's ``PUT /policy``, passed to its capture proxy). With several
        servers: every one that is up (it raises only when none took it)."""
        self.pool.set_policy({"model": model, "version": version})

    def set_policy_version(self, version: int) -> None:
        """Record ``version`` on every later model call of the server's rollouts, their model unchanged (the
        server's ``PUT /policy`` without a model): the trainer's call after pushing weights in place."""
        self.pool.set_policy({"version": version})

    def tasks(self) -> list[dict[str, Any]]:
        """The split's tasks (``index``, ``name``, ``instruction``, timeouts), narrowed by ``indices`` /
        ``num_tasks``."""
        with self._tasks_lock:
            if self._tasks is None:  # from the first server up: all list the same (checked at construction)
                server = self.pool.primary()
                self.pool.open_metadata_session(server)
                listed = self.pool.call(server, "GET", f"/splits/{self.split}/tasks")["tasks"]
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
        text = task_reference(task)
        if isinstance(text, int):
            return text
        for listed in self.tasks():
            if listed["instruction"] == text:
                return int(listed["index"])
        raise LookupError(f"no task in split {self.split!r} has this instruction: {str(text)[:120]!r}")

    def wait_timeout_s(self, index: int) -> float:
        """How long the trainer waits for a rollout of task ``index``: agent + verifier + setup."""
        listed = next((t for t in self.tasks() if t["index"] == index), {})
        agent = self.agent_timeout_sec or float(listed.get("agent_timeout_sec", 600.0))
        return agent + float(listed.get("verifier_timeout_sec", 600.0)) + self.setup_timeout_sec

    @property
    def harness(self) -> HarnessValue:
        """The harness value as given: a name, a list or a mapping of weights."""
        return self.harness_mix.value()

    def harness_for_group(self, group: int) -> str | None:
        """The harness GRPO group ``group`` runs on when this factory mixes harnesses, else None."""
        return self.harness_mix.for_group(group) if self.harness_mix.mixed else None

    def create(
        self, task: Any, seed: int | None = None, episode_id: str | None = None, *, harness: str | None = None
    ) -> HarborSession:
        """A rollout of ``task`` on the server; ``harness`` (one of the mix) runs instead of the group's.

        Raises:
            RolloutConfigError: ``harness`` is not one of the factory's.
        """
        index = self.task_index(task)
        try:
            harness = self.harness_mix.chosen(harness, group_index(episode_id))
        except ValueError as exc:
            raise RolloutConfigError(str(exc)) from None
        wait_timeout_s = self.wait_timeout_s(index)  # lists tasks first: placing counts the metadata session
        sampling = None if self.sampling is None else self.sampling.wire_json()
        body = {
            "split": self.split, "index": index, "harness": harness, "sandbox": self.sandbox,
            "sampling": sampling, "agent_timeout_sec": self.agent_timeout_sec or None,
            "agent_step_limit": self.agent_step_limit, "reward_key": self.reward_key, "seed": seed,
            "episode_id": episode_id,
        }  # fmt: skip
        if options := self.harness_mix.options_for(self.harness_options, harness):
            body["harness_options"] = options
        engine = {"llm_url": self.llm_url, "model": self.model}
        engine.update(api_key=self.api_key, auth_header=self.auth_header)
        body.update({k: v for k, v in engine.items() if v is not None})
        for attempt in range(len(self.pool.servers)):
            placement = self.pool.place(group_of(episode_id))
            try:
                session_id = self.pool.call(placement.server, "POST", "/sessions")["session_id"]
                break
            except RolloutServerError as exc:
                self.pool.release(placement)
                if exc.status is not None or attempt == len(self.pool.servers) - 1:
                    raise
                # that server is now down: the next placement skips it (or says none is up)
        try:
            self.pool.call(placement.server, "POST", f"/sessions/{session_id}/rollout", json=body)
        except RolloutServerError:
            self.pool.close_session(placement, session_id)
            raise
        return HarborSession(self, session_id, wait_timeout_s=wait_timeout_s, placement=placement)

    def close(self) -> None:
        """Close the metadata session and client of every server (up or gone); sessions are their owner's."""
        self.pool.close()

    def __enter__(self) -> HarborSessionFactory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HarborSession:
    """One rollout running on the server: a :class:`~harness_trainer.rollouts.client.contract.Session`
    (OpenEnv's ``TrainableSession``)."""

    session_id: str
    """The server's session id (not the capture session's: that comes with the result)."""

    def __init__(
        self,
        factory: HarborSessionFactory,
        session_id: str,
        wait_timeout_s: float,
        placement: Placement | None = None,
    ) -> None:
        self.factory = factory
        self.session_id = session_id
        self.placement = placement
        """Its server (None: the factory's first, unplaced: a session made by hand)."""
        self.wait_timeout_s = wait_timeout_s
        """The whole rollout's bound: its agent, verifier and setup timeouts (see the module docstring)."""
        self.result: RolloutResult | None = None
        self.timed_out = False
        self._closed = False

    def wait_for_completion(self, timeout_s: float | None = None) -> int:
        """The agent's exit code once the rollout is done; past ``timeout_s`` (default: the rollout's own
        bound, ``wait_timeout_s``) the agent is stopped and ``TimeoutError`` raised, its turns kept."""
        deadline = time.monotonic() + (self.wait_timeout_s if timeout_s is None else timeout_s)
        while self.result is None:
            wait = POLL_S if deadline is None else min(POLL_S, max(deadline - time.monotonic(), 0.0))
            body = self._request("GET", f"/sessions/{self.session_id}", params={"wait": wait})
            if body["status"] == "done":
                self.result = RolloutResult.model_validate(body["result"])
            elif deadline is not None and time.monotonic() >= deadline:
                self._request("POST", f"/sessions/{self.session_id}/stop")
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
            raise error_for(self.result)
        self.result.trace = self._request("GET", f"/sessions/{self.session_id}/trace")
        return trace_of(self.result, self.session_id)

    def verify(self, completion: list[dict[str, Any]] | None = None, final_state: Any = None) -> VerifyResult:
        if self.result is None:
            self.wait_for_completion()
        assert self.result is not None
        self.factory.check_reward_key(self.result)
        return verify_result(self.result)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.placement is not None:
            self.factory.pool.close_session(self.placement, self.session_id)
            return
        try:
            self.factory.request("DELETE", f"/sessions/{self.session_id}")
        except RolloutServerError:
            pass  # already gone (server restarted); closing twice or late is not an error

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        if self.placement is None:
            return self.factory.request(method, path, **kwargs)
        return self.factory.pool.session_call(self.placement, method, path, **kwargs)
