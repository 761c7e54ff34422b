"""Preflight of a real run: every check that can fail cheaply, before a sandbox starts or a weight moves.

:func:`run_preflight` checks, in this order, and raises :class:`PreflightError` (one line: what is wrong
and how to fix it) at the first failure:

1. the harness names (each of a mix) and the sandbox name are registered (``HARNESSES``, ``SANDBOXES``);
2. the sandbox backend's credentials (``E2B_API_KEY`` for ``e2b``, ``HF_TOKEN`` or a token stored by ``hf
   auth login`` for ``hf``: its class's ``capabilities``) are set;
3. the output directory: a fresh run refuses a directory that already holds a checkpoint; ``--resume``
   needs a complete checkpoint there, made from the same ``--model`` (``launch.json``, written by the
   launcher beside the checkpoints) with the same LoRA settings (``trainer_state.json``'s
   ``extra.config``);
4. the engine (:mod:`~harness_trainer.launch.preflight_engine`): reachable; its kind (``auto``: the dev
   engine answers ``GET /weight_version``, vLLM does not); one chat completion with a tool,
   ``logprobs=true, top_logprobs=0, return_token_ids=true, max_tokens=1`` returns what the capture proxy
   records (docs/design.md § Capture proxy): the engine's ``prompt_token_ids``, the sampled ``token_ids``,
   one ``"token_id:N"`` logprob entry per sampled id with a finite logprob ≤ 0; for vLLM also, from its
   dev-mode ``GET /server_info``, that it runs with ``VLLM_SERVER_DEV_MODE=1``, ``--logprobs-mode
   processed_logprobs`` and a ``--weight-transfer-config``;
5. the engine's behaviour, by the probes of :mod:`harness_trainer.launch.probes` (each a
   :class:`~harness_trainer.launch.probes.ProbeError` becomes ``<probe>: <what it saw>``): its logprobs
   are processed (temperature 1 and 2, the top candidates' spread halves), its chat template renders a
   tool call and its result (``/tokenize``, ``/detokenize``, a one-token chat completion of the same
   conversation), and it serves ``--model`` (a ``GET /v1/models`` id or root) with the trainer's tokenizer
   (``/tokenize`` of probe strings against ``AutoTokenizer.from_pretrained(--model)``, local or cached
   only: "skipped" otherwise). ``skip_probes`` (``--skip-probes``) skips them with a warning ("probes
   skipped: ...") that the report records;
6. the room for the weight pushes (given the run's ``trainer_config``): the folder the ``file`` weight
   sync or the LoRA adapter sync writes to (``weight_sync_dir``, else ``/dev/shm`` when writable) has the
   free space they need, sized from the model's safetensors headers
   (:func:`~harness_trainer.trainer.engine_link.check_weight_room`, which the trainer runs too);
7. the rollout server: reachable; ``GET /health``'s ``max_concurrent_envs`` (its ``MAX_CONCURRENT_ENVS``)
   is at least ``max_concurrent_rollouts + 1`` (the session factory keeps one session for metadata) and
   that many sessions are free now; its agents call a model the engine serves (so the engine that takes
   the weights is the one that samples); the split exists and the chosen tasks are in it.

Nothing here opens a rollout session, starts a sandbox or loads a model: only ``GET`` requests, the one
``max_tokens=1`` completion, the probes' ``/tokenize`` and ``/detokenize`` calls and three ``max_tokens=1``
completions (which a scripted dev engine samples rather than handing out its replies), the model's
tokenizer and its safetensors headers.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from harness_trainer.launch.preflight_engine import (
    PreflightError,
    check_engine,
    detect_engine,
    error_text,
    get_or_refuse,
    json_or_empty,
    span,
)
from harness_trainer.launch.probes import ProbeError, run_probes
from harness_trainer.rollouts.harness_mix import HarnessValue, harness_mix

if TYPE_CHECKING:
    from harness_trainer.trainer.config.async_grpo import AsyncGRPOConfig

log = logging.getLogger(__name__)

LAUNCH_FILE = "launch.json"
"""What the launcher writes into the output directory: the ``--model`` and the run's other choices."""
FINGERPRINT_FIELDS = ("use_peft", "lora_r", "lora_alpha", "lora_target_modules")
"""Config fields a checkpoint's weights depend on; the LoRA ones only matter when ``use_peft`` is on."""


