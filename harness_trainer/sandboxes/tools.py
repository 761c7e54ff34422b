"""The sandbox as tools: what a white-box rollout session offers the model (issue 23).

:class:`SandboxTools` wraps any :class:`~harness_trainer.sandboxes.base.Sandbox` (local, Docker, E2B) and
offers five MCP-shaped tools, listed as OpenEnv ``Tool`` s with JSON-schema inputs and answered with
OpenEnv ``ToolResult`` s:

    bash        run a command in a fresh ``bash -lc`` in the workdir, with a timeout (capped)
    read_file   a file's text
    write_file  create or overwrite a file (parent directories too)
    list_dir    a directory's entries, directories marked with a trailing ``/``
    submit      end the episode (``ToolResult.done``), with an optional summary

Paths are the sandbox's: ``~`` is its ``home``, relative paths are relative to its ``workdir``
(:func:`~harness_trainer.sandboxes.base.resolve_path`); results name the absolute path.

What ``call_tool`` returns and what it raises:

1. The model's mistakes come back as error results, never as exceptions: an unknown tool, arguments that
   break the tool's schema (checked with ``jsonschema``, which the ``openenv`` extra brings), a missing
   or unreadable file, a directory that cannot be listed, a path the backend refuses (the local sandbox's
   file methods refuse paths outside its private directories; bash still reaches them), a command killed
   at its timeout (its process group is killed by the sandbox's own ``exec`` timeout, the partial output
   is kept, and the next call works).
2. An error result has ``error`` set to the reason and ``data`` set to the text the model reads (OpenEnv's
   MCP loop shows the model ``data`` only); it counts as a failed call of that tool.
3. A command that exits non-zero is **not** a failed tool call: the tool did its job, and the exit code
   is in the text (``[exit code: N]``), as a terminal would show it. Agents run failing commands on
   purpose (tests before a fix, ``grep`` with no match).
4. A dead or closed sandbox raises :class:`~harness_trainer.sandboxes.base.SandboxError`: the rollout is
   unscorable, not the model's fault, and every later call would fail the same way. ``exec`` raising
   means exactly that; a file method's failure (a missing file, a refused path, a closed sandbox whose
   files are gone) is told apart by asking the sandbox to run ``true`` (one more ``exec``, on failures
   only); a file method that does not fail on a closed sandbox goes unnoticed until the next ``exec``.
   Cancellation propagates (a cancelled ``exec`` kills its command); a bug propagates too.

Output longer than ``ToolLimits.max_output_chars`` keeps that many characters, half from its start and
half from its end, with a marker between them saying how many were cut: a command's start says what ran,
its end carries the verdict (a traceback, a test summary, a compiler error).

Counters (:attr:`SandboxTools.calls`, :attr:`SandboxTools.failures`, :meth:`SandboxTools.metrics`) feed
``tools/call_frequency`` and ``tools/failure_frequency``; a call that raises is counted as a call only.
OpenEnv's ``ResourceSession`` is synchronous: :class:`SyncSandboxTools` answers its ``list_tools`` /
``call_tool`` from another thread by running the async tools on the sandbox's event loop.
"""

from __future__ import annotations

import asyncio
import math
import shlex
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import jsonschema
from jsonschema.exceptions import best_match

from harness_trainer.sandboxes.base import Sandbox, SandboxError, resolve_path

try:
    from openenv.core.env_server.mcp_types import Tool
    from openenv.core.harness import ToolResult
except ImportError as exc:  # an optional extra: only white-box sessions need it
    raise ImportError(
        "harness_trainer.sandboxes.tools needs the `openenv` extra: pip install 'harness-trainer[openenv]'"
    ) from exc


