"""The Dockerfile subset, parsed and planned as pure functions (no sandbox, no filesystem)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness_trainer.sandboxes.dockerfile import CopyStep, DockerfileError, RunStep, expand, parse, plan

BASE = {"PATH": "/usr/bin:/bin", "HOME": "/home/user"}


def test_continuations_are_joined_and_comments_dropped_keeping_the_first_line_number() -> None:
    text = (
        "# syntax comment\nFROM python:3.11\n\nRUN apt-get update && \\\n"
        "    # a comment inside\n\n    apt-get install -y git\nWORKDIR /app\n"
    )
    instructions = parse(text)
    assert [(i.keyword, i.line) for i in instructions] == [("FROM", 2), ("RUN", 4), ("WORKDIR", 8)]
    assert instructions[1].args == "apt-get update &&     apt-get install -y git"


def test_keywords_are_case_insensitive() -> None:
    assert [i.keyword for i in parse("from x\nworkdir /w\n")] == ["FROM", "WORKDIR"]


def test_expand_handles_docker_forms() -> None:
    variables = {"A": "1", "EMPTY": ""}
    assert (
        expand("$A ${A} ${B:-dflt} ${A:+alt} ${EMPTY:+alt} \\$A $MISSING.", variables) == "1 1 dflt alt  $A ."
    )


def test_env_in_both_forms_and_values_from_before_the_instruction() -> None:
    text = 'FROM x\nENV A=1 B="two words"\nENV C three more words\nENV A=2 D=$A\nENV PATH=/opt/bin:$PATH\n'
    result = plan(parse(text), base_env=BASE)
    assert result.env == {
        "A": "2",
        "B": "two words",
        "C": "three more words",
        "D": "1",
        "PATH": "/opt/bin:/usr/bin:/bin",
    }


def test_arg_defaults_are_substituted_and_given_to_run_but_not_to_the_runtime_env() -> None:
    text = (
        "ARG VERSION=3.11\nFROM python:${VERSION}\nARG NAME=tool\nENV TOOL_HOME=/opt/$NAME\nRUN echo $NAME\n"
    )
    result = plan(parse(text), base_env=BASE)
    assert result.base_image == "python:3.11"
    assert result.env == {"TOOL_HOME": "/opt/tool"}
    (run,) = result.steps
    assert isinstance(run, RunStep) and run.env["NAME"] == "tool" and run.env["TOOL_HOME"] == "/opt/tool"


def test_workdir_resolves_relative_paths_and_defaults_to_app() -> None:
    assert plan(parse("FROM x\n"), base_env=BASE).workdir == "/app"
    result = plan(parse("FROM x\nWORKDIR /srv\nWORKDIR project\nRUN make\n"), base_env=BASE)
    assert result.workdir == "/srv/project"
    assert result.written_dirs == ("/srv", "/srv/project")
    assert isinstance(result.steps[0], RunStep) and result.steps[0].cwd == "/srv/project"


def test_run_shell_form_uses_sh_and_exec_form_needs_no_shell() -> None:
    result = plan(parse('FROM x\nRUN echo "a b" | wc -c\nRUN ["python3", "-c", "print(1)"]\n'), base_env=BASE)
    shell, exec_form = result.steps
    assert isinstance(shell, RunStep) and shell.command == "/bin/sh -c 'echo \"a b\" | wc -c'"
    assert isinstance(exec_form, RunStep) and exec_form.command == "python3 -c 'print(1)'"


def test_copy_forms_resolve_destinations() -> None:
    text = (
        "FROM x\nWORKDIR /app\nCOPY --chown=1:1 --chmod=755 run.sh ./\n"
        'COPY ["a b.txt", "/data/c.txt"]\nCOPY *.py lib/\nADD src/ /app/src\nCOPY tool /opt/tool\n'
    )
    steps = plan(parse(text), base_env=BASE).steps
    assert steps == (
        CopyStep(("run.sh",), "/app", True, 0o755, False, 3),
        CopyStep(("a b.txt",), "/data/c.txt", False, None, False, 4),
        CopyStep(("*.py",), "/app/lib", True, None, False, 5),
        CopyStep(("src/",), "/app/src", True, None, True, 6),
        CopyStep(("tool",), "/opt/tool", False, None, False, 7),
    )
    assert plan(parse(text), base_env=BASE).written_dirs == ("/app", "/data", "/app/lib", "/app/src", "/opt")


def test_a_directory_source_in_the_context_makes_the_destination_a_directory(tmp_path: Path) -> None:
    (tmp_path / "tool").mkdir()
    result = plan(parse("FROM x\nCOPY tool /opt/tool\n"), base_env=BASE, context=tmp_path)
    assert result.written_dirs == ("/app", "/opt/tool")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('FROM x\nWORKDIR /app\n\nCMD ["bash"]\n', "line 4: CMD is not supported"),
        ("FROM x\nEXPOSE 80\n", "line 2: EXPOSE"),
        ("FROM x\nUSER app\n", "line 2: USER"),
        ("FROM x\nLABEL a=b\n", "line 2: LABEL"),
        ('FROM x\nENTRYPOINT ["x"]\n', "line 2: ENTRYPOINT"),
        ("FROM x\nHEALTHCHECK CMD true\n", "line 2: HEALTHCHECK"),
        ('FROM x\nSHELL ["/bin/bash", "-c"]\n', "line 2: SHELL"),
        ("FROM a AS build\nRUN make\nFROM b\n", "line 3: a second FROM"),
        ("FROM x\nCOPY --from=build /out /app\n", "line 2: COPY --from is not supported"),
        ("FROM x\nADD https://example.com/f.tgz /app/\n", "line 2: ADD from a URL"),
        ("FROM x\nRUN --mount=type=cache,target=/root/.cache pip install x\n", "line 2: RUN flags"),
        ("FROM x\nRUN <<EOF\necho hi\nEOF\n", "line 2: RUN is not supported"),
        ("FROM x\nCOPY onlyone\n", "line 2: COPY needs at least one source"),
        ("FROM x\nENV\n", "line 2: ENV needs"),
        ('FROM x\nRUN ["broken"\n', "line 2: RUN has broken JSON"),
    ],
)
def test_unsupported_instructions_are_refused_with_their_line(text: str, needle: str) -> None:
    with pytest.raises(DockerfileError, match=needle):
        plan(parse(text), base_env=BASE)


def test_non_strict_plan_skips_what_it_does_not_apply() -> None:
    text = 'FROM x\nUSER app\nWORKDIR /home/app\nEXPOSE 8080\nCMD ["serve"]\n'
    assert plan(parse(text), base_env=BASE, strict=False).workdir == "/home/app"
