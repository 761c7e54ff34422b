"""White-box rollouts under the trainer's scheduler (issue 23): an OpenEnv adapter runs each episode.

:class:`WhiteBoxRolloutFactory` wraps an OpenEnv ``ResourceSessionFactory`` (e.g.
:class:`~harness_trainer.rollouts.client.whitebox_session.WhiteBoxSessionFactory`) and a
``HarnessAdapter`` (e.g. OpenEnv's ``MCPHarnessAdapter``) into the loop-owning shape the
:class:`~harness_trainer.trainer.feed.scheduling.RolloutScheduler` already drives. Each ``create`` opens one
resource session, wrapped in :class:`~harness_trainer.whitebox.model_step.AnswersParseErrors`, and one fresh
:class:`~harness_trainer.whitebox.model_step.TokenModelStep`; the rollout (:class:`WhiteBoxRollout`) then
answers the scheduler's calls in this order:

1. ``wait_for_completion(timeout_s)``: ``adapter.run_white_box(model_step, session, limits)``. The timeout is
   cooperative: once it has passed, the model step answers the adapter's next call with an empty reply
   (which ends OpenEnv's MCP loop, as the context budget does) without sampling, and ``TimeoutError`` is
   raised when the adapter returns (the scheduler marks the rollout timed out; its turns stay trainable).
   A tool call in flight is bounded by the session's own tool timeout.
2. ``fetch_training_trace()``: the model step's trace (:mod:`harness_trainer.whitebox.episode`), built
   from the engine's own ids.
3. ``verify(messages)``: the session's ``verify`` on the adapter's transcript (the scheduler's
   ``messages`` are ignored: the adapter's are the real ones). The result's ``metrics`` are the session's,
   plus the tool counters the trainer reads (``tool_calls_by_name``, ``tool_failure_count``: from the
   adapter's tool trace, parse errors included as failed calls; the session's own when the adapter kept no
   trace) and the episode's ``whitebox/*`` counters.
4. ``close()``: closes the session (its sandbox) and the step's HTTP client; idempotent, never raises.

Failures, judged by the scheduler's usual rules (:mod:`harness_trainer.trainer.feed.failures`): what the
session
raises (a dead sandbox's ``RolloutUnscorable``, a ``RolloutServerError``) is infrastructure; an engine that
fails the model step (``EngineCallError``) is re-raised as ``RolloutUnscorable(kind="engine")``; an episode
that sampled no turn as ``RolloutUnscorable(kind="harness")``; anything else an adapter raises is a bug,
re-raised as :class:`~harness_trainer.trainer.feed.failures.AdapterError` naming the adapter: *unexpected*
(traceback logged once per place, counted against ``max_unexpected_errors``), and a second kind of adapter
bug right after the first stops the run.

:func:`check_white_box` is the trainer's construction-time check; :func:`white_box_factory` builds the
wrapper at setup, learning the served model's name and context length from the engine's ``/v1/models``.
"""

from __future__ import annotations

import collections
import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from capture_proxy.sampling import SamplingPolicy
from harness_trainer.rollouts.errors import RolloutUnscorable
from harness_trainer.trace import TrainingTrace
from harness_trainer.trainer.feed.failures import AdapterError, is_infrastructure
from harness_trainer.whitebox.episode import EmptyEpisode
from harness_trainer.whitebox.model_step import AnswersParseErrors, EngineCallError, TokenModelStep

try:
    from openenv.core.harness import (
        HarnessAdapter,
        HarnessRolloutResult,
        HarnessRunLimits,
        ModelStepResult,
        ResourceSessionFactory,
        VerifyResult,
    )
    from openenv.core.llm_client import LLMResponse