@dataclass(frozen=True)
class PreflightOptions:
    """What the run is about to use."""

    engine_url: str
    server_url: str
    model: str
    harness: HarnessValue
    sandbox: str
    output_dir: Path
    engine: str = "auto"
    """``auto``, ``vllm`` or ``dev``."""
    split: str = "train"
    max_concurrent_rollouts: int = 1
    task_indices: list[int] | None = None
    num_tasks: int | None = None
    resume: str | None = None
    """None (a fresh run), ``"latest"``, or a checkpoint folder."""
    fingerprint: dict[str, Any] = field(default_factory=dict)
    """This run's values of ``FINGERPRINT_FIELDS``."""
    timeout_s: float = 60.0
    weight_sync: str = "auto"
    """The run's ``AsyncGRPOConfig.weight_sync``: only the ``nccl`` path needs vLLM's transfer engine."""
    more_servers: tuple[str, ...] = ()
    """Further rollout servers beside ``server_url``: the run's sessions are spread over all of them."""
    trainer_config: AsyncGRPOConfig | None = None
    """The run's trainer config: its weight sync, ``weight_sync_dir``, dtype and LoRA settings size the
    weight pushes that go through a folder; None skips that check (the trainer still runs it)."""
    skip_probes: bool = False
    """``--skip-probes``: the engine's behaviour is not probed (a warning, recorded in the report)."""

    @property
    def server_urls(self) -> list[str]:
        return [url.rstrip("/") for url in (self.server_url, *self.more_servers)]


@dataclass(frozen=True)
class PreflightReport:
    """What the checks found out."""

    engine_kind: str
    served_model: str
    server_capacity: int
    open_sessions: int
    tasks: int
    resume_from: Path | None
    weight_room: str | None = None
    """What the weight-room check found (None: no push goes through a folder, or it was not asked for)."""
    probes: tuple[str, ...] = ()
    """What each probe saw (``probe: ...``), or ``("probes skipped: ...",)``."""

    def summary(self, options: PreflightOptions) -> str:
        resume = f"; resuming from {self.resume_from}" if self.resume_from else ""
        room = f"; {self.weight_room}" if self.weight_room else ""
        probes = f"; {'; '.join(self.probes)}" if self.probes else ""
        return (
            f"preflight ok: {self.engine_kind} engine at {options.engine_url} serves {self.served_model!r}; "
            f"rollout server{'s' if options.more_servers else ''} at {', '.join(options.server_urls)}: "
            f"{self.server_capacity - self.open_sessions} of {self.server_capacity} sessions free, "
            f"{options.max_concurrent_rollouts + 1} needed; "
            f"{self.tasks} task(s) in split {options.split!r}{resume}{probes}{room}"
        )


def run_preflight(options: PreflightOptions) -> PreflightReport:
    """Run every check (module docstring) and report what they found.

    Raises:
        PreflightError: the first check that failed.
    """
    check_names(options.harness, options.sandbox)
    check_credentials(options.sandbox, os.environ)
    resume_from = check_output_dir(options.output_dir, options.resume, options.model, options.fingerprint)
    engine_url = options.engine_url.rstrip("/").removesuffix("/v1")
    with httpx.Client(timeout=options.timeout_s) as client:
        kind = detect_engine(engine_url, options.timeout_s) if options.engine == "auto" else options.engine
        served = check_engine(client, engine_url, kind, weight_sync=options.weight_sync)
        probes = check_probes(options, engine_url, served)
        room = check_weight_room(options, kind)
        needed = options.max_concurrent_rollouts + 1
        if not options.more_servers:
            capacity, open_sessions = check_capacity(client, options.server_url.rstrip("/"), needed, served,
                                                     engine_url)  # fmt: skip
            tasks = check_tasks(client, options.server_url.rstrip("/"), options)
        else:
            capacity, open_sessions, tasks = check_servers(client, options, needed, served, engine_url)
    return PreflightReport(kind, served[0], capacity, open_sessions, tasks, resume_from, room, probes)


PROBES_SKIPPED = (
    "probes skipped: --skip-probes (the engine's logprobs mode, tool-call rendering and model identity "
    "are not checked)"
)


