"""The configs, commands and environments each harness generates, checked without running an agent."""

from __future__ import annotations

import json
import shlex
import tomllib

import pytest

from harness_trainer.harnesses import HARNESSES, claude_code, codex, make_harness, mini_swe_agent, opencode
from harness_trainer.harnesses.base import AgentEndpoint
from harness_trainer.harnesses.bundles import bundle_entry
from harness_trainer.sandboxes.base import AGENT_ROOT, ExecResult
from tests.harnesses.conftest import FakeSandbox

ENDPOINT = AgentEndpoint(root_url="http://127.0.0.1:8300/", session_id="sess-abc", model="tiny")


def test_every_registered_harness_builds_without_options_and_is_named_for_its_key() -> None:
    for name in HARNESSES:
        harness = make_harness(name)
        assert harness.name == name
        assert callable(harness.install) and callable(harness.run)


def test_an_unknown_harness_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="known: claude-code, codex, mini-swe-agent, opencode"):
        make_harness("aider")


# opencode


def test_opencode_provider_is_openai_compatible_and_not_named_openai() -> None:
    config = opencode.build_config(ENDPOINT, step_limit=0, max_output_tokens=1024)
    [(provider_id, provider)] = config["provider"].items()
    assert provider_id != "openai"
    assert provider["npm"] == "@ai-sdk/openai-compatible"
    assert provider["options"] == {"baseURL": "http://127.0.0.1:8300/v1", "apiKey": "sess-abc"}
    assert provider["models"]["tiny"]["limit"]["output"] == 1024
    assert config["model"] == config["small_model"] == f"{provider_id}/tiny"
    assert config["enabled_providers"] == [provider_id]
    assert config["autoupdate"] is False and config["share"] == "disabled"


def test_opencode_turns_off_nested_sessions_and_the_web() -> None:
    config = opencode.build_config(ENDPOINT, step_limit=0, max_output_tokens=1024)
    for tool in ("task", "webfetch", "websearch"):
        assert config["tools"][tool] is False
        assert config["permission"][tool] == "deny"


def test_opencode_step_limit_is_the_build_agents_steps_and_zero_means_none() -> None:
    assert opencode.build_config(ENDPOINT, step_limit=7, max_output_tokens=1)["agent"]["build"]["steps"] == 7
    assert "agent" not in opencode.build_config(ENDPOINT, step_limit=0, max_output_tokens=1)


def test_opencode_runs_headless_with_a_fixed_title_and_the_instruction_after_double_dash() -> None:
    argv = opencode.build_command("/bin/opencode", "-rm everything")
    assert argv[:2] == ["/bin/opencode", "run"]
    assert argv[argv.index("--format") + 1] == "json"
    assert argv[argv.index("--title") + 1] == opencode.TITLE
    assert argv[-2:] == ["--", "-rm everything"]


def test_opencode_plugin_stub_lists_in_its_lock_every_dependency_it_declares() -> None:
    files = opencode.plugin_stub_files()
    declared = json.loads(files["package.json"])["dependencies"]
    locked = json.loads(files["package-lock.json"])["packages"][""]["dependencies"]
    assert declared == locked == {"@opencode-ai/plugin": opencode.PACKAGE.version}


# mini-swe-agent


def test_mini_overlay_points_litellm_at_the_proxy_with_cost_limits_off() -> None:
    overlay = mini_swe_agent.build_overlay(
        ENDPOINT, step_limit=12, max_output_tokens=512, command_timeout_s=9
    )
    assert overlay["model"]["model_name"] == "openai/tiny"
    assert overlay["model"]["model_kwargs"]["api_base"] == "http://127.0.0.1:8300/v1"
    assert overlay["model"]["model_kwargs"]["max_tokens"] == 512
    assert overlay["model"]["cost_tracking"] == "ignore_errors"
    assert overlay["agent"] == {"step_limit": 12, "cost_limit": 0, "mode": "yolo", "confirm_exit": False}
    assert overlay["environment"] == {"timeout": 9}
    assert "sess-abc" not in json.dumps(overlay)  # the key travels in the environment only