except ImportError as exc:  # an optional extra, as for the model step
    raise ImportError(
        "white-box rollouts need the `openenv` and `trl` extras: pip install 'harness-trainer[openenv,trl]'"
    ) from exc

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepSettings:
    """What each rollout's :class:`TokenModelStep` is made from (one per rollout, never shared)."""

    tokenizer: Any
    base_url: str
    model: str
    """The served model name requests name (``/v1/models``)."""
    policy: SamplingPolicy
    context_budget: int
    """Prompt plus completion tokens of one call at most: the engine's ``max_model_len``."""
    max_completion_tokens: int
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    policy_version: Callable[[], int | None] | None = None
    """The weight version the trainer last pushed, read before each turn (vLLM names none in its reply)."""

    def make(self) -> TokenModelStep:
        return TokenModelStep(
            self.tokenizer, self.base_url, self.model, policy=self.policy,
            chat_template_kwargs=self.chat_template_kwargs, context_budget=self.context_budget,
            max_completion_tokens=self.max_completion_tokens,
        )  # fmt: skip


class _TimedStep:
    """The model step, with the served model and the policy version refreshed before each turn, and the
    cooperative deadline. ``policy`` gives the model a turn names and, once the trainer published an
    adapter (``lora_sync="adapter"``), that adapter's version, read together so a turn never pairs one
    adapter's name with another's version; before that, the version is ``version``'s (in-place pushes)."""

    def __init__(
        self,
        step: TokenModelStep,
        version: Callable[[], int | None] | None,
        policy: Callable[[], tuple[str, int | None]] | None = None,
    ) -> None:
        self.step, self.version, self.policy = step, version, policy
        self.deadline: float | None = None
        self.expired = False

    def __call__(self, messages: list[Any], tools: list[Any], sampling: dict[str, Any]) -> ModelStepResult:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self.expired = True  # nothing sampled: the adapter sees a final, empty reply
            return ModelStepResult(response=LLMResponse(content=""))
        model, published = self.policy() if self.policy is not None else (self.step.model, None)
        self.step.model = model
        if published is not None:
            self.step.policy_version = published
        elif self.version is not None:
            self.step.policy_version = self.version()
        return self.step(messages, tools, sampling)


