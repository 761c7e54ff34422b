"""The sandbox as tools (:mod:`harness_trainer.sandboxes.tools`), against a real local sandbox: each tool's
promise, the model's mistakes as error results, timeouts that kill, and the counters."""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openenv.core.harness")  # the tools speak OpenEnv's types: the `openenv` extra

import jsonschema  # the openenv extra brings it
from openenv.core.harness import ToolResult
from openenv.core.harness.rollout import RESERVED_TOOL_NAMES

from harness_trainer.sandboxes.base import SandboxError
from harness_trainer.sandboxes.e2b import E2BSandboxBackend
from harness_trainer.sandboxes.local import LocalSandbox, LocalSandboxBackend
from harness_trainer.sandboxes.tools import SandboxTools, SyncSandboxTools, ToolLimits, truncate
from tests.sandboxes.conftest import TaskFactory, live_processes, wait_until_gone


@pytest.fixture
async def sandbox(tmp_path: Path, make_task: TaskFactory) -> AsyncIterator[LocalSandbox]:
    backend = LocalSandboxBackend(tmp_path / "sandboxes", kill_grace_s=0.5)
    started = await backend.start(make_task(), lifetime_s=60)
    try:
        yield started
    finally:
        await backend.aclose()


@pytest.fixture
def tools(sandbox: LocalSandbox) -> SandboxTools:
    return SandboxTools(sandbox)


def marker() -> str:
    """A sleep duration no other process on the machine uses, to find this test's processes."""
    return f"{random.randint(100_000, 999_999)}"


def assert_error(result: ToolResult, *fragments: str) -> None:
    assert result.error is not None and not result.done
    assert isinstance(result.data, str) and result.data.endswith(f"Error: {result.error}")
    for fragment in fragments:
        assert fragment in result.error, (fragment, result.error)


async def test_the_manifest_offers_five_tools_with_valid_json_schemas(tools: SandboxTools) -> None:
    manifest = tools.list_tools()
    assert [tool.name for tool in manifest] == ["bash", "read_file", "write_file", "list_dir", "submit"]
    for tool in manifest:
        jsonschema.Draft202012Validator.check_schema(tool.input_schema)
        assert tool.input_schema["type"] == "object" and tool.description
    assert not {tool.name for tool in manifest} & RESERVED_TOOL_NAMES
    bash = manifest[0].input_schema
    assert bash["required"] == ["command"] and bash["properties"]["timeout"]["maximum"] == 600.0
    manifest[0].input_schema["required"].append("mutated")  # a caller's copy: the next listing is intact
    assert tools.list_tools()[0].input_schema["required"] == ["command"]


async def test_bash_reports_stdout_stderr_and_exit_code_and_a_nonzero_exit_is_no_failure(
    tools: SandboxTools,
) -> None:
    result = await tools.call_tool("bash", {"command": "pwd; echo err >&2; exit 3"})
    assert result.error is None and not result.done
    assert result.data == "/app\n[stderr]\nerr\n[exit code: 3]"
    assert result.metadata == {"exit_code": 3, "timed_out": False, "cut_chars": 0}
    quiet = await tools.call_tool("bash", {"command": "printf 'no newline'", "timeout": 5})
    assert quiet.data == "no newline\n[exit code: 0]"
    assert tools.failures["bash"] == 0


async def test_files_round_trip_through_relative_absolute_and_home_paths(
    tools: SandboxTools, sandbox: LocalSandbox
) -> None:
    written = await tools.call_tool("write_file", {"path": "notes/a.txt", "content": "héllo\n"})
    assert written.error is None and written.data == "Wrote 7 bytes to /app/notes/a.txt."
    assert (await tools.call_tool("read_file", {"path": "/app/notes/a.txt"})).data == "héllo\n"
    await tools.call_tool("write_file", {"path": "~/.config/x.toml", "content": "x = 1\n"})
    assert await sandbox.read_file(f"{sandbox.home}/.config/x.toml") == b"x = 1\n"
    seen = await tools.call_tool("bash", {"command": "cat notes/a.txt ~/.config/x.toml"})
    assert seen.data == "héllo\nx = 1\n[exit code: 0]"


async def test_list_dir_marks_directories_and_defaults_to_the_workdir(
    tools: SandboxTools, sandbox: LocalSandbox
) -> None:
    await sandbox.write_file("/app/src/main.py", "")
    await sandbox.write_file("/app/.hidden", "")
    await sandbox.exec("mkdir /app/empty")
    listing = await tools.call_tool("list_dir", {})
    assert listing.error is None and listing.data.splitlines() == [".hidden", "empty/", "src/"]
    assert (await tools.call_tool("list_dir", {"path": "src"})).data == "main.py\n"
    assert (await tools.call_tool("list_dir", {"path": "empty"})).data == "/app/empty is empty."
    assert_error(await tools.call_tool("list_dir", {"path": "/app/nowhere"}), "No such file or directory")


