"""The configs, commands and environments each harness generates, checked without running an agent."""

from __future__ import annotations

import json
import shlex
import subprocess
import tomllib

import pytest

import harness_trainer.harnesses.aider as aider
import harness_trainer.harnesses.gemini_cli as gemini_cli
import harness_trainer.harnesses.qwen_code as qwen_code
from harness_trainer.devloop.solver import command_replies
from harness_trainer.harnesses import HARNESSES, claude_code, codex, make_harness, mini_swe_agent, opencode
from harness_trainer.harnesses.base import AgentEndpoint
from harness_trainer.harnesses.bundles import bundle_entry
from harness_trainer.harnesses.pi_agent import PiHarness, build_command, build_models, build_settings
from harness_trainer.sandboxes.base import AGENT_ROOT, ExecResult
from tests.harnesses.conftest import FakeSandbox

ENDPOINT = AgentEndpoint(root_url="http://127.0.0.1:8300/", session_id="sess-abc", model="tiny")


def test_every_registered_harness_builds_without_options_and_is_named_for_its_key() -> None:
    for name in HARNESSES:
        harness = make_harness(name)
        assert harness.name == name
        assert callable(harness.install) and callable(harness.run)


def test_an_unknown_harness_name_lists_the_known_ones() -> None:
    with pytest.raises(
        ValueError, match="known: aider, claude-code, codex, gemini-cli, mini-swe-agent, opencode"
    ):
        make_harness("no-such-agent")


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


# pi


def test_pi_models_json_is_an_openai_completions_provider_reading_its_key_from_the_environment() -> None:
    [(provider_id, provider)] = build_models(ENDPOINT, max_output_tokens=512)["providers"].items()
    assert provider["baseUrl"] == "http://127.0.0.1:8300/v1" and provider["api"] == "openai-completions"
    assert provider["apiKey"] == "HARNESS_TRAINER_API_KEY"  # pi reads a key naming a variable from it
    plain = {"supportsDeveloperRole": False, "supportsStore": False, "supportsStrictMode": False}
    assert provider["compat"] == {**provider["compat"], **plain, "maxTokensField": "max_tokens"}
    [model] = provider["models"]
    assert model["id"] == "tiny" and model["reasoning"] is False and model["maxTokens"] == 512
    assert "contextWindow" not in model
    assert "sess-abc" not in json.dumps(build_models(ENDPOINT, max_output_tokens=1))
    sized = build_models(ENDPOINT, max_output_tokens=1, context_tokens=16384)
    assert sized["providers"][provider_id]["models"][0]["contextWindow"] == 16384


def test_pi_settings_turn_telemetry_off_and_compact_only_a_context_of_known_size() -> None:
    assert build_settings()["enableInstallTelemetry"] is False
    assert build_settings()["compaction"] == {"enabled": False}
    assert build_settings(context_tokens=8192)["compaction"] == {"enabled": True}


def test_pi_command_is_offline_json_print_mode_with_only_the_file_and_shell_tools() -> None:
    argv = build_command("/x/pi", "fix it", "tiny", tools=("read", "bash"))
    assert argv[0] == "/x/pi" and "--offline" in argv
    assert argv[argv.index("--provider") + 1] == "harness" and argv[argv.index("--model") + 1] == "tiny"
    assert argv[argv.index("--tools") + 1] == "read,bash" and argv[argv.index("--mode") + 1] == "json"
    for flag in ("--no-extensions", "--no-skills", "--no-prompt-templates", "--no-themes"):
        assert flag in argv
    assert argv[argv.index("--session-dir") + 1] == "/logs/agent/pi-sessions"
    assert argv[-2:] == ["-p", "fix it"]


@pytest.mark.parametrize("instruction", ["-rm everything", "@notes.md says it", "--- a heading"])
def test_pi_never_reads_an_instruction_as_an_option_or_a_file(instruction: str) -> None:
    message = build_command("/x/pi", instruction, "tiny", tools=("bash",))[-1]
    assert message.strip("\n") == instruction
    assert not message.startswith("@") and (not message.startswith("-") or message.startswith("---"))


# qwen-code


def test_qwen_code_settings_choose_openai_auth_and_the_served_model_and_keep_the_key_out() -> None:
    settings = qwen_code.build_settings(ENDPOINT, step_limit=7, context_tokens=16384)
    assert settings["security"]["auth"]["selectedType"] == "openai"
    assert settings["model"]["name"] == "tiny" and settings["model"]["maxSessionTurns"] == 7
    assert settings["model"]["generationConfig"] == {"contextWindowSize": 16384}
    assert "sess-abc" not in json.dumps(settings)
    unsized = qwen_code.build_settings(ENDPOINT, step_limit=0)
    assert unsized["model"]["maxSessionTurns"] == -1 and "generationConfig" not in unsized["model"]