class WhiteBoxRollout:
    """One white-box episode in the scheduler's loop-owning shape (module docstring, steps 1-4): a
    :class:`~harness_trainer.rollouts.client.contract.Session`."""

    def __init__(
        self,
        session: AnswersParseErrors,
        adapter: HarnessAdapter,
        step: TokenModelStep,
        limits: HarnessRunLimits,
        policy_version: Callable[[], int | None] | None = None,
        policy: Callable[[], tuple[str, int | None]] | None = None,
    ) -> None:
        self.session, self.adapter, self.limits = session, adapter, limits
        self.step = step
        self._timed = _TimedStep(step, policy_version, policy)
        self.result: HarnessRolloutResult | None = None
        self._closed = False
        self._close_lock = threading.Lock()

    @property
    def session_id(self) -> str | None:
        """The resource session's id when it has one (a rollout server's session)."""
        # The inner session may be any OpenEnv ResourceSession, and OpenEnv's declare no id.
        return getattr(self.session.inner, "session_id", None)

    def wait_for_completion(self, timeout_s: float | None = None) -> int:
        """Run the episode; 0 when the adapter returned. Raises ``TimeoutError`` after it returned past
        ``timeout_s``, ``RolloutUnscorable`` for an engine that failed the model step."""
        if timeout_s is not None:
            self._timed.deadline = time.monotonic() + timeout_s
        try:
            self.result = self.adapter.run_white_box(self._timed, self.session, self.limits)
        except EngineCallError as exc:
            raise RolloutUnscorable(f"white-box rollout: {exc}", kind="engine") from exc
        except Exception as exc:
            if is_infrastructure(exc):  # the session's or the engine's, passed on by the adapter
                raise
            raise AdapterError(type(self.adapter).__name__, exc) from exc
        if self._timed.expired:
            raise TimeoutError(f"the white-box episode ran past {timeout_s} s; its turns are kept")
        return 0

    def fetch_training_trace(self) -> TrainingTrace:
        """The episode's trace, from the engine's own ids."""
        return self._episode().trace

    def verify(self, messages: list[Any] | None = None, final_state: Any = None) -> VerifyResult:
        """The session's verdict on the adapter's transcript, with the tool and ``whitebox/*`` counters."""
        result = self.result or HarnessRolloutResult()
        verdict = self.session.verify(list(result.messages), final_state or _final_state(result))
        metrics = dict(verdict.metrics or {})
        if result.tool_trace or "tool_calls_by_name" not in metrics:
            by_name = collections.Counter(entry.tool_name for entry in result.tool_trace)
            metrics["tool_calls_by_name"] = dict(by_name)
            metrics["tool_failure_count"] = sum(entry.result.error is not None for entry in result.tool_trace)
        metrics |= self._episode().metrics
        metrics["whitebox/done"] = float(result.done)
        return VerifyResult(
            env_reward=verdict.env_reward,
            done=verdict.done,
            metrics=metrics,
            artifacts=dict(verdict.artifacts),
        )

    def close(self) -> None:
        """Close the session and the step's client, once; a failure is logged (cleanup goes on)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        for closer in (self.session.close, self.step.close):
            try:
                closer()
            except Exception:  # closing is best effort on every path; the scheduler goes on either way
                logger.warning("closing a white-box rollout failed", exc_info=True)

    def _episode(self) -> Any:
        try:
            return self.step.trace()
        except EmptyEpisode as exc:
            raise RolloutUnscorable(f"white-box rollout: {exc}", kind="harness") from exc


class WhiteBoxRolloutFactory:
    """A ``ResourceSessionFactory`` and an adapter as the scheduler's session factory (module docstring): a
    :class:`~harness_trainer.rollouts.client.contract.SessionFactory` of :class:`WhiteBoxRollout` s.

    ``prompt_rows`` is the inner factory's, when it has one.
    """

    def __init__(
        self,
        factory: ResourceSessionFactory,
        adapter: HarnessAdapter,
        settings: StepSettings,
        limits: HarnessRunLimits | None = None,
    ) -> None:
        self.inner, self.adapter, self.settings = factory, adapter, settings
        self.limits = limits or HarnessRunLimits()
        self.policy: tuple[str, int | None] = (settings.model, None)
        """The served model every later turn names and its version: the base model's (its version the
        trainer's), or the newest adapter's (``set_policy``). One tuple, replaced whole."""
        settings.make().close()  # a chat template TRL cannot parse fails here, not in every rollout
        if callable(getattr(factory, "prompt_rows", None)):
            self.prompt_rows = factory.prompt_rows

    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> WhiteBoxRollout:
        step = self.settings.make()
        try:
            session = self.inner.create(task, seed=seed, episode_id=episode_id)
        except BaseException:
            step.close()
            raise
        return WhiteBoxRollout(
            AnswersParseErrors(session),
            self.adapter,
            step,
            self.limits,
            self.settings.policy_version,
            lambda: self.policy,
        )

    def set_policy(self, model: str, version: int) -> None:
        """Name served model ``model`` (``version``'s adapter, with ``lora_sync="adapter"``) in every later
        turn, of episodes running and to come, each recording ``version``, as the capture proxy does for
        black-box calls."""
        self.policy = (model, version)

    def close(self) -> None:
        closer = getattr(self.inner, "close", None)
        if callable(closer):
            closer()


def check_white_box(adapter: Any, builder: Callable[..., Any]) -> None:
    """Refuse, before anything starts, an adapter that cannot run white-box or a builder whose factory's
    sessions cannot expose tools.

    Raises:
        TypeError: ``adapter`` has no ``run_white_box``; ``builder`` is (a ``partial`` of) a class, or a
            function annotated to return one, that is not an OpenEnv ``ResourceSessionFactory``.
    """
    if not callable(getattr(adapter, "run_white_box", None)):
        raise TypeError(f"harness_adapter must be an OpenEnv HarnessAdapter; {type(adapter).__name__} is not")
    made = _made_class(builder)
    if made is not None:
        _require_resource_factory(made)


def ensure_resource_factory(factory: Any) -> None:
    """The same check on the built factory, for a builder :func:`check_white_box` could not see through."""
    _require_resource_factory(type(factory))


def white_box_factory(
    factory: Any,
    adapter: HarnessAdapter,
    *,
    tokenizer: Any,
    base_url: str,
    sampling: SamplingPolicy | Mapping[str, Any],
    max_completion_length: int | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    limits: HarnessRunLimits | None = None,
    policy_version: Callable[[], int | None] | None = None,
) -> WhiteBoxRolloutFactory:
    """The trainer's wrapper around its builder's ``factory``: the served model and its context length
    from ``base_url``'s ``/v1/models`` (first card), ``sampling`` the trainer's policy (or its JSON).

    Raises:
        TypeError: ``factory`` is not a ``ResourceSessionFactory``.
        EngineCallError: the engine does not list a model with its ``max_model_len``.
    """
    try:
        ensure_resource_factory(factory)
        model, context = served_model(base_url)
        settings = StepSettings(
            tokenizer=tokenizer, base_url=base_url, model=model,
            policy=SamplingPolicy.model_validate(sampling), context_budget=context,
            max_completion_tokens=min(max_completion_length or context, context),
            chat_template_kwargs=dict(chat_template_kwargs or {}), policy_version=policy_version,
        )  # fmt: skip
        return WhiteBoxRolloutFactory(factory, adapter, settings, limits)
    except BaseException:
        closer = getattr(factory, "close", None)  # the trainer never sees it, so it would not close it
        if callable(closer):
            closer()
        raise


def served_model(base_url: str, timeout_s: float = 30.0) -> tuple[str, int]:
    """The first model the engine serves and its context length (``id``, ``max_model_len`` of
    ``GET /v1/models``: vLLM and the dev engine both send them)."""
    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        card = httpx.get(root + "/v1/models", timeout=timeout_s).raise_for_status().json()["data"][0]
        return str(card["id"]), int(card["max_model_len"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise EngineCallError(
            f"white-box rollouts need the engine at {root} to list its model and max_model_len "
            f"(GET /v1/models): {exc!r}"
        ) from exc


def _made_class(builder: Callable[..., Any]) -> type | None:
    """The class ``builder`` makes, when that is known without calling it: a class, a ``partial`` of one,
    or a function whose return annotation names one; None otherwise."""
    target: Any = builder
    while isinstance(target, functools.partial):
        target = target.func
    if inspect.isclass(target):
        return target
    try:
        made = inspect.signature(target, eval_str=True).return_annotation
    except (TypeError, ValueError, NameError):
        return None
    if made in (inspect.Signature.empty, Any, object) or not inspect.isclass(made):
        return None  # no annotation, or one that says nothing (``Any`` is a class from Python 3.11)
    return made


def _require_resource_factory(made: type) -> None:
    # The tools are the point of white-box mode, and whether a session has them is known only once a
    # sandbox runs; so the check is on the factory's type, which is known without one. An OpenEnv
    # ResourceSessionFactory promises ResourceSessions (initial_messages, list_tools, call_tool, verify and
    # close are abstract there). A duck-typed create() would not do: HarborSessionFactory and
    # LocalSessionFactory have one too, and their loop-owning sessions expose no tools.
    if not issubclass(made, ResourceSessionFactory):
        raise TypeError(
            f"harness_adapter needs a factory of OpenEnv ResourceSessions (sessions that expose the sandbox "
            f"as tools), e.g. partial(WhiteBoxSessionFactory, server_url); {made.__name__} is not a "
            "ResourceSessionFactory"
        )


def _final_state(result: HarnessRolloutResult) -> dict[str, Any]:
    """What OpenEnv's own rollout function passes ``verify`` as the final state."""
    return {
        "done": result.done,
        "metrics": dict(result.metrics),
        "tool_trace": [
            {"tool_name": e.tool_name, "arguments": dict(e.arguments), "error": e.result.error}
            for e in result.tool_trace
        ],
    }
