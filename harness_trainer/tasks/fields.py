"""What of a Harbor task this project runs, refuses or ignores, and why: never silently.

Harbor's ``task.toml`` (and the task folder) can ask for more than a rollout here does. Each such request
is one of:

- **refused** (:func:`refusals`; the loader raises :class:`~harness_trainer.tasks.task.TaskError` naming
  the field): what no sandbox backend here can run, so a rollout would measure something else than the
  task means: an OS other than Linux, GPUs or TPUs, MCP servers given to the agent (what of a
  ``docker-compose.yaml`` runs and what is refused: :mod:`.compose`; a verifier's mode:
  :mod:`.verifier_mode`);
- **ignored with a reason** (:func:`ignored`; the loader logs each field once per process, naming the first
  task that sets it): what changes nothing a rollout measures, or what a rollout here does its own way:
  the users agents and verifiers run as, the reference solution's environment, the GPU types of a task that
  asks for no GPU, skills folders, health checks, keys of ``[environment]`` nobody here knows, the
  ``artifacts`` of a task whose verifier shares the agent's sandbox (nothing is copied out of it).

Everything else of the schema is honoured where it is read (:mod:`.loader`; the backends document how
they apply ``cpus``, ``memory_mb``, ``storage_mb``, ``allow_internet`` and ``workdir``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

IGNORED_ENVIRONMENT = {
    "gpu_types": "no task asking for no GPU needs a GPU type",
    "skills_dir": "agents get no skills folder here (their prompts are the harness's)",
    "healthcheck": "sandboxes here are ready when started; nothing is polled",
    "os": "",  # "linux" is what every sandbox here runs; anything else is refused
}


def refusals(config: dict[str, Any], folder: Path) -> list[str]:
    """Why the task at ``folder`` (its parsed ``config``) cannot run here, one line per field; empty when
    it can."""
    found = []
    environment = config.get("environment") if isinstance(config.get("environment"), dict) else {}
    system = environment.get("os")
    if system not in (None, "linux"):
        found.append(f"[environment] os = {system!r}: only Linux sandboxes are run here")
    if environment.get("gpus") or environment.get("tpu"):
        found.append("[environment] gpus / tpu: sandboxes here have no accelerator")
    if environment.get("mcp_servers"):
        found.append("[environment] mcp_servers: agents are given no MCP servers here")
    return found


def ignored(config: dict[str, Any], known_environment: frozenset[str]) -> dict[str, str]:
    """The fields of ``config`` a rollout here ignores, each with the reason (see the module docstring)."""
    found: dict[str, str] = {}
    steps = config.get("steps") if isinstance(config.get("steps"), list) else []
    for section, reason in (
        ("agent", "the agent runs as the sandbox image's user"),
        ("verifier", "the verifier runs as the sandbox image's user"),
    ):
        tables = [config.get(section)] + [s.get(section) for s in steps if isinstance(s, dict)]
        if any(isinstance(table, dict) and "user" in table for table in tables):
            found[f"[{section}] user"] = reason
    if config.get("solution"):
        found["[solution]"] = "reference solutions are not run in rollouts"
    verifiers = [config.get("verifier")] + [s.get("verifier") for s in steps if isinstance(s, dict)]
    separate = [v for v in verifiers if isinstance(v, dict) and (v.get("environment_mode") == "separate"
                                                                 or "environment" in v)]  # fmt: skip
    if config.get("artifacts") and not separate:
        found["artifacts"] = "copied only into a separate verifier's sandbox; every verifier here is shared"
    environment = config.get("environment") if isinstance(config.get("environment"), dict) else {}
    for key in environment:
        if key in known_environment or key in ("gpus", "tpu", "mcp_servers"):
            continue
        reason = IGNORED_ENVIRONMENT.get(key, "not a key this project knows")
        if reason:
            found[f"[environment] {key}"] = reason
    return found
