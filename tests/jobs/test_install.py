"""How a job installs this package: ``--install`` told apart, and the wheel built from the checkout."""

from __future__ import annotations

import re
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from harness_trainer.jobs.install import (
    DEFAULT_EXTRAS,
    InstallError,
    InstallRequest,
    build_wheel,
    default_extras,
    install_request,
    wheel_build_command,
)
from tests.jobs.conftest import ROOT

GIT_URL = "git+https://github.com/org/harness-trainer@v0.2"


@pytest.mark.slow
def test_the_session_wheel_is_this_checkouts_package(project_wheel: Path) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert project_wheel.name == f"harness_trainer-{version}-py3-none-any.whl"
    names = zipfile.ZipFile(project_wheel).namelist()
    assert {"harness_trainer/jobs/install.py", "harness_trainer/cli.py", "capture_proxy/app.py"} <= set(names)
    # The bundled task folders (the dev loop's default tasks, the toy-skills family) are package data.
    assert {
        "harness_trainer/examples/tasks/train/hello-file/tests/test.sh",
        "harness_trainer/examples/tasks/test/sum-numbers/task.toml",
        "harness_trainer/examples/toy-skills/test/make-dir-705-w0/solution/solve.sh",
    } <= set(names)
    assert not any(name.startswith("tests/") for name in names)


@pytest.mark.slow  # a real pip wheel build
def test_a_wheel_build_writes_nothing_into_the_project(tmp_path: Path) -> None:
    project = tmp_path / "project"
    (project / "harness_trainer").mkdir(parents=True)
    (project / "harness_trainer" / "__init__.py").write_text("VALUE = 1\n")
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "harness-trainer"\nversion = "9.9"\n'
    )
    before = sorted(str(path.relative_to(project)) for path in project.rglob("*"))
    wheel = build_wheel(project, tmp_path / "wheels")
    assert wheel == tmp_path / "wheels" / "harness_trainer-9.9-py3-none-any.whl"
    assert "harness_trainer/__init__.py" in zipfile.ZipFile(wheel).namelist()
    assert sorted(str(path.relative_to(project)) for path in project.rglob("*")) == before


def test_a_folder_that_is_not_this_project_is_refused_before_building(tmp_path: Path) -> None:
    with pytest.raises(
        InstallError, match=f"^{re.escape(str(tmp_path))} is not a checkout of harness-trainer"
    ):
        build_wheel(tmp_path, tmp_path / "wheels")
    assert not (tmp_path / "wheels").exists()


def test_the_build_is_offline_when_setuptools_is_here(tmp_path: Path) -> None:
    command = wheel_build_command(ROOT, tmp_path)
    assert command[:5] == [sys.executable, "-m", "pip", "wheel", "--no-deps"]
    assert "--no-build-isolation" in command and command[-3:] == ["--wheel-dir", str(tmp_path), str(ROOT)]


def test_no_install_builds_the_checkout_with_the_default_extras() -> None:
    assert install_request(None, None) == InstallRequest(
        source="checkout", target=None, extras=DEFAULT_EXTRAS
    )
    assert install_request(None, "train, e2b,train").extras == ("train", "e2b")
    assert install_request(None, None, default_extras("hf")).extras == ("hf", "train")
    assert default_extras(None) == ("train",) and default_extras("e2b") == DEFAULT_EXTRAS


@pytest.mark.parametrize(
    ("install", "extras", "target"),
    [
        (GIT_URL, None, f"harness-trainer[e2b,train] @ {GIT_URL}"),
        (GIT_URL, "", f"harness-trainer @ {GIT_URL}"),
        (f"Harness_Trainer[train] @ {GIT_URL}", None, f"Harness_Trainer[train] @ {GIT_URL}"),
        ("harness-trainer>=0.2", None, "harness-trainer>=0.2"),
    ],
)
def test_a_url_gets_the_extras_and_a_requirement_naming_the_package_goes_as_it_is(
    install: str, extras: str | None, target: str
) -> None:
    request = install_request(install, extras)
    assert (request.source, request.target) == ("requirement", target)


def test_a_local_wheel_of_this_project_is_taken_and_any_other_file_refused(tmp_path: Path) -> None:
    wheel = tmp_path / "harness_trainer-0.3-py3-none-any.whl"
    wheel.write_bytes(b"")
    assert install_request(str(wheel), None) == InstallRequest(
        source="wheel", target=str(wheel), extras=DEFAULT_EXTRAS
    )
    other = tmp_path / "other_pkg-1.0-py3-none-any.whl"
    other.write_bytes(b"")
    with pytest.raises(InstallError, match="is a wheel of other_pkg, not of harness-trainer"):
        install_request(str(other), None)
    notes = tmp_path / "notes.txt"
    notes.write_text("")
    with pytest.raises(InstallError, match=r"notes.txt is not a wheel \(NAME-VERSION-TAGS.whl\)"):
        install_request(str(notes), None)
    with pytest.raises(InstallError, match="no such file"):
        install_request("harness_trainer-0.3-py3-none-any.whl", None)
