"""The documentation: the MkDocs site builds with ``--strict`` (no broken link or anchor) and its
configuration reference, generated at build time, names every ``AsyncGRPOConfig`` field; nothing in the
repository points outside it; the README's and the other markdown files' relative links resolve; and
``harness-trainer --help`` speaks to a user."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from harness_trainer.trainer.config.async_grpo import AsyncGRPOConfig

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
# Paths of the machines this was built on, outside the repository (this file is not searched).
OUTSIDE = re.compile(r"\.\./+shared\b|/work/shared|/work/\.library|\.library/")


def field_names(cls: type, prefix: str = "") -> list[str]:
    """Every field of a config dataclass, a nested dataclass's as ``outer.inner``."""
    hints = typing.get_type_hints(cls)
    names = []
    for f in dataclasses.fields(cls):
        names.append(prefix + f.name)
        kinds = [hints[f.name], *typing.get_args(hints[f.name])]
        inner = next((k for k in kinds if isinstance(k, type) and dataclasses.is_dataclass(k)), None)
        if inner is not None:
            names += field_names(inner, f"{prefix}{f.name}.")
    return names


def repository_files() -> list[Path]:
    """Tracked files and new ones git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    return [ROOT / name for name in listed if name and (ROOT / name).is_file()]


def relative_links(markdown: str) -> list[str]:
    """The relative link targets of a markdown text (no URLs, in-page anchors or absolute paths),
    outside fenced code."""
    targets = LINK.findall(FENCE.sub("", markdown))
    return [
        t for t in targets if not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", t) and not t.startswith(("#", "/"))
    ]


@pytest.mark.slow
def test_the_site_builds_strict_and_its_config_reference_names_every_field(tmp_path: Path) -> None:
    site = tmp_path / "site"
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-6000:]
    page = (site / "configuration" / "index.html").read_text()
    names = field_names(AsyncGRPOConfig)
    assert len(names) > 50
    missing = [name for name in names if f"<code>{name}</code>" not in page]
    assert not missing, f"fields missing from the configuration reference: {missing}"
    assert "top_p" in page and "dataloader_num_workers" in page  # TRL's refused and ignored tables
    for page_dir in ("getting-started", "rollouts", "capture-proxy", "sandboxes", "benchmarks", "jobs"):
        assert (site / page_dir / "index.html").is_file(), page_dir


def test_nothing_in_the_repository_points_outside_it() -> None:
    found = []
    for path in repository_files():
        if path == Path(__file__).resolve() or path.stat().st_size > 2_000_000:
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if OUTSIDE.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("name", ["README.md", "examples/async_grpo_harbor/README.md"])
def test_each_relative_link_of_the_readmes_resolves_to_a_file(name: str) -> None:
    links = relative_links((ROOT / name).read_text())
    assert links or name != "README.md"
    broken = [
        link for link in links if not (ROOT / name).parent.joinpath(link.split("#")[0]).resolve().exists()
    ]
    assert not broken, f"{name}: {broken}"


def test_no_markdown_link_leaves_the_repository() -> None:
    escaping = []
    for path in repository_files():
        if path.suffix != ".md":
            continue
        for link in relative_links(path.read_text(errors="replace")):
            target = path.parent.joinpath(link.split("#")[0]).resolve()
            if not target.is_relative_to(ROOT):
                escaping.append(f"{path.relative_to(ROOT)}: {link}")
    assert not escaping, "\n".join(escaping)


def test_the_readme_keeps_the_commands_ci_runs() -> None:
    text = (ROOT / "README.md").read_text()
    for marker in ("<!-- demo-command -->", "<!-- test-command -->"):
        after = text.split(marker, 1)[1].lstrip("\n")
        assert after.startswith("```bash\n"), marker


@pytest.mark.slow
def test_the_cli_help_describes_the_tool_to_a_user() -> None:
    script = shutil.which("harness-trainer") or str(Path(sys.executable).parent / "harness-trainer")
    result = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    first = "Train LLMs with reinforcement learning (async GRPO) on the behaviour of real coding agents."
    assert first in text
    assert "``" not in text and '"""' not in text and "Parses arguments" not in text
    assert "harness-trainer dev" in text and "docs/" in text