async def test_a_missing_file_or_a_directory_reads_as_an_error_result(tools: SandboxTools) -> None:
    assert_error(
        await tools.call_tool("read_file", {"path": "missing.txt"}), "no such file: /app/missing.txt"
    )
    assert_error(await tools.call_tool("read_file", {"path": "/app"}), "/app is a directory")
    assert tools.failures == {"read_file": 2}
    assert (await tools.call_tool("bash", {"command": "echo alive"})).data == "alive\n[exit code: 0]"


async def test_a_path_the_backend_refuses_is_an_error_result_and_bash_still_reaches_it(
    tools: SandboxTools,
) -> None:
    refused = await tools.call_tool("read_file", {"path": "/etc/hostname"})
    assert_error(refused, "outside the local sandbox's private paths")
    assert (await tools.call_tool("bash", {"command": "test -r /etc/hostname"})).data == "[exit code: 0]"


async def test_a_binary_file_is_not_dumped_into_the_context(
    tools: SandboxTools, sandbox: LocalSandbox
) -> None:
    await sandbox.write_file("/app/blob.bin", bytes(range(256)))
    assert_error(await tools.call_tool("read_file", {"path": "blob.bin"}), "binary file (256 bytes)")


async def test_long_output_keeps_head_and_tail_with_a_marker_saying_how_much_was_cut(
    sandbox: LocalSandbox,
) -> None:
    tools = SandboxTools(sandbox, ToolLimits(max_output_chars=100))
    result = await tools.call_tool("bash", {"command": "printf 'A%.0s' {1..300}; printf 'B%.0s' {1..300}"})
    assert result.data == "A" * 50 + "\n[... 500 characters cut ...]\n" + "B" * 50 + "\n[exit code: 0]"
    assert result.metadata["cut_chars"] == 500 and result.error is None
    await sandbox.write_file("/app/big.txt", "x" * 1000)
    read = await tools.call_tool("read_file", {"path": "big.txt"})
    assert read.data == "x" * 50 + "\n[... 900 characters cut ...]\n" + "x" * 50


def test_truncate_leaves_short_text_alone_and_cuts_the_middle_of_long_text() -> None:
    assert truncate("short", 5) == ("short", 0)
    assert truncate("abcdefg", 3) == ("a\n[... 4 characters cut ...]\nfg", 4)
    assert truncate("abcdefg", 1) == ("\n[... 6 characters cut ...]\ng", 6)


async def test_a_hanging_command_is_killed_at_its_timeout_and_the_episode_goes_on(
    tools: SandboxTools,
) -> None:
    tag = marker()
    result = await tools.call_tool(
        "bash", {"command": f"echo started; sleep {tag} & sleep {tag}1", "timeout": 1}
    )
    assert_error(result, "ran past its 1 s timeout and was killed")
    assert result.data.startswith("started\n") and result.metadata["timed_out"]
    assert result.metadata["exit_code"] is None
    assert not wait_until_gone(f"sleep {tag}"), "a process of the timed-out command survived"
    assert (await tools.call_tool("bash", {"command": "echo next"})).data == "next\n[exit code: 0]"
    assert (tools.calls["bash"], tools.failures["bash"]) == (2, 1)


MALFORMED_CALLS: list[tuple[str, Any, str]] = [
    (
        "edit",
        {"path": "a"},
        "unknown tool 'edit'; the tools are: bash, read_file, write_file, list_dir, submit",
    ),
    ("bash", {}, "'command' is a required property"),
    ("bash", {"command": 1}, "at command: 1 is not of type 'string'"),
    ("bash", ["ls"], "is not of type 'object'"),
    ("bash", {"command": "ls", "timeout": True}, "at timeout: True is not of type 'number'"),
    ("bash", {"command": "ls", "timeout": 601}, "601 is greater than the maximum of 600.0"),
    ("bash", {"command": "ls", "timeout": 0}, "less than or equal to the minimum of 0"),
    ("bash", {"command": "ls", "timeout": math.nan}, "timeout must be a finite number"),
    ("read_file", {"path": "a", "mode": "r"}, "'mode' was unexpected"),
    ("read_file", {"path": ""}, "should be non-empty"),
    ("write_file", {"path": "a"}, "'content' is a required property"),
    ("submit", {"summary": ["done"]}, "is not of type 'string'"),
]


@pytest.mark.parametrize(("name", "arguments", "reason"), MALFORMED_CALLS)
async def test_a_malformed_call_is_an_error_result_counted_as_a_failure(
    tools: SandboxTools, name: str, arguments: Any, reason: str
) -> None:
    assert_error(await tools.call_tool(name, arguments), reason)
    assert tools.calls == {name: 1} and tools.failures == {name: 1}
    assert not tools.submitted


async def test_submit_ends_the_episode_and_records_it(tools: SandboxTools) -> None:
    assert not tools.submitted
    result = await tools.call_tool("submit", {"summary": "fixed the bug"})
    assert result.done and result.error is None
    assert (tools.submitted, tools.summary) == (True, "fixed the bug")
    assert (await tools.call_tool("submit", {})).done and tools.summary is None