def test_qwen_code_settings_turn_off_side_calls_the_web_discovery_and_updates() -> None:
    settings = qwen_code.build_settings(ENDPOINT, step_limit=0, tools=("run_shell_command", "read_file"))
    model, tools = settings["model"], settings["tools"]
    assert model["skipNextSpeakerCheck"] is True and model["skipLoopDetection"] is True
    assert not any(settings["memory"].values())
    assert settings["experimental"]["emitToolUseSummaries"] is False
    assert tools["core"] == ["run_shell_command", "read_file"] and tools["approvalMode"] == "yolo"
    assert {"web_fetch", "web_search", "agent", "skill"} <= set(tools["disabled"])
    assert tools["webSearch"] == {"enabled": False} and tools["toolSearch"] == {"enabled": False}
    assert settings["skills"]["disabledLevels"] == ["project", "user", "extension", "bundled"]
    assert settings["mcpServers"] == {} and settings["mcp"]["excluded"] == ["*"]
    assert settings["general"]["enableAutoUpdate"] is False and settings["ide"]["enabled"] is False
    assert settings["privacy"]["usageStatisticsEnabled"] is False
    assert settings["telemetry"]["enabled"] is False


def test_qwen_code_env_points_at_the_proxy_and_its_private_home() -> None:
    env = qwen_code.build_env(ENDPOINT, qwen_home="/h/.q", max_output_tokens=2048)
    assert env["OPENAI_BASE_URL"] == "http://127.0.0.1:8300/v1" and env["OPENAI_API_KEY"] == "sess-abc"
    assert env["OPENAI_MODEL"] == "tiny" and env["QWEN_HOME"] == "/h/.q"
    assert env["QWEN_CODE_MAX_OUTPUT_TOKENS"] == "2048" and env["QWEN_DISABLE_AUTO_TITLE"] == "1"


@pytest.mark.parametrize("instruction", ["say 'hi'", "-rm everything", "--yolo\nsecond line"])
def test_qwen_code_command_is_headless_yolo_stream_json_with_the_instruction_as_one_prompt(
    instruction: str,
) -> None:
    argv = qwen_code.build_command("/x/qwen", instruction)
    assert argv[0] == "/x/qwen" and argv[argv.index("--approval-mode") + 1] == "yolo"
    assert argv[argv.index("--output-format") + 1] == "stream-json"
    assert argv[-1] == f"--prompt={instruction}" and "--" not in argv


# gemini-cli


def test_gemini_cli_env_points_its_api_key_auth_at_the_proxy_and_its_private_home() -> None:
    env = gemini_cli.build_env(ENDPOINT, "/h/.g")
    assert env["GOOGLE_GEMINI_BASE_URL"] == "http://127.0.0.1:8300" and env["GEMINI_API_KEY"] == "sess-abc"
    assert env["GEMINI_CLI_HOME"] == "/h/.g" and env["GEMINI_CLI_NO_RELAUNCH"] == "true"
    for variable in ("GEMINI_CLI_SYSTEM_SETTINGS_PATH", "GEMINI_CLI_SYSTEM_DEFAULTS_PATH"):
        assert env[variable].startswith("/h/.g/")
    assert env["GEMINI_CLI_TRUST_WORKSPACE"] == "true" and env["GEMINI_TELEMETRY_ENABLED"] == "false"


def test_gemini_cli_settings_turn_off_refused_side_calls_the_web_and_updates() -> None:
    settings = gemini_cli.build_settings(ENDPOINT, step_limit=7, max_output_tokens=512)
    assert settings["security"]["auth"]["selectedType"] == "gemini-api-key"
    assert settings["security"]["folderTrust"]["enabled"] is False
    model = settings["model"]
    assert model["skipNextSpeakerCheck"] is True and model["disableLoopDetection"] is True
    assert model["maxSessionTurns"] == 7
    assert settings["tools"]["core"] == list(gemini_cli.DEFAULT_TOOLS)
    assert not {"google_web_search", "web_fetch", "save_memory"} & set(settings["tools"]["core"])
    assert settings["tools"]["disableLLMCorrection"] is True
    [override] = settings["modelConfigs"]["overrides"]
    assert override["match"] == {"model": "tiny"}
    assert override["modelConfig"]["generateContentConfig"] == {"maxOutputTokens": 512}
    assert settings["general"]["enableAutoUpdate"] is False and settings["ide"]["enabled"] is False
    assert (
        settings["privacy"]["usageStatisticsEnabled"] is False and settings["telemetry"]["enabled"] is False
    )
    assert settings["useWriteTodos"] is False and settings["skills"]["enabled"] is False
    assert settings["experimental"]["enableAgents"] is False
    assert "sess-abc" not in json.dumps(settings)
    assert (
        gemini_cli.build_settings(ENDPOINT, step_limit=0, max_output_tokens=1)["model"]["maxSessionTurns"]
        == -1
    )