def check_probes(options: PreflightOptions, engine_url: str, served: list[str]) -> tuple[str, ...]:
    """What the engine's behavioural probes saw (:mod:`harness_trainer.launch.probes`), or that they were
    skipped (``skip_probes``: logged as a warning)."""
    if options.skip_probes:
        log.warning(PROBES_SKIPPED)
        return (PROBES_SKIPPED,)
    try:
        verdicts = run_probes(engine_url, options.model, served=served, timeout_s=options.timeout_s)
    except ProbeError as exc:
        raise PreflightError(str(exc)) from exc
    return tuple(str(verdict) for verdict in verdicts)


def check_servers(
    client: httpx.Client, options: PreflightOptions, needed: int, served: list[str], engine_url: str
) -> tuple[int, int, int]:
    """Several rollout servers: each answers as one does (a session free, a model the engine serves, the
    split's tasks), they list as many tasks, and ``needed`` sessions are free over all of them; their
    summed capacity and open sessions, and the task count."""
    limits, opened, counts = [], [], []
    for url in options.server_urls:
        limit, open_sessions = check_capacity(client, url, 0, served, engine_url)  # the sum is checked
        limits.append(limit)
        opened.append(open_sessions)
        counts.append(check_tasks(client, url, options))
    if len(set(counts)) > 1:
        listed = ", ".join(f"{url}: {n}" for url, n in zip(options.server_urls, counts, strict=True))
        raise PreflightError(
            f"the rollout servers list different tasks for split {options.split!r} ({listed})"
        )
    free = sum(limits) - sum(opened)
    if free < needed:
        each = ", ".join(
            f"{url}: {limit - n} of {limit}"
            for url, limit, n in zip(options.server_urls, limits, opened, strict=True)
        )
        raise PreflightError(
            f"the rollout servers have {free} sessions free in all ({each}) but --max-concurrent-rollouts "
            f"{needed - 1} needs {needed} (the session factory keeps one for task metadata): raise their "
            "MAX_CONCURRENT_ENVS, add a server, or lower --max-concurrent-rollouts"
        )
    return sum(limits), sum(opened), counts[0]


def check_names(harness: HarnessValue, sandbox: str) -> None:
    """The harness names (one, or each of a mix) and the sandbox's are registered."""
    from harness_trainer.harnesses import HARNESSES
    from harness_trainer.sandboxes import SANDBOXES

    try:
        names = harness_mix(harness).names
    except ValueError as exc:
        raise PreflightError(str(exc)) from None
    for name in names:
        if name not in HARNESSES:
            raise PreflightError(f"unknown harness {name!r}; known: {', '.join(sorted(HARNESSES))}")
    if sandbox not in SANDBOXES:
        raise PreflightError(f"unknown sandbox {sandbox!r}; known: {', '.join(sorted(SANDBOXES))}")


def check_credentials(sandbox: str, environ: Mapping[str, str]) -> None:
    """The sandbox backend's credentials (its class says which) are set where they are needed, or stored by
    its login (``hf auth login`` for ``hf``), which the line naming what is missing then names too."""
    from harness_trainer.sandboxes import capabilities, missing_credentials

    if missing := missing_credentials(sandbox, environ):
        login = capabilities(sandbox).login
        stored = f" or a login stored by `{login.command}`" if login is not None else ""
        raise PreflightError(
            f"--sandbox {sandbox} needs {' and '.join(missing)} in the environment{stored} (here, and "
            "where `harness-trainer serve` runs)"
        )


def check_output_dir(
    output_dir: Path, resume: str | None, model: str, fingerprint: Mapping[str, Any]
) -> Path | None:
    """The checkpoint to resume from (None for a fresh run), after checking it belongs to this run."""
    from harness_trainer.trainer.checkpoint import STATE_FILE, latest_checkpoint, resolve_resume

    if resume is None:
        found = latest_checkpoint(output_dir)
        if found is not None:
            raise PreflightError(
                f"{output_dir} already holds {found.name}: pass --resume to continue that run, or choose "
                "another --output-dir"
            )
        return None
    try:
        checkpoint = resolve_resume(resume, output_dir)
    except (FileNotFoundError, ValueError) as exc:
        raise PreflightError(f"--resume: {exc}") from exc
    assert checkpoint is not None  # resolve_resume gives None only for resume=None
    record = _read_json(checkpoint.parent / LAUNCH_FILE)
    if record.get("model") not in (None, model):
        raise PreflightError(
            f"{checkpoint} was trained from --model {record['model']!r}, not {model!r}: pass that --model "
            "to resume it, or choose another --output-dir"
        )
    saved = (_read_json(checkpoint / STATE_FILE).get("extra") or {}).get("config") or {}
    compared = FINGERPRINT_FIELDS if fingerprint.get("use_peft") else FINGERPRINT_FIELDS[:1]
    for key in compared:
        if key in saved and key in fingerprint and saved[key] != fingerprint[key]:
            raise PreflightError(
                f"{checkpoint} was trained with {key}={saved[key]!r}, this run asks for "
                f"{key}={fingerprint[key]!r}: its weights do not fit; match it or choose another --output-dir"
            )
    return checkpoint