@dataclass(frozen=True)
class ToolLimits:
    """How far the tools go; checked on construction (a bad value raises ValueError)."""

    default_timeout_s: float = 60.0
    """A ``bash`` call's timeout when the model gives none; ``list_dir`` and the liveness probe use it."""
    max_timeout_s: float = 600.0
    """The largest ``timeout`` a ``bash`` call may ask for (its schema's ``maximum``)."""
    max_output_chars: int = 10_000
    """Characters of a result's output kept (head and tail); mini-swe-agent's 10k is the model here."""

    def __post_init__(self) -> None:
        for name in ("default_timeout_s", "max_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
                raise ValueError(
                    f"ToolLimits.{name} must be a positive, finite number of seconds, got {value!r}"
                )
        if self.default_timeout_s > self.max_timeout_s:
            raise ValueError(
                f"ToolLimits.default_timeout_s ({self.default_timeout_s}) exceeds max_timeout_s "
                f"({self.max_timeout_s})"
            )
        if type(self.max_output_chars) is not int or self.max_output_chars < 1:
            raise ValueError(
                f"ToolLimits.max_output_chars must be a positive int, got {self.max_output_chars!r}"
            )


def truncate(text: str, max_chars: int) -> tuple[str, int]:
    """``text`` cut to its first and last ``max_chars / 2`` characters with a marker between them saying
    how many were cut; returns the text and that count (0 when it fits)."""
    cut = len(text) - max_chars
    if cut <= 0:
        return text, 0
    head = max_chars // 2
    tail = max_chars - head
    return f"{text[:head]}\n[... {cut} characters cut ...]\n{text[-tail:]}", cut


def _ok(text: str, **metadata: Any) -> ToolResult:
    return ToolResult(data=text, metadata=metadata)


def _error(reason: str, *, output: str = "", **metadata: Any) -> ToolResult:
    """An error result: ``error`` is the reason; ``data``, what the model reads, ends with it."""
    prefix = f"{output}\n" if output and not output.endswith("\n") else output
    return ToolResult(data=f"{prefix}Error: {reason}", error=reason, metadata=metadata)


Handler = Callable[[dict[str, Any]], Awaitable[ToolResult]]


class SandboxTools:
    """The tools of one rollout's sandbox; see the module docstring for the contract.

    ``calls`` and ``failures`` count calls per tool name (an unknown name under its own name);
    ``submitted`` and ``summary`` say whether and how the model ended the episode.
    """

    def __init__(self, sandbox: Sandbox, limits: ToolLimits | None = None) -> None:
        self.sandbox = sandbox
        self.limits = limits or ToolLimits()
        self.calls: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        self.submitted = False
        self.summary: str | None = None
        handlers: dict[str, Handler] = {
            "bash": self._bash,
            "read_file": self._read_file,
            "write_file": self._write_file,
            "list_dir": self._list_dir,
            "submit": self._submit,
        }
        specs = _tool_specs(sandbox.workdir, self.limits)
        self._tools = [specs[name] for name in handlers]
        self._handlers = handlers
        self._validators = {
            name: jsonschema.Draft202012Validator(specs[name].input_schema) for name in handlers
        }

    def list_tools(self) -> list[Tool]:
        """The tool manifest, in a fixed order (bash, read_file, write_file, list_dir, submit)."""
        return [tool.model_copy(deep=True) for tool in self._tools]

    async def call_tool(self, name: str, arguments: Any) -> ToolResult:
        """Run tool ``name``; the model's mistakes come back as error results. Raises SandboxError when
        the sandbox is dead or closed (module docstring, rule 4)."""
        self.calls[name] += 1
        result = await self._dispatch(name, arguments)
        if result.error is not None:
            self.failures[name] += 1
        return result

    def metrics(self) -> dict[str, Any]:
        """The counts as a rollout's ``VerifyResult.metrics`` carries them (what
        :mod:`~harness_trainer.trainer.step.outcome` reads for ``tools/*``), plus per-tool failures."""
        return {
            "tool_calls_by_name": dict(self.calls),
            "tool_failures_by_name": dict(self.failures),
            "tool_failure_count": sum(self.failures.values()),
        }

    async def _dispatch(self, name: str, arguments: Any) -> ToolResult:
        handler = self._handlers.get(name)
        if handler is None:
            names = ", ".join(self._handlers)
            return _error(f"unknown tool {name!r}; the tools are: {names}")
        error = best_match(self._validators[name].iter_errors(arguments))
        if error is not None:
            where = "/".join(str(part) for part in error.absolute_path)
            return _error(f"invalid arguments for {name}{f' at {where}' if where else ''}: {error.message}")
        return await handler(arguments)

    def _path(self, path: str) -> str:
        return resolve_path(path, workdir=self.sandbox.workdir, home=self.sandbox.home)

    async def _bash(self, arguments: dict[str, Any]) -> ToolResult:
        timeout = arguments.get("timeout", self.limits.default_timeout_s)
        if not math.isfinite(timeout):  # NaN passes the schema's bounds (every comparison is false)
            return _error(f"invalid arguments for bash: timeout must be a finite number, got {timeout!r}")
        result = await self.sandbox.exec(arguments["command"], timeout_s=timeout)
        body = result.stdout
        if result.stderr:
            body += ("" if not body or body.endswith("\n") else "\n") + "[stderr]\n" + result.stderr
        text, cut = truncate(body, self.limits.max_output_chars)
        metadata = {"exit_code": result.exit_code, "timed_out": result.timed_out, "cut_chars": cut}
        if result.timed_out:
            return _error(
                f"the command ran past its {timeout:g} s timeout and was killed", output=text, **metadata
            )
        separator = "" if not text or text.endswith("\n") else "\n"
        return _ok(f"{text}{separator}[exit code: {result.exit_code}]", **metadata)

    async def _read_file(self, arguments: dict[str, Any]) -> ToolResult:
        target = self._path(arguments["path"])
        try:
            data = await self.sandbox.read_file(target)
        except OSError as exc:
            return await self._file_error(_os_reason("read", target, exc))
        except SandboxError as exc:
            return await self._file_error(str(exc))
        if b"\0" in data:  # NULs would reach the model's context as control characters
            return _error(f"{target} is a binary file ({len(data)} bytes); inspect it with bash (xxd, file)")
        text, cut = truncate(data.decode("utf-8", errors="replace"), self.limits.max_output_chars)
        return _ok(text, path=target, cut_chars=cut)

    async def _write_file(self, arguments: dict[str, Any]) -> ToolResult:
        target = self._path(arguments["path"])
        payload = arguments["content"].encode()
        try:
            await self.sandbox.write_file(target, payload)
        except OSError as exc:
            return await self._file_error(_os_reason("write", target, exc))
        except SandboxError as exc:
            return await self._file_error(str(exc))
        return _ok(f"Wrote {len(payload)} bytes to {target}.", path=target)

    async def _list_dir(self, arguments: dict[str, Any]) -> ToolResult:
        target = self._path(arguments.get("path", "."))
        # The protocol has no listing method; ls runs the same in every backend.
        result = await self.sandbox.exec(
            f"ls -1Ap -- {shlex.quote(target)}", timeout_s=self.limits.default_timeout_s
        )
        if result.timed_out:
            return _error(f"listing {target} ran past {self.limits.default_timeout_s:g} s")
        if result.exit_code != 0:
            return _error(result.stderr.strip() or f"cannot list {target} (exit code {result.exit_code})")
        text, cut = truncate(result.stdout, self.limits.max_output_chars)
        return _ok(text or f"{target} is empty.", path=target, cut_chars=cut)

    async def _submit(self, arguments: dict[str, Any]) -> ToolResult:
        self.submitted = True
        self.summary = arguments.get("summary")
        return ToolResult(data="Submitted; the episode ends.", done=True, metadata={"summary": self.summary})

    async def _file_error(self, reason: str) -> ToolResult:
        """A file method failed: an error result while the sandbox still runs commands (the model's mistake),
        else the sandbox is gone and that raises (``exec``'s own SandboxError, or one saying so)."""
        probe = await self.sandbox.exec("true", timeout_s=self.limits.default_timeout_s)
        if probe.exit_code != 0:
            raise SandboxError(f"sandbox {self.sandbox.id} no longer runs commands (after: {reason})")
        return _error(reason)


def _os_reason(verb: str, target: str, exc: OSError) -> str:
    """The reason without the backend's own paths (a local sandbox's host path would confuse the model)."""
    if isinstance(exc, FileNotFoundError):
        return f"no such file: {target}"
    if isinstance(exc, IsADirectoryError):
        return f"{target} is a directory; list it with list_dir"
    return f"cannot {verb} {target}: {exc.strerror or type(exc).__name__}"


def _tool_specs(workdir: str, limits: ToolLimits) -> dict[str, Tool]:
    def spec(name: str, description: str, properties: dict[str, Any], required: list[str]) -> Tool:
        schema = {
            "type": "object",
            "properties": properties,
            "required": required,
            "additionalProperties": False,
        }
        return Tool(name=name, description=description, input_schema=schema)

    path_help = f"Absolute, or relative to {workdir}; ~ is the home directory."
    path = {"type": "string", "minLength": 1, "description": path_help}
    cap = limits.max_output_chars
    return {
        "bash": spec(
            "bash",
            f"Run a bash command (bash -lc) in {workdir} and return its stdout, stderr and exit code. Each "
            "call is a fresh shell: cd and exported variables do not carry over. A command still running at "
            f"its timeout is killed. Output beyond {cap} characters is cut in the middle.",
            {
                "command": {"type": "string", "description": "The command line."},
                "timeout": {
                    "type": "number",
                    "exclusiveMinimum": 0,
                    "maximum": limits.max_timeout_s,
                    "description": "Seconds before the command is killed "
                    f"(default {limits.default_timeout_s:g}, at most {limits.max_timeout_s:g}).",
                },
            },
            ["command"],
        ),
        "read_file": spec(
            "read_file",
            f"Return a text file's contents (beyond {cap} characters, cut in the middle).",
            {"path": path},
            ["path"],
        ),
        "write_file": spec(
            "write_file",
            "Create or overwrite a file with the given text; missing parent directories are created.",
            {"path": path, "content": {"type": "string", "description": "The file's new contents."}},
            ["path", "content"],
        ),
        "list_dir": spec(
            "list_dir",
            "List a directory's entries, one per line, hidden ones included; directories end with /.",
            {"path": {**path, "description": f"{path_help} Default: {workdir}."}},
            [],
        ),
        "submit": spec(
            "submit",
            "Finish: say the task is done. The episode ends; nothing runs after this call.",
            {"summary": {"type": "string", "description": "Optional: what was done."}},
            [],
        ),
    }


class SyncSandboxTools:
    """:class:`SandboxTools` for a synchronous caller in another thread: OpenEnv's ``ResourceSession``
    (``list_tools``, ``call_tool``) is sync, and ``MCPHarnessAdapter`` calls it from the harness's thread
    while the sandbox lives on ``loop``. A session delegates those two methods here; its
    ``initial_messages``, ``verify`` and ``close`` belong to the rollout, not to the tools."""

    def __init__(self, tools: SandboxTools, loop: asyncio.AbstractEventLoop) -> None:
        self.tools = tools
        self.loop = loop

    def list_tools(self) -> list[Tool]:
        """The tool manifest (no sandbox call: safe from any thread)."""
        return self.tools.list_tools()

    def call_tool(self, name: str, arguments: Any) -> ToolResult:
        """:meth:`SandboxTools.call_tool` run on ``loop``, waited for here. Raises RuntimeError when
        called on ``loop`` 's own thread (waiting there would deadlock it)."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            raise RuntimeError(
                "SyncSandboxTools.call_tool blocks: call it from another thread than its loop's"
            )
        future = asyncio.run_coroutine_threadsafe(self.tools.call_tool(name, arguments), self.loop)
        try:
            return future.result()
        except (
            BaseException
        ):  # interrupted while waiting (KeyboardInterrupt): stop the call, kill its command
            future.cancel()
            raise
