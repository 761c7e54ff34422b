"""The Dockerfile subset the local sandbox applies, and nothing more.

:func:`parse` splits a Dockerfile into instructions (``\\`` line continuations joined, comment and blank
lines dropped, even inside a continuation) with the line each starts on. :func:`plan` turns them into a
:class:`BuildPlan` without touching the filesystem:

- ``FROM image [AS name]``: recorded (it names the image E2B builds from); locally the host's tools stand
  in. A second ``FROM`` (multi-stage build) is refused.
- ``ARG NAME[=default]``: a build variable, substituted into later instructions and given to ``RUN``.
- ``ENV K=V [K2=V2 …]`` and ``ENV K V…``: the runtime environment, also substituted and given to ``RUN``.
  ``$VAR``, ``${VAR}``, ``${VAR:-default}`` and ``${VAR:+alt}`` are expanded as Docker does; ``$PATH``
  starts as the sandbox's own ``PATH`` (the host's, standing in for the image's).
- ``WORKDIR path``: relative paths resolve against the previous one; the last one is where commands start.
  Without any ``WORKDIR`` the workspace is ``default_workdir`` (``/app``), not Docker's ``/``.
- ``COPY``/``ADD [--chown=…] [--chmod=…] src… dest`` (and the JSON form): local sources relative to the
  build context (``environment/``); globs allowed; ``--chown`` is ignored (everything belongs to the
  caller); ``ADD`` of a local tar archive is extracted; URLs and ``--from`` are refused.
- ``RUN cmd`` (run as ``/bin/sh -c cmd``) and ``RUN ["exe", "arg"]`` (run without a shell).

Every other instruction (``CMD``, ``ENTRYPOINT``, ``EXPOSE``, ``USER``, ``LABEL``, ``SHELL``,
``HEALTHCHECK``, ``VOLUME``, ``ONBUILD``, ``STOPSIGNAL``, heredocs, ``RUN --mount``…) raises
:class:`DockerfileError` naming the instruction and its line: a task that depends on it would behave
differently here than in its image, so it fails loudly. ``plan(..., strict=False)`` skips them instead
(the E2B backend only needs the final ``WORKDIR``).
"""

from __future__ import annotations

