"""``toy``: the stdlib agent in ``toy_agent.py``, for tests, benchmarks and the dev loop.

Install copies the script into the sandbox user's home (``~/.harness/toy_agent.py``); run calls it with the
sandbox's ``python3``. Tool counts come from its JSON lines: each ``{"tool": name, "exit_code": n}`` is a
call, a non-zero exit code a failure.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from harness_trainer.harnesses.base import AgentEndpoint, AgentRun, Dialect, ToolCounts, json_lines
from harness_trainer.sandboxes.base import Sandbox

SCRIPT = Path(__file__).with_name("toy_agent.py")
REMOTE = "/home/user/.harness/toy_agent.py"  # HOME in the local and E2B sandboxes


class ToyHarness:
    name = "toy"
    package = None  # the script ships with this package
    dialect = Dialect()

    async def install(self, sandbox: Sandbox) -> None:
        await sandbox.write_file(REMOTE, SCRIPT.read_bytes(), mode=0o755)

    async def run(
        self,
        sandbox: Sandbox,
        instruction: str,
        endpoint: AgentEndpoint,
        *,
        step_limit: int,
        timeout_s: float,
    ) -> AgentRun:
        # "--flag=value" and "--" keep values that start with "-" (ids, instructions) from reading as flags.
        argv = ["python3", REMOTE, f"--base-url={endpoint.base_url}", f"--api-key={endpoint.session_id}"]
        argv += [f"--model={endpoint.model}", f"--steps={step_limit or 20}", "--", instruction]
        result = await sandbox.exec(shlex.join(argv), timeout_s=timeout_s)
        return AgentRun(result=result, log=result.stdout + result.stderr, tools=count_tools(result.stdout))


def count_tools(log: str) -> ToolCounts:
    counts = ToolCounts()
    for record in json_lines(log):
        if "tool" in record:
            name = str(record["tool"])
            counts.calls_by_name[name] = counts.calls_by_name.get(name, 0) + 1
            counts.failures += record.get("exit_code") not in (0, None)
    return counts