async def test_the_counters_add_up_per_tool(tools: SandboxTools) -> None:
    await tools.call_tool("bash", {"command": "exit 1"})
    await tools.call_tool("bash", {"command": "true", "timeout": "5"})
    await tools.call_tool("write_file", {"path": "a.txt", "content": "a"})
    await tools.call_tool("read_file", {"path": "a.txt"})
    await tools.call_tool("read_file", {"path": "b.txt"})
    await tools.call_tool("grep", {})
    await tools.call_tool("submit", {})
    assert tools.metrics() == {
        "tool_calls_by_name": {"bash": 2, "write_file": 1, "read_file": 2, "grep": 1, "submit": 1},
        "tool_failures_by_name": {"bash": 1, "read_file": 1, "grep": 1},
        "tool_failure_count": 3,
    }


async def test_a_closed_sandbox_raises_from_every_tool_that_touches_it(
    tools: SandboxTools, sandbox: LocalSandbox
) -> None:
    await sandbox.close()
    calls = [
        ("bash", {"command": "true"}), ("read_file", {"path": "a"}),
        ("write_file", {"path": "a", "content": "x"}), ("list_dir", {}),
    ]  # fmt: skip
    for name, arguments in calls:
        with pytest.raises(SandboxError, match="closed"):
            await tools.call_tool(name, arguments)
    assert tools.failures == {}  # a call that raises ends the rollout unscorable: no failure to count
    assert (await tools.call_tool("submit", {})).done  # touches nothing


async def test_a_cancelled_call_propagates_and_kills_its_command(tools: SandboxTools) -> None:
    tag = marker()
    call = asyncio.ensure_future(tools.call_tool("bash", {"command": f"sleep {tag}"}))
    for _ in range(100):
        if live_processes(f"sleep {tag}"):
            break
        await asyncio.sleep(0.05)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert not wait_until_gone(f"sleep {tag}")
    assert (tools.calls["bash"], tools.failures["bash"]) == (1, 0)


async def test_the_sync_facade_serves_a_harness_thread_and_refuses_the_loop_thread(
    tools: SandboxTools,
) -> None:
    facade = SyncSandboxTools(tools, asyncio.get_running_loop())
    result = await asyncio.to_thread(facade.call_tool, "bash", {"command": "echo from a thread"})
    assert result.data == "from a thread\n[exit code: 0]"
    missing = await asyncio.to_thread(facade.call_tool, "read_file", {"path": "missing"})
    assert missing.error == "no such file: /app/missing"
    assert await asyncio.to_thread(facade.list_tools) == tools.list_tools()
    with pytest.raises(RuntimeError, match="another thread"):
        facade.call_tool("bash", {"command": "true"})
    assert tools.calls == {"bash": 1, "read_file": 1}


@pytest.mark.docker  # the fake E2B cloud runs images exported from the Docker daemon
async def test_the_tools_need_only_the_sandbox_protocol_so_e2b_serves_them_too(
    tmp_path: Path, make_task: TaskFactory
) -> None:
    pytest.importorskip("e2b")  # the fake stands in for the SDK's sandbox, with the SDK's own errors
    from tests.sandboxes.fake_e2b import FakeE2BCloud

    cloud = FakeE2BCloud(tmp_path / "e2b")  # commands really run, in a namespace of their own
    backend = E2BSandboxBackend(template="fake", sandbox_class=cloud, kill_grace_s=0.5, retry_backoff_s=0)
    sandbox = await backend.start(make_task(), lifetime_s=60)
    tag = marker()
    try:
        tools = SandboxTools(sandbox)
        await tools.call_tool("write_file", {"path": "src/a.py", "content": "print(1)\n"})
        assert (await tools.call_tool("read_file", {"path": "~/../../app/src/a.py"})).data == "print(1)\n"
        assert (await tools.call_tool("list_dir", {"path": "/app"})).data == "src/\n"
        assert (await tools.call_tool("bash", {"command": "python3 src/a.py"})).data == "1\n[exit code: 0]"
        hung = await tools.call_tool("bash", {"command": f"sleep {tag}", "timeout": 0.5})
        assert_error(hung, "timeout and was killed")
        assert not wait_until_gone(f"sleep {tag}")
        assert_error(await tools.call_tool("read_file", {"path": "nope"}), "no such file: /app/nope")
        assert tools.metrics()["tool_failures_by_name"] == {"bash": 1, "read_file": 1}
    finally:
        await backend.aclose()


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ({"default_timeout_s": 0}, "default_timeout_s must be a positive, finite number"),
        ({"max_timeout_s": math.inf}, "max_timeout_s must be a positive, finite number"),
        ({"max_timeout_s": True}, "max_timeout_s must be a positive, finite number"),
        (
            {"default_timeout_s": 30, "max_timeout_s": 10},
            r"default_timeout_s \(30\) exceeds max_timeout_s \(10\)",
        ),
        ({"max_output_chars": 0}, "max_output_chars must be a positive int"),
        ({"max_output_chars": 10.5}, "max_output_chars must be a positive int"),
    ],
)
def test_bad_limits_are_refused_at_construction(limits: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ToolLimits(**limits)