def test_mini_agent_config_lies_under_the_rollouts_own_settings() -> None:
    agent_config = {
        "agent": {"instance_template": "Task: {{task}}", "step_limit": 99, "mode": "confirm"},
        "model": {"observation_template": "{{output.output}}", "model_name": "openai/elsewhere"},
    }
    overlay = mini_swe_agent.build_overlay(ENDPOINT, step_limit=3, agent_config=agent_config)
    assert overlay["agent"] == {
        "instance_template": "Task: {{task}}", "step_limit": 3, "cost_limit": 0, "mode": "yolo",
        "confirm_exit": False,
    }  # fmt: skip
    assert overlay["model"]["observation_template"] == "{{output.output}}"
    assert overlay["model"]["model_name"] == "openai/tiny"  # the rollout's engine, never the config's
    assert agent_config["agent"]["step_limit"] == 99  # the caller's mapping is left as it was


@pytest.mark.parametrize(
    ("agent_config", "says"),
    [
        ("agent: {}", "must be a mapping"),
        ({"run": {}}, "from agent, model, environment"),
        ({"agent": "x"}, "agent: str"),
        ({"agent": {"x": object()}}, "not JSON-serialisable"),
    ],
)
def test_mini_refuses_an_agent_config_it_could_not_write(agent_config: object, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        make_harness("mini-swe-agent", agent_config=agent_config)


def test_a_harness_option_its_class_does_not_take_is_a_value_error_naming_it() -> None:
    with pytest.raises(ValueError, match=r"harness 'codex' does not take options \['max_output_tokens'\]"):
        make_harness("codex", max_output_tokens=5)


def test_mini_command_layers_the_overlay_over_the_stock_config() -> None:
    argv = mini_swe_agent.build_command("/v/bin/mini", "fix it", "/o.yaml", "/t.json")
    assert argv[argv.index("-c") + 1] == "mini.yaml"
    assert argv[argv.index("/o.yaml") - 1] == "-c"
    assert argv[argv.index("-t") + 1] == "fix it" and argv[argv.index("-o") + 1] == "/t.json"
    assert "-y" in argv and "--exit-immediately" in argv


# claude-code


def test_claude_code_env_points_every_model_alias_at_the_served_model() -> None:
    env = claude_code.build_env(ENDPOINT, max_output_tokens=2048, context_tokens=16384)
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8300"
    assert env["ANTHROPIC_API_KEY"] == "sess-abc"
    for variable in claude_code.MODEL_VARIABLES:
        assert env[variable] == "tiny"
    assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "2048" and env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "16384"
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1" and env["DISABLE_AUTOUPDATER"] == "1"
    assert "-mid_conv_system" in env["CLAUDE_CODE_MODEL_CAPABILITIES"].split(",")


def test_claude_code_command_skips_permissions_and_limits_turns_only_when_asked() -> None:
    argv = claude_code.build_command("/c", "go", step_limit=5, tools=("Bash", "Read"))
    assert argv[argv.index("--max-turns") + 1] == "5"
    assert argv[argv.index("--output-format") + 1] == "stream-json" and "--verbose" in argv
    assert "--dangerously-skip-permissions" in argv and argv[argv.index("--tools") + 1] == "Bash,Read"
    assert argv[-2:] == ["--", "go"]
    assert "--max-turns" not in claude_code.build_command("/c", "go", step_limit=0, tools=("Bash",))


# codex


def test_codex_config_is_a_responses_provider_reading_its_key_from_the_environment() -> None:
    config = tomllib.loads(codex.build_config(ENDPOINT, context_tokens=16384))
    provider = config["model_providers"][config["model_provider"]]
    assert provider["base_url"] == "http://127.0.0.1:8300/v1"
    assert provider["wire_api"] == "responses"
    assert provider["env_key"] == codex.API_KEY_VARIABLE
    assert config["model"] == "tiny" and config["model_context_window"] == 16384
    assert config["approval_policy"] == "never" and config["sandbox_mode"] == "danger-full-access"
    assert config["web_search"] == "disabled" and config["agents"]["enabled"] is False
    assert "sess-abc" not in codex.build_config(ENDPOINT)


def test_codex_config_quotes_any_model_name_as_toml() -> None:
    odd = AgentEndpoint("http://h:1", "s", 'we"ird\\model ü\n')
    assert tomllib.loads(codex.build_config(odd))["model"] == 'we"ird\\model ü\n'


def test_codex_command_is_headless_outside_git_in_the_workdir() -> None:
    argv = codex.build_command("/x/codex", "do", "/app")
    assert argv[:3] == ["/x/codex", "exec", "--json"]
    assert "--skip-git-repo-check" in argv and argv[argv.index("-C") + 1] == "/app"
    assert argv[-2:] == ["--", "do"]


# what run() asks of the sandbox


def _writes_log(log_name: str, text: str):  # type: ignore[no-untyped-def]
    def agent(sandbox: FakeSandbox, command: str) -> ExecResult:
        sandbox.files[f"/logs/agent/{log_name}"] = text.encode()
        return ExecResult(0, "", "")

    return agent


@pytest.mark.parametrize(
    ("name", "log_name"),
    [
        ("opencode", "opencode.jsonl"),
        ("mini-swe-agent", "mini-swe-agent.log"),
        ("claude-code", "claude-code.jsonl"),
        ("codex", "codex.jsonl"),
    ],
)
async def test_run_execs_the_pinned_binary_in_the_workdir_with_stdout_to_the_agent_log(
    name: str, log_name: str
) -> None:
    sandbox = FakeSandbox(_writes_log(log_name, "not json\n"))
    run = await make_harness(name).run(sandbox, "say 'hi'", ENDPOINT, step_limit=3, timeout_s=42)
    [call] = sandbox.execs
    argv = shlex.split(call["command"])
    package = HARNESSES[name].package
    assert package is not None and package.version in argv[0]
    assert argv[0] == bundle_entry(package)  # where a backend provisions its bundle
    assert argv[0].startswith(f"{AGENT_ROOT}/")
    assert "say 'hi'" in argv
    assert argv[-4:] == ["<", "/dev/null", ">", f"/logs/agent/{log_name}"]
    assert call["timeout_s"] == 42 and call["cwd"] == "/app"
    assert "sess-abc" in json.dumps(call["env"]) + json.dumps(
        {k: v.decode() for k, v in sandbox.files.items()}
    )
    assert run.log == "not json\n" and run.tools.total == 0 and run.result.exit_code == 0


async def test_opencode_run_writes_its_config_privately_and_names_it_in_the_environment() -> None:
    sandbox = FakeSandbox()
    await opencode.OpencodeHarness(max_output_tokens=99).run(
        sandbox, "x", ENDPOINT, step_limit=2, timeout_s=5
    )
    path = sandbox.execs[0]["env"]["OPENCODE_CONFIG"]
    assert path.startswith("/home/user/") and sandbox.modes[path] == 0o600
    config = json.loads(sandbox.files[path])
    assert config["agent"]["build"]["steps"] == 2
    assert "/home/user/.config/opencode/package-lock.json" in sandbox.files
    assert "/home/user/.config/opencode/node_modules/.keep" in sandbox.files


async def test_codex_run_uses_a_private_codex_home_and_passes_the_key_by_variable() -> None:
    sandbox = FakeSandbox()
    await codex.CodexHarness().run(sandbox, "x", ENDPOINT, step_limit=0, timeout_s=5)
    env = sandbox.execs[0]["env"]
    assert env["CODEX_HOME"] == "/home/user/.codex"
    assert env[codex.API_KEY_VARIABLE] == "sess-abc"
    assert "/home/user/.codex/config.toml" in sandbox.files


async def test_mini_run_keeps_mini_away_from_the_users_global_config() -> None:
    sandbox = FakeSandbox()
    await mini_swe_agent.MiniSweAgentHarness().run(sandbox, "x", ENDPOINT, step_limit=4, timeout_s=5)
    env = sandbox.execs[0]["env"]
    assert env["OPENAI_API_KEY"] == "sess-abc"
    assert env["MSWEA_GLOBAL_CONFIG_DIR"].startswith("/home/user/")
    assert env["MSWEA_CONFIGURED"] == "true" and env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"
    overlay = json.loads(sandbox.files[f"{env['MSWEA_GLOBAL_CONFIG_DIR']}/overlay.yaml"])
    assert overlay["agent"]["step_limit"] == 4


async def test_a_killed_run_still_returns_what_the_agent_logged() -> None:
    line = json.dumps(
        {"type": "tool_use", "part": {"tool": "bash", "callID": "c1", "state": {"status": "completed"}}}
    )

    def agent(sandbox: FakeSandbox, command: str) -> ExecResult:
        sandbox.files["/logs/agent/opencode.jsonl"] = (line + "\n").encode()
        return ExecResult(None, "", "", timed_out=True)

    run = await opencode.OpencodeHarness().run(FakeSandbox(agent), "x", ENDPOINT, step_limit=0, timeout_s=1)
    assert run.result.timed_out and run.tools.calls_by_name == {"bash": 1}
