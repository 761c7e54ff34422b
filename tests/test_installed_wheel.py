"""The package as a new user installs it: the wheel (not the editable checkout) in a fresh venv, run from a
folder outside the repository, so nothing resolves against the checkout.

The fresh venv gets the wheel alone (``pip install --no-deps``, offline); its dependencies come from this
interpreter's site-packages, added by a ``.pth`` file that lists the folders. A folder named in a ``.pth``
file joins ``sys.path`` without its own ``.pth`` files being run, so the editable install's finder there
never loads, and the venv's own site-packages (the wheel) comes first; the fixture checks that
``harness_trainer`` imports from the venv.
"""

from __future__ import annotations

import json
import os
import site
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness_trainer.examples import HERE as BUNDLED
from harness_trainer.jobs.install import build_wheel

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Installed:
    """A fresh venv holding the wheel of this checkout."""

    bin: Path
    package: Path
    """The installed ``harness_trainer`` folder, inside the venv."""
    env: dict[str, str]
    """The environment to run it in: this one without PYTHONPATH (which may name the checkout)."""

    def run(self, *command: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.bin / command[0]), *command[1:]],
            cwd=cwd, env=self.env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
        )  # fmt: skip


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    scratch = tmp_path_factory.mktemp("installed-wheel")
    wheel = build_wheel(ROOT, scratch / "wheel")
    venv = scratch / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-deps",
         "--no-index", "--disable-pip-version-check", "--quiet", str(wheel)],
        check=True,
    )  # fmt: skip
    purelib = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    Path(purelib, "deps-from-test-runner.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["HF_HUB_OFFLINE"] = "1"
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import harness_trainer; print(harness_trainer.__file__)"],
        cwd=scratch, env=env, check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    package = Path(where).parent
    assert package == Path(purelib) / "harness_trainer", (
        f"harness_trainer imported from {where}, not the wheel"
    )
    return Installed(bin=venv / "bin", package=package, env=env)


def tree(root: Path) -> dict[str, tuple[bytes, bool]]:
    """Each file under ``root`` (byte-compiled files aside): its bytes, and whether it is executable."""
    return {
        str(path.relative_to(root)): (path.read_bytes(), bool(path.stat().st_mode & stat.S_IXUSR))
        for path in sorted(root.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    }


def test_the_wheel_ships_the_bundled_task_folders_whole_with_their_executable_scripts(
    installed: Installed,
) -> None:
    shipped = tree(installed.package / "examples")
    assert shipped == tree(BUNDLED)
    assert shipped["tasks/train/hello-file/tests/test.sh"][1]
    assert any(name.startswith("toy-skills/test/") for name in shipped)


def test_dev_from_the_installed_wheel_trains_on_the_bundled_tasks_and_evaluates_their_held_out_split(
    installed: Installed, tmp_path: Path
) -> None:
    done = installed.run(
        "harness-trainer", "dev", "--harness", "toy", "--no-warmup", "--output-dir", "run",
        "--max-steps", "1", "--num-generations", "2", "--max-concurrent-rollouts", "2",
        "--max-completion-length", "32", "--no-drop-zero-variance-groups",
        cwd=tmp_path, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = tmp_path / "run"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in metrics if "loss" in row] == [1]
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run / "checkpoint-1" / "trainer_state.json").exists()
    assert json.loads((run / "run_config.json").read_text())["dev"]["tasks"] == str(
        installed.package / "examples" / "tasks"
    )
    evaluated = {json.loads(line)["task_name"] for line in (run / "eval.jsonl").read_text().splitlines()}
    assert evaluated == {"greet-script", "sum-numbers"}
    assert "training toy on 5 toy tasks" in done.stdout


def test_demo_from_the_installed_wheel_chats_with_the_dev_engine(
    installed: Installed, tmp_path: Path
) -> None:
    done = installed.run("harness-trainer", "demo", cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["ok"] is True
