"""What one rollout asks for and what it gives back; both cross the rollout server's wire."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from harness_trainer.rollouts.agreement import Agreement
from harness_trainer.rollouts.errors import ErrorKind


class RolloutOptions(BaseModel):
    """How to run one rollout of a task (everything but the task itself)."""

    model_config = ConfigDict(extra="forbid")

    harness: str = "opencode"
    """Agent program: a key of ``HARNESSES`` (opencode, mini-swe-agent, claude-code, codex)."""
    harness_options: dict[str, Any] = Field(default_factory=dict)
    """Keyword options of that harness's class (``make_harness``), e.g. mini-swe-agent's ``agent_config``
    or opencode's ``max_output_tokens``; checked when the rollout is asked for (a bad one: HTTP 400)."""
    sandbox: str = "local"
    """Sandbox backend: a key of ``SANDBOXES`` (local, e2b)."""
    sampling: dict[str, Any] | None = None
    """The trainer's sampling policy (temperature only); the capture proxy applies it to every call."""
    agent_timeout_sec: float | None = Field(default=None, gt=0)
    """Wall-clock limit for the agent; default: the task's ``[agent] timeout_sec``."""
    agent_step_limit: int = Field(default=0, ge=0)
    """Agent steps (0 = the harness default); also the capture session's model-call budget when > 0."""
    reward_key: str = ""
    """Which named score of ``reward.json`` is the reward: a key, or a comma-separated preference list
    (the first present wins); default: the only one, or ``reward``."""
    seed: int | None = None
    episode_id: str | None = None
    llm_url: str | None = None
    """The engine this rollout's model calls go to: one the server was allowed (``serve --upstream``,
    repeatable); default: the first."""
    model: str | None = Field(default=None, min_length=1)
    """The served model at that engine; default: the server's ``--served-model`` for its first engine,
    else the engine's first ``/v1/models`` entry."""
    api_key: str | None = Field(default=None, repr=False)
    """Credential for a token-gated ``llm_url`` (sent by the capture proxy, never to the agent)."""
    auth_header: str | None = None
    """Header to send ``api_key`` under when not ``Authorization`` (then the key is sent as is, not as
    ``Bearer KEY``)."""

    def engine_headers(self) -> dict[str, str]:
        """The headers the capture proxy sends the engine for this rollout's calls."""
        if not self.api_key:
            return {}
        if not self.auth_header or self.auth_header.lower() == "authorization":
            return {"Authorization": f"Bearer {self.api_key}"}
        return {self.auth_header: self.api_key}


class StepResult(BaseModel):
    """One step of a multi-step task's rollout (:mod:`harness_trainer.tasks.steps`): its agent run and its
    verifier's reward (None: the verifier wrote none, or timed out)."""

    name: str
    reward: float | None = None
    rewards: dict[str, float] = Field(default_factory=dict)
    reward_detail: str = ""
    exit_code: int | None = None
    timed_out: bool = False
    seconds: float = 0.0