@pytest.mark.parametrize("instruction", ["say 'hi'", "-rm everything", "--yolo\nsecond line"])
def test_gemini_cli_command_is_headless_yolo_stream_json_without_extensions_or_mcp(instruction: str) -> None:
    argv = gemini_cli.build_command("/x/gemini", instruction, model="tiny")
    assert argv[0] == "/x/gemini" and argv[argv.index("--model") + 1] == "tiny"
    assert argv[argv.index("--approval-mode") + 1] == "yolo"
    assert argv[argv.index("--output-format") + 1] == "stream-json"
    assert argv[argv.index("--extensions") + 1] == "none"
    assert argv[argv.index("--allowed-mcp-server-names") + 1] == gemini_cli.NO_MCP_SERVER
    assert argv[-1] == f"--prompt={instruction}" and "--" not in argv


# aider


def test_aider_env_points_litellm_at_the_proxy_with_the_session_as_key_and_no_price_fetch() -> None:
    env = aider.build_env(ENDPOINT)
    assert env["OPENAI_API_BASE"] == "http://127.0.0.1:8300/v1" and env["OPENAI_API_KEY"] == "sess-abc"
    assert env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True" and env["TERM"] == "dumb"
    assert env["AIDER_ANALYTICS"] == "false" and env["AIDER_CHECK_UPDATE"] == "false"


def test_aider_model_metadata_is_local_sized_and_free() -> None:
    metadata = aider.build_metadata(ENDPOINT, context_tokens=8192, max_output_tokens=512)
    assert metadata == {
        "openai/tiny": {
            "max_input_tokens": 8192,
            "max_output_tokens": 512,
            "max_tokens": 512,
            "input_cost_per_token": 0.0,
            "output_cost_per_token": 0.0,
            "litellm_provider": "openai",
            "mode": "chat",
        }
    }


@pytest.mark.parametrize("instruction", ["say 'hi'", "-rm everything", "--yes\nsecond line"])
def test_aider_command_answers_yes_on_stdin_and_turns_off_git_the_map_and_the_network(
    instruction: str,
) -> None:
    shell, flag, script = aider.build_command("/x/aider", instruction, ENDPOINT, private="/h/.a")
    assert (shell, flag) == ("bash", "-c") and script.startswith("yes | exec ")
    argv = shlex.split(script.removeprefix("yes | exec "))
    assert argv[0] == "/x/aider" and argv[-1] == f"--message={instruction}"
    assert "--yes-always" not in argv  # it refuses every proposed shell command
    for option in ("--model", "--weak-model", "--editor-model"):
        assert argv[argv.index(option) + 1] == "openai/tiny"
    assert argv[argv.index("--edit-format") + 1] == "diff" and argv[argv.index("--map-tokens") + 1] == "0"
    assert argv[argv.index("--model-metadata-file") + 1] == "/h/.a/model-metadata.json"
    assert argv[argv.index("--config") + 1] == "/h/.a/aider.conf.yml"
    assert argv[argv.index("--chat-history-file") + 1] == "/logs/agent/aider.chat.history.md"
    for off in ("--no-git", "--no-auto-commits", "--no-analytics", "--no-check-update", "--no-detect-urls"):
        assert off in argv
    assert "--suggest-shell-commands" in argv and "sess-abc" not in script


def test_aider_counts_applied_edits_run_commands_and_unapplied_replies_from_its_console() -> None:
    log = (
        "hello.txt\n```\n<<<<<<< SEARCH\n```\n"
        "Create new file? (Y)es/(N)o [Yes]: Applied edit to hello.txt\n"
        "Run shell command? (Y)es/(N)o/(D)on't ask again [Yes]: \nRunning cat hello.txt\n"
        "The LLM did not conform to the edit format.\n"
    )
    counts = aider.parse_tool_counts(log)
    assert counts.calls_by_name == {"edit": 2, "shell": 1} and counts.failures == 1
    assert aider.parse_tool_counts("say Running fast\n").total == 0


