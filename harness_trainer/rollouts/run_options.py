"""What a run's rollouts are: which tasks, which agent, where it runs, for how long, scored how.

:class:`RunOptions` is the one home of these knobs. ``harness-trainer train``, ``dev`` and ``eval`` (and
a Jobs run, through the ``run`` section it carries) generate their flags and their config file's keys
from its fields (:func:`~harness_trainer.launch.dataclass_flags.add_dataclass_arguments`), each command
with its own defaults where it has a reason to differ; the session factories take theirs from
:data:`DEFAULT_RUN`.

The agent's timeout has one name and one meaning, OpenEnv's ``agent_timeout_sec``: the seconds the agent
may run, enforced where the agent runs. The trainer's own wait on a rollout (``AsyncGRPOConfig``'s
``rollout_timeout``) is derived from it (:attr:`RunOptions.rollout_wait_s`): it also covers the sandbox's
start, the agent's install and the verifier, and is only a backstop for a server that stopped answering.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from harness_trainer.rollouts.harness_mix import HarnessMix, HarnessValue, harness_mix, parse_harness_text

MODES = ("black-box", "white-box")
"""black-box: the agent owns its loop behind the capture proxy; white-box: the trainer samples each turn."""
WAIT_MARGIN_S = 600.0
"""Added to ``agent_timeout_sec`` for the trainer's wait on a rollout (:attr:`RunOptions.rollout_wait_s`)."""


def _help(text: str) -> dict[str, Any]:
    return {"help": text}


def _count(text: str) -> int:
    """``--num-tasks``' text: a whole number ≥ 1."""
    value = int(text)
    if value < 1:
        raise ValueError(f"must be at least 1, got {value}")
    return value


def _index(text: str) -> int:
    """One of ``--task-indices``: a whole number ≥ 0."""
    value = int(text)
    if value < 0:
        raise ValueError(f"a task index is ≥ 0, got {value}")
    return value


@dataclass(frozen=True)
class RunOptions:
    """The rollout side of a run; every field is a flag (``--agent-timeout-sec``) and a key of the
    command's config section (``agent_timeout_sec``). Checked on construction.

    Raises:
        ValueError: an unknown mode, or a bound out of range (every problem listed).
    """

    split: str = field(default="train", metadata=_help("the task split to run"))
    harness: HarnessValue = field(
        default="opencode",
        metadata={
            **_help(
                "the agent (black-box mode): a registered harness, or several, each GRPO group using one: "
                "a,b (round-robin over groups) or a=2,b=1 (weighted); a list or a mapping in a config file"
            ),
            "flag": {"type": parse_harness_text, "config_value": lambda value: harness_mix(value).value()},
        },
    )
    mode: str = field(
        default="black-box",
        metadata=_help(
            "black-box: the agent (--harness) owns its loop behind the capture proxy; white-box: the trainer "
            "samples every turn and the built-in ReActAdapter runs the session's tools (--harness does not "
            "apply; --agent-step-limit bounds its turns, --agent-timeout-sec its episode)"
        ),
    )
    sandbox: str = field(default="e2b", metadata=_help("where agents run: a sandbox backend"))
    agent_timeout_sec: float = field(
        default=600.0,
        metadata=_help(
            f"seconds the agent may run (the trainer waits this plus {WAIT_MARGIN_S:g} s for the sandbox, "
            "the install and the verifier)"
        ),
    )
    agent_step_limit: int = field(
        default=30, metadata=_help("agent steps (white-box: the adapter's turns); 0: the harness's default")
    )
    reward_key: str = field(default="", metadata=_help("named score of reward.json to train on"))
    harness_options: dict[str, Any] = field(
        default_factory=dict, metadata=_help("the harness's own options, a JSON object")
    )
    num_tasks: int | None = field(
        default=None, metadata={**_help("use the split's first N tasks"), "flag": {"type": _count}}
    )
    task_indices: list[int] | None = field(
        default=None, metadata={**_help("use these task indices (comma-separated)"), "flag": {"item": _index}}
    )

    def __post_init__(self) -> None:
        problems = list(run_options_problems(self))
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def harness_mix(self) -> HarnessMix:
        """The run's harnesses and how groups are dealt to them."""
        return harness_mix(self.harness)

    @property
    def white_box(self) -> bool:
        return self.mode == "white-box"

    @property
    def rollout_wait_s(self) -> float:
        """The trainer's wait on one rollout: the agent's timeout plus :data:`WAIT_MARGIN_S`."""
        return self.agent_timeout_sec + WAIT_MARGIN_S

    def to_dict(self) -> dict[str, Any]:
        """The fields by name, as a config file's section holds them."""
        return dataclasses.asdict(self)


def run_options_problems(options: RunOptions) -> list[str]:
    """What is wrong with ``options``, each naming its field. The harness's and the sandbox's names are
    the registries' to check, where a run resolves them (preflight, and each factory's first session):
    the rollout client, where this lives, imports neither registry."""
    problems = []
    if options.mode not in MODES:
        problems.append(f"mode must be one of {', '.join(MODES)}, got {options.mode!r}")
    if not options.agent_timeout_sec > 0:
        problems.append(f"agent_timeout_sec must be positive, got {options.agent_timeout_sec!r}")
    if options.agent_step_limit < 0:
        problems.append(
            f"agent_step_limit must be ≥ 0 (0: the harness's default), got {options.agent_step_limit}"
        )
    if options.num_tasks is not None and options.num_tasks < 1:
        problems.append(f"num_tasks must be at least 1, got {options.num_tasks}")
    if options.task_indices is not None and (not options.task_indices or min(options.task_indices) < 0):
        problems.append(f"task_indices must be task indices ≥ 0, got {options.task_indices!r}")
    if not isinstance(options.harness_options, dict):
        problems.append(f"harness_options must be a mapping, got {options.harness_options!r}")
    try:
        mix = harness_mix(options.harness)
    except ValueError as exc:
        problems.append(str(exc))
    else:
        if isinstance(options.harness_options, dict):
            problems.extend(mix.options_problems(options.harness_options))
    return problems


DEFAULT_RUN = RunOptions()
"""The defaults every command and factory starts from."""
CHOICES: dict[str, tuple[str, ...]] = {"mode": MODES}
"""The values a flag of these fields takes (a command may narrow others: the dev loop its harnesses)."""
