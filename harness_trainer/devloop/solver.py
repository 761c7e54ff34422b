"""Scripted solver transcripts: what a model that knows the toy tasks would write, in each harness's format.

Each task's reference ``solution/solve.sh`` becomes one shell command (its comments, shebang and ``set``
line dropped); the transcript is that command as the harness's own shell tool call, then the harness's way
of finishing (for an agent without tool calls, aider: one text reply with the command in a fenced block),
both as its class's :class:`~harness_trainer.harnesses.base.Dialect` says (in white-box mode,
the sandbox's ``bash`` tool, then its ``submit`` tool). Served by the dev
engine in scripted mode, these make a real agent solve the task, and the capture proxy records them as the
agent's own token ids (in white-box mode, the trainer's own model step does): warm-up data in exactly the
format the agent sends and parses. A distractor transcript is the same with a harmless command that solves
nothing (:data:`DISTRACTOR`): the wrong way to act, for a warm model that must learn which way the verifier
rewards.
"""

from __future__ import annotations

import shlex
from typing import Any

from harness_trainer.harnesses import HARNESSES
from harness_trainer.tasks.task import HarborTask

DISTRACTOR = "ls -la"
WHITE_BOX = "white-box"
"""The white-box mode's transcript format: the built-in ``ReActAdapter`` over the sandbox's tools."""
SCRIPTED_HARNESSES = tuple(sorted(name for name, harness in HARNESSES.items() if harness.dialect is not None))
"""The harnesses whose class says how a scripted model drives them: the ones the dev loop can warm up."""
FINISHED = {"content": "Done."}
"""The finishing reply to an agent that has no submit command: an answer without a tool call."""


def solve_command(task: HarborTask) -> str:
    """The task's reference solution as one shell command."""
    script = task.path / "solution" / "solve.sh"
    if not script.is_file():
        raise ValueError(f"task {task.name} has no solution/solve.sh to learn from")
    lines = [
        line
        for line in script.read_text().splitlines()
        if line.strip() and not line.startswith("#") and not line.startswith("set ")
    ]
    return "\n".join(lines)


def _bash(**arguments: Any) -> dict[str, Any]:
    return _call("bash", **arguments)


def _call(name: str, **arguments: Any) -> dict[str, Any]:
    return {
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}],
    }


def solver_replies(harness: str, task: HarborTask) -> list[dict[str, Any]]:
    """The scripted replies that solve ``task`` through ``harness`` (one tool call, then finish)."""
    return command_replies(harness, solve_command(task))


def distractor_replies(harness: str) -> list[dict[str, Any]]:
    """The scripted replies of the wrong way: :data:`DISTRACTOR` as the tool call, then finish."""
    return command_replies(harness, DISTRACTOR)


def one_line(command: str) -> str:
    """``command`` as one ``sh`` line (an agent that runs each line of a fenced block on its own, aider,
    would break a here-document or a loop): ``bash -c`` of its lines, each quoted, printed back."""
    lines = command.splitlines()
    if len(lines) < 2:
        return command
    return f"bash -c \"$(printf '%s\\n' {' '.join(shlex.quote(line) for line in lines)})\""


def command_replies(harness: str, command: str) -> list[dict[str, Any]]:
    """``command`` as ``harness``'s shell tool call, then the harness's way of finishing."""
    if harness == WHITE_BOX:  # the sandbox's bash tool, then its submit tool
        return [_bash(command=command), _call("submit")]
    dialect = HARNESSES[harness].dialect if harness in HARNESSES else None
    if dialect is None:
        raise ValueError(
            f"no solver transcript format for harness {harness!r} (known: {', '.join(SCRIPTED_HARNESSES)}, "
            f"{WHITE_BOX})"
        )

    if dialect.shell_fence is not None:  # no tool calls: the command as a fenced block of a text reply
        return [{"content": f"```{dialect.shell_fence}\n{one_line(command)}\n```"}]

    def shell(line: str) -> dict[str, Any]:
        return _call(dialect.shell_tool, **{dialect.command_key: line, **dict(dialect.bash_arguments)})

    submit = dialect.submit_command
    return [shell(command), dict(FINISHED) if submit is None else shell(submit)]