def test_aider_scripted_transcript_is_one_text_reply_with_the_command_as_a_bash_block(tmp_path) -> None:
    assert command_replies("aider", "ls -la") == [{"content": "```bash\nls -la\n```"}]
    assert aider.AiderHarness.dialect.shell_fence == aider.SHELL_FENCE
    # aider runs each line of the block on its own: a here-document becomes one line that sh runs whole
    script = f"cat > {tmp_path}/x.sh <<'EOF'\necho \"it's ${{1:-me}}\"\nEOF\nchmod +x {tmp_path}/x.sh"
    [reply] = command_replies("aider", script)
    fence, line, end = reply["content"].splitlines()
    assert (fence, end) == ("```bash", "```")
    subprocess.run(["sh", "-c", line], check=True)
    assert (tmp_path / "x.sh").read_text() == 'echo "it\'s ${1:-me}"\n'


async def test_aider_run_writes_its_private_files_and_logs_its_console_and_histories() -> None:
    sandbox = FakeSandbox(_writes_log("aider.log", "Applied edit to hello.txt\n"))
    run = await aider.AiderHarness(context_tokens=4096).run(sandbox, "x", ENDPOINT, step_limit=3, timeout_s=9)
    [call] = sandbox.execs
    argv = shlex.split(call["command"])
    assert argv[:2] == ["bash", "-c"] and argv[-4:] == ["<", "/dev/null", ">", "/logs/agent/aider.log"]
    assert argv[2].startswith(f"yes | exec {bundle_entry(aider.PACKAGE)} ")
    assert call["env"]["OPENAI_API_KEY"] == "sess-abc" and call["cwd"] == "/app" and call["timeout_s"] == 9
    private = "/home/user/.harness-trainer/aider"
    metadata = json.loads(sandbox.files[f"{private}/model-metadata.json"])
    assert metadata["openai/tiny"]["max_input_tokens"] == 4096
    assert (
        sandbox.files[f"{private}/aider.conf.yml"] == b"{}\n" and sandbox.files[f"{private}/aider.env"] == b""
    )
    assert sandbox.files["/logs/agent/aider.chat.history.md"] == b""
    assert run.tools.calls_by_name == {"edit": 1}


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
        ("pi", "pi.jsonl"),
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


async def test_pi_run_writes_its_config_in_a_private_agent_dir_and_counts_its_tool_events() -> None:
    events = [
        {"type": "tool_execution_start", "toolCallId": "c1", "toolName": "read"},
        {"type": "tool_execution_end", "toolCallId": "c1", "toolName": "read", "isError": True},
        {"type": "tool_execution_start", "toolCallId": "c2", "toolName": "bash"},
        {"type": "tool_execution_start", "toolCallId": "c2", "toolName": "bash"},
        {"type": "tool_execution_end", "toolCallId": "c2", "toolName": "bash", "isError": False},
        {"type": "message_end", "message": {"role": "assistant", "content": []}},
    ]
    sandbox = FakeSandbox(_writes_log("pi.jsonl", "\n".join(json.dumps(e) for e in events) + "\n"))
    run = await PiHarness(context_tokens=4096).run(sandbox, "x", ENDPOINT, step_limit=0, timeout_s=5)
    env = sandbox.execs[0]["env"]
    agent_dir = env["PI_CODING_AGENT_DIR"]
    assert agent_dir.startswith("/home/user/") and env["HARNESS_TRAINER_API_KEY"] == "sess-abc"
    assert env["PI_OFFLINE"] == "1" and env["PI_SKIP_VERSION_CHECK"] == "1" and env["PI_TELEMETRY"] == "0"
    for name in ("models.json", "settings.json"):
        assert sandbox.modes[f"{agent_dir}/{name}"] == 0o600
    assert json.loads(sandbox.files[f"{agent_dir}/settings.json"])["compaction"] == {"enabled": True}
    assert run.tools.calls_by_name == {"read": 1, "bash": 1} and run.tools.failures == 1