class RolloutResult(BaseModel):
    """The outcome of one rollout. ``reward`` None means ungraded (never coerced to 0).

    ``error`` set means unscorable (the sandbox or agent install failed, the proxy was unreachable):
    the trainer excludes it from the group baseline and trains nothing from it; ``error_kind`` says why,
    and a malformed capture (``capture_contract``) stops training.
    """

    task_name: str
    split: str = ""
    task_index: int = 0
    harness: str
    sandbox: str
    capture_session_id: str | None = None
    reward: float | None = None
    rewards: dict[str, float] = Field(default_factory=dict)
    reward_detail: str = ""
    exit_code: int | None = None
    timed_out: bool = False
    tool_calls_by_name: dict[str, int] = Field(default_factory=dict)
    tool_failure_count: int = 0
    model_calls: int = 0
    findings: list[dict[str, Any]] = Field(default_factory=list)
    phase_seconds: dict[str, float] = Field(default_factory=dict)
    sandbox_seconds: float = 0.0
    """Sandbox-seconds: each of its sandboxes (the agent's, a separate verifier's) from the backend handing
    it over to the end of its close, summed (:mod:`~harness_trainer.rollouts.server.sandbox_meter`); 0 when
    none started."""
    snapshot: str | None = None
    """The snapshot its sandbox started from when its group was set up once (:mod:`~harness_trainer.rollouts.
    server.group_setup`), else None (a cold start)."""
    group_setup_note: str | None = None
    """Why it started cold although its backend forks (its group's setup, or its own start from the
    snapshot, failed)."""
    log_tail: str = ""
    error: str | None = None
    error_kind: ErrorKind | None = None
    """Why ``error`` (:mod:`harness_trainer.rollouts.errors`): how the trainer's side treats it."""
    error_rules: list[str] = Field(default_factory=list)
    """With ``error_kind == "capture_contract"``: the trace rules the capture broke."""
    trace: dict[str, Any] | None = None
    """The TrainingTrace JSON (``{"schema_version": 1, "turns": []}`` when nothing was captured)."""
    agreement: Agreement | None = None
    """The agent's own record of its model calls against the capture (:mod:`..agreement`); None when the
    rollout ended before its trace was read."""
    steps: list[StepResult] = Field(default_factory=list)
    """A multi-step task's steps that ran, in order (the rest were not run: a step missed its
    ``min_reward``, or the rollout was stopped); ``reward`` is their roll-up. Empty for other tasks."""

    @property
    def unscorable(self) -> bool:
        return self.error is not None

    @property
    def tool_call_count(self) -> int:
        return sum(self.tool_calls_by_name.values())


class EnvironmentOptions(BaseModel):
    """How to start a white-box session's environment (``POST /sessions/{id}/environment``): a task's
    sandbox offered as tools, with no agent and no capture session (the trainer samples the model)."""

    model_config = ConfigDict(extra="forbid")

    sandbox: str = "local"
    """Sandbox backend: a key of ``SANDBOXES`` (local, docker, e2b)."""
    episode_timeout_sec: float | None = Field(default=None, gt=0)
    """How long the episode may run; the sandbox closes itself after this plus the verifier's timeout (and
    some slack). Default: the task's ``[agent] timeout_sec``."""
    reward_key: str = ""
    """Which named score of ``reward.json`` is the reward (as in :class:`RolloutOptions`)."""
    tool_limits: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of :class:`~harness_trainer.sandboxes.tools.ToolLimits` (``default_timeout_s``,
    ``max_timeout_s``, ``max_output_chars``), checked there; omitted ones keep its defaults."""
    seed: int | None = None
    episode_id: str | None = None


class EnvironmentVerdict(BaseModel):
    """What ``POST /sessions/{id}/verify`` returns: the task's verifier run in the episode's sandbox, and the
    episode's tool counters. ``reward`` None means ungraded (the verifier timed out or wrote no reward),
    never 0."""

    task_name: str
    split: str = ""
    task_index: int = 0
    sandbox: str
    reward: float | None = None
    rewards: dict[str, float] = Field(default_factory=dict)
    reward_detail: str = ""
    verifier_exit_code: int | None = None
    verifier_timed_out: bool = False
    verifier_output_tail: str = ""
    tool_calls_by_name: dict[str, int] = Field(default_factory=dict)
    tool_failures_by_name: dict[str, int] = Field(default_factory=dict)
    tool_failure_count: int = 0
    submitted: bool = False
    """Whether the model called ``submit``."""
    summary: str | None = None
    """The ``submit`` call's summary, if any."""
    phase_seconds: dict[str, float] = Field(default_factory=dict)
    """``sandbox_start``, ``upload`` (the task's ``tests/``), ``verifier``."""
    sandbox_seconds: float = 0.0
    """The episode's sandbox from the backend handing it over to this verdict (its close follows at once)."""