import glob
import json
import os
import posixpath
import re
import shlex
import shutil
import tarfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED = ("FROM", "ARG", "ENV", "WORKDIR", "COPY", "ADD", "RUN")
_VAR = re.compile(r"\\\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::([-+])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


class DockerfileError(ValueError):
    """A Dockerfile the local sandbox cannot apply; the message names the line."""


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case
    args: str
    line: int  # 1-based line the instruction starts on
    end_line: int = 0  # 1-based line it ends on (its last continued line)


@dataclass(frozen=True)
class CopyStep:
    sources: tuple[str, ...]  # relative to the build context
    dest: str  # absolute sandbox path
    dest_is_dir: bool  # dest ends with "/", or several sources / a glob were given
    chmod: int | None
    extract_archives: bool  # ADD
    line: int


@dataclass(frozen=True)
class RunStep:
    command: str  # a shell command line for `bash -lc`
    cwd: str
    env: dict[str, str]  # ARG and ENV values in force at this step
    line: int


@dataclass(frozen=True)
class BuildPlan:
    base_image: str | None
    workdir: str
    env: dict[str, str]  # ENV only: what every later command sees
    steps: tuple[CopyStep | RunStep, ...] = ()
    written_dirs: tuple[str, ...] = ()  # every WORKDIR and COPY destination directory
    args: dict[str, str] = field(default_factory=dict)


def parse(text: str) -> list[Instruction]:
    """Split ``text`` into instructions (continuations joined, comments and blank lines dropped)."""
    instructions: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue  # Docker drops these even in the middle of a continuation
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(raw.rstrip()[:-1])
            continue
        pending.append(raw)
        instructions.append(_instruction("".join(pending), start, number))
        pending = []
    if pending:
        instructions.append(_instruction("".join(pending), start, number))
    return instructions


def _instruction(logical: str, line: int, end_line: int) -> Instruction:
    keyword, _, args = logical.strip().partition(" ")
    return Instruction(keyword=keyword.upper(), args=args.strip(), line=line, end_line=end_line)


def expand(value: str, variables: Mapping[str, str]) -> str:
    """Docker-style variable substitution; unknown variables expand to ``""``; ``\\$`` is a literal ``$``."""

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "\\$":
            return "$"
        name = match.group(1) or match.group(4)
        current = variables.get(name, "")
        if match.group(2) == "-":
            return current or match.group(3)
        if match.group(2) == "+":
            return match.group(3) if current else ""
        return current

    return _VAR.sub(substitute, value)


@dataclass
class _State:
    base_env: dict[str, str]
    context: Path | None = None
    workdir: str | None = None
    image: str | None = None
    args: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    steps: list[CopyStep | RunStep] = field(default_factory=list)
    written: list[str] = field(default_factory=list)

    def variables(self) -> dict[str, str]:
        return {**self.base_env, **self.args, **self.env}

    def cwd(self, default: str) -> str:
        return self.workdir or default


def plan(
    instructions: list[Instruction],
    *,
    base_env: Mapping[str, str],
    default_workdir: str = "/app",
    strict: bool = True,
    context: Path | None = None,
) -> BuildPlan:
    """What applying ``instructions`` means, step by step; raises :class:`DockerfileError`.

    ``context`` (the build context) is only looked at to tell directory sources of COPY from files.
    """
    state = _State(base_env=dict(base_env), context=context)
    for ins in instructions:
        handler = _HANDLERS.get(ins.keyword)
        if ins.args.startswith("<<"):
            handler = None  # heredocs
        if handler is None:
            if strict:
                raise DockerfileError(
                    f"line {ins.line}: {ins.keyword} is not supported by the local sandbox "
                    f"(it applies only {', '.join(SUPPORTED)}; heredocs and build flags are refused too)"
                )
            continue
        handler(state, ins, default_workdir)
    workdir = state.cwd(default_workdir)
    written = [default_workdir] if state.workdir is None else []
    return BuildPlan(
        base_image=state.image,
        workdir=workdir,
        env=dict(state.env),
        steps=tuple(state.steps),
        written_dirs=tuple(dict.fromkeys([*written, *state.written])),
        args=dict(state.args),
    )


def _from(state: _State, ins: Instruction, default_workdir: str) -> None:
    if state.image is not None:
        raise DockerfileError(f"line {ins.line}: a second FROM (multi-stage build) is not supported")
    words = [w for w in ins.args.split() if not w.startswith("--platform")]
    if not words:
        raise DockerfileError(f"line {ins.line}: FROM needs an image")
    state.image = expand(words[0], state.args)


def _arg(state: _State, ins: Instruction, default_workdir: str) -> None:
    for word in _split(ins):
        name, has_default, default = word.partition("=")
        if has_default:
            state.args[name] = expand(default, state.variables())
        else:
            state.args.setdefault(name, "")


def _env(state: _State, ins: Instruction, default_workdir: str) -> None:
    variables = state.variables()  # every value in one ENV sees the values from before it
    first, _, rest = ins.args.partition(" ")
    if "=" in first:
        pairs = [word.partition("=") for word in _split(ins)]
        updates = {key: expand(value, variables) for key, _, value in pairs}
    elif rest.strip():
        updates = {first: expand(" ".join(_split(Instruction("ENV", rest, ins.line))), variables)}
    else:
        updates = {}
    if not updates or not all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", key) for key in updates):
        raise DockerfileError(f"line {ins.line}: ENV needs KEY=VALUE pairs or KEY VALUE, got {ins.args!r}")
    state.env.update(updates)


def _workdir(state: _State, ins: Instruction, default_workdir: str) -> None:
    path = expand(ins.args.strip().strip('"'), state.variables())
    if not path:
        raise DockerfileError(f"line {ins.line}: WORKDIR needs a path")
    state.workdir = posixpath.normpath(posixpath.join(state.cwd("/"), path))
    state.written.append(state.workdir)


def _copy(state: _State, ins: Instruction, default_workdir: str) -> None:
    words = _json_list(ins) if ins.args.lstrip().startswith("[") else _split(ins)
    chmod = _copy_flags(words, ins)
    if len(words) < 2:
        raise DockerfileError(f"line {ins.line}: {ins.keyword} needs at least one source and a destination")
    variables = state.variables()
    sources = tuple(expand(w, variables) for w in words[:-1])
    if any(re.match(r"^[a-z]+://|^git@", s) for s in sources):
        raise DockerfileError(f"line {ins.line}: {ins.keyword} from a URL is not supported locally")
    raw_dest = expand(words[-1], variables)
    dest = posixpath.normpath(posixpath.join(state.cwd(default_workdir), raw_dest))
    is_dir = raw_dest.endswith("/") or len(sources) > 1 or any(glob.has_magic(s) for s in sources)
    is_dir = is_dir or all(_is_dir_source(source, state.context) for source in sources)
    add = ins.keyword == "ADD"
    state.steps.append(CopyStep(sources, dest, is_dir, chmod, add, ins.line))
    state.written.append(dest if is_dir else posixpath.dirname(dest))


def _is_dir_source(source: str, context: Path | None) -> bool:
    if source.endswith("/") or source in (".", "./"):
        return True
    return context is not None and not glob.has_magic(source) and (context / source).is_dir()


def _copy_flags(words: list[str], ins: Instruction) -> int | None:
    """Pops the leading ``--flag=value`` words; returns the ``--chmod`` mode (``--chown`` is ignored)."""
    chmod = None
    while words and words[0].startswith("--"):
        flag, _, value = words.pop(0).partition("=")
        if flag == "--chmod":
            try:
                chmod = int(value, 8)
            except ValueError:
                raise DockerfileError(f"line {ins.line}: --chmod wants an octal mode: {value!r}") from None
        elif flag not in ("--chown", "--link"):
            raise DockerfileError(f"line {ins.line}: {ins.keyword} {flag} is not supported locally")
    return chmod


def _run(state: _State, ins: Instruction, default_workdir: str) -> None:
    if ins.args.startswith("--"):
        raise DockerfileError(f"line {ins.line}: RUN flags ({ins.args.split()[0]}) are not supported")
    if ins.args.lstrip().startswith("["):
        command = shlex.join(_json_list(ins))
    else:
        command = "/bin/sh -c " + shlex.quote(ins.args)
    env = {**state.args, **state.env}
    state.steps.append(RunStep(command, state.cwd(default_workdir), env, ins.line))


_HANDLERS: dict[str, Callable[[_State, Instruction, str], None]] = {
    "FROM": _from,
    "ARG": _arg,
    "ENV": _env,
    "WORKDIR": _workdir,
    "COPY": _copy,
    "ADD": _copy,
    "RUN": _run,
}


def _split(ins: Instruction) -> list[str]:
    try:
        return shlex.split(ins.args)
    except ValueError as exc:
        raise DockerfileError(f"line {ins.line}: cannot parse {ins.keyword} arguments: {exc}") from None


def _json_list(ins: Instruction) -> list[str]:
    try:
        words = json.loads(ins.args)
    except json.JSONDecodeError as exc:
        raise DockerfileError(f"line {ins.line}: {ins.keyword} has broken JSON: {exc}") from None
    if not isinstance(words, list) or not words or not all(isinstance(w, str) for w in words):
        raise DockerfileError(f"line {ins.line}: {ins.keyword} JSON form must be a list of strings")
    return words


def copy_into(step: CopyStep, context: Path, host_path: Callable[[str], Path]) -> None:
    """Apply one COPY/ADD: sources from ``context``, destination mapped to the host by ``host_path``."""
    root = context.resolve()
    dest = host_path(step.dest)
    matched: list[Path] = []
    for source in step.sources:
        found = sorted(glob.glob(source, root_dir=root)) if glob.has_magic(source) else [source]
        for name in found:
            path = (root / name).resolve()
            if path != root and root not in path.parents:
                raise DockerfileError(f"line {step.line}: {source!r} is outside the build context")
            if not path.exists():
                raise DockerfileError(f"line {step.line}: {source!r} does not exist in {context}")
            matched.append(path)
    if not matched:
        raise DockerfileError(f"line {step.line}: no file matches {list(step.sources)} in {context}")
    for path in matched:
        _copy_one(path, dest, step)


def _copy_one(path: Path, dest: Path, step: CopyStep) -> None:
    if path.is_dir():
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copytree(path, dest, dirs_exist_ok=True, symlinks=True)
        _chmod_tree(dest, step.chmod)
        return
    if step.extract_archives and tarfile.is_tarfile(path):
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(path) as archive:
            archive.extractall(dest, filter="data")
        return
    target = dest / path.name if step.dest_is_dir or dest.is_dir() else dest
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(path, target)
    if step.chmod is not None:
        os.chmod(target, step.chmod)


def _chmod_tree(top: Path, mode: int | None) -> None:
    if mode is None:
        return
    for directory, dirs, files in os.walk(top):
        for name in [*dirs, *files]:
            os.chmod(os.path.join(directory, name), mode)