def check_weight_room(options: PreflightOptions, kind: str) -> str | None:
    """What the trainer's own check (:func:`~harness_trainer.trainer.engine_link.check_weight_room`) finds
    for an engine of ``kind``, sized from ``--model``; None without a ``trainer_config``, or when no push
    goes through a folder."""
    config = options.trainer_config
    if config is None:
        return None
    from harness_trainer.engines.kinds import syncs_adapters
    from harness_trainer.engines.weight_room import NoRoomForWeights
    from harness_trainer.trainer.engine_link import check_weight_room as check_room  # late: loads torch

    adapter_sync = config.use_peft and config.lora_sync == "adapter" and syncs_adapters(kind)
    try:
        return check_room(config, kind, adapter_sync=adapter_sync, model=options.model)
    except NoRoomForWeights as exc:
        raise PreflightError(str(exc)) from exc


def check_capacity(
    client: httpx.Client, server_url: str, needed: int, served: list[str], engine_url: str
) -> tuple[int, int]:
    """The rollout server's capacity and open sessions, after checking ``needed`` sessions are free and
    that its agents call a model the engine serves."""
    reply = get_or_refuse(client, server_url, "/health", "rollout server")
    health = json_or_empty(reply)
    limit, open_sessions = health.get("max_concurrent_envs"), health.get("sessions", 0)
    if reply.status_code != 200 or not isinstance(limit, int) or not isinstance(open_sessions, int):
        raise PreflightError(
            f"rollout server at {server_url} does not report its capacity (GET /health: {reply.status_code}, "
            "no max_concurrent_envs): is it `harness-trainer serve`?"
        )
    if limit < needed:
        raise PreflightError(
            f"rollout server at {server_url} holds at most {limit} sessions (MAX_CONCURRENT_ENVS) but "
            f"--max-concurrent-rollouts {needed - 1} needs {needed} (the session factory keeps one for task "
            f"metadata): serve with MAX_CONCURRENT_ENVS={needed} or more, or lower --max-concurrent-rollouts"
        )
    if limit - open_sessions < needed:
        raise PreflightError(
            f"rollout server at {server_url} already has {open_sessions} of {limit} sessions open (another "
            f"run, or one that died without closing them); this run needs {needed} free: wait, or restart it"
        )
    model = health.get("model")
    if model and model not in served:
        raise PreflightError(
            f"the rollout server's agents call model {model!r}, which the engine at {engine_url} does not "
            f"serve ({', '.join(served)}): start `harness-trainer serve` with --upstream {engine_url}"
        )
    return limit, open_sessions


def check_tasks(client: httpx.Client, server_url: str, options: PreflightOptions) -> int:
    """How many tasks the run will use, after checking the split and the task indices exist."""
    reply = get_or_refuse(client, server_url, f"/splits/{options.split}/tasks", "rollout server")
    if reply.status_code != 200:
        raise PreflightError(f"rollout server at {server_url}: {error_text(reply)}")
    indices = [int(t["index"]) for t in json_or_empty(reply).get("tasks") or []]
    chosen = indices
    if options.task_indices is not None:
        missing = sorted(set(options.task_indices) - set(indices))
        if missing:
            raise PreflightError(
                f"--task-indices {missing} are not in split {options.split!r} (its indices: {span(indices)})"
            )
        chosen = [i for i in indices if i in set(options.task_indices)]
    if options.num_tasks is not None:
        chosen = chosen[: options.num_tasks]
    if not chosen:
        raise PreflightError(f"no task to train on in split {options.split!r} of {server_url}")
    return len(chosen)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}