async def test_qwen_code_run_writes_private_settings_and_counts_its_stream_json_tool_calls() -> None:
    def tool(call_id: str, name: str) -> dict[str, object]:
        return {"type": "tool_use", "id": call_id, "name": name, "input": {}}

    def result(call_id: str, *, error: bool) -> dict[str, object]:
        return {"type": "tool_result", "tool_use_id": call_id, "is_error": error, "content": ""}

    events = [
        {"type": "system", "subtype": "init", "tools": ["run_shell_command"]},
        {"type": "assistant", "message": {"content": [tool("c1", "run_shell_command")]}},
        {"type": "user", "message": {"content": [result("c1", error=True)]}},
        {"type": "assistant", "message": {"content": [tool("c2", "read_file"), tool("c3", "read_file")]}},
        {"type": "user", "message": {"content": [result("c2", error=False), result("c3", error=False)]}},
        {"type": "assistant", "message": {"content": [{"type": "text", "text": "Done."}]}},
        {"type": "result", "subtype": "success", "is_error": False},
    ]
    sandbox = FakeSandbox(_writes_log("qwen-code.jsonl", "\n".join(json.dumps(e) for e in events) + "\n"))
    harness = qwen_code.QwenCodeHarness(max_output_tokens=99)
    run = await harness.run(sandbox, "x", ENDPOINT, step_limit=4, timeout_s=5)
    [call] = sandbox.execs
    env, argv = call["env"], shlex.split(call["command"])
    assert argv[0] == bundle_entry(qwen_code.PACKAGE) and call["cwd"] == "/app"
    assert argv[-4:] == ["<", "/dev/null", ">", "/logs/agent/qwen-code.jsonl"]
    qwen_home = env["QWEN_HOME"]
    assert qwen_home.startswith("/home/user/") and qwen_home != "/home/user/.qwen"
    assert sandbox.modes[f"{qwen_home}/settings.json"] == 0o600
    assert json.loads(sandbox.files[f"{qwen_home}/settings.json"])["model"]["maxSessionTurns"] == 4
    assert env["OPENAI_API_KEY"] == "sess-abc" and env["QWEN_CODE_MAX_OUTPUT_TOKENS"] == "99"
    assert run.tools.calls_by_name == {"run_shell_command": 1, "read_file": 2} and run.tools.failures == 1


async def test_gemini_cli_run_writes_private_settings_and_counts_its_stream_json_tool_calls() -> None:
    def use(tool_id: str, name: str) -> dict[str, object]:
        return {"type": "tool_use", "tool_name": name, "tool_id": tool_id, "parameters": {}}

    def result(tool_id: str, status: str) -> dict[str, object]:
        return {"type": "tool_result", "tool_id": tool_id, "status": status}

    events = [
        {"type": "init", "session_id": "s", "model": "tiny"},
        use("t1", "read_file"),
        result("t1", "error"),
        use("t2", "run_shell_command"),
        use("t2", "run_shell_command"),
        result("t2", "success"),
        use("t3", "write_file"),
        result("t3", "success"),
        {"type": "message", "role": "assistant", "content": "Done.", "delta": True},
        {"type": "result", "status": "success"},
    ]
    sandbox = FakeSandbox(
        _writes_log("gemini-cli.jsonl", "not json\n" + "\n".join(json.dumps(e) for e in events))
    )
    run = await gemini_cli.GeminiCliHarness(max_output_tokens=99).run(
        sandbox, "say 'hi'", ENDPOINT, step_limit=4, timeout_s=42
    )
    [call] = sandbox.execs
    env, argv = call["env"], shlex.split(call["command"])
    assert argv[0] == bundle_entry(gemini_cli.PACKAGE) and argv[0].startswith(f"{AGENT_ROOT}/")
    assert argv[-4:] == ["<", "/dev/null", ">", "/logs/agent/gemini-cli.jsonl"]
    assert "--prompt=say 'hi'" in argv and call["timeout_s"] == 42 and call["cwd"] == "/app"
    home = env["GEMINI_CLI_HOME"]
    assert home.startswith("/home/user/") and home != "/home/user"
    settings_path = f"{home}/.gemini/settings.json"
    assert sandbox.modes[settings_path] == 0o600
    settings = json.loads(sandbox.files[settings_path])
    assert settings["model"]["maxSessionTurns"] == 4
    assert settings["modelConfigs"]["overrides"][0]["modelConfig"]["generateContentConfig"] == {
        "maxOutputTokens": 99
    }
    assert env["GEMINI_API_KEY"] == "sess-abc"
    assert run.tools.calls_by_name == {"read_file": 1, "run_shell_command": 1, "write_file": 1}
    assert run.tools.failures == 1
