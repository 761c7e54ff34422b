"""How a Hugging Face Job installs this package, which has no PyPI release: ``jobs submit --install``.

Three sources (:func:`install_request` tells them apart, before anything is built or uploaded):

- ``checkout`` (no ``--install``, the default): the wheel of the checkout this module runs from, built here
  by :func:`build_wheel` (``python -m pip wheel --no-deps``; offline with ``--no-build-isolation`` when the
  build backend, setuptools, is importable here, else pip fetches it). Nothing is written into the
  checkout: ``DIST_EXTRA_CONFIG`` sends setuptools' ``build/`` and ``*.egg-info`` to a scratch folder, so
  builds never see each other's leftovers.
- ``wheel`` (``--install PATH.whl``): a wheel on this machine, e.g. one built by hand.
- ``requirement`` (``--install`` a URL or a requirement): what pip fetches inside the job; a URL
  (``git+https://…``, ``https://…/x.whl``) becomes ``harness-trainer[EXTRAS] @ URL``, a requirement that
  names the package (``harness-trainer[e2b] @ git+https://…``, ``harness-trainer==0.2``) goes as it is.

A wheel (built or given) is copied alone into a folder that ``jobs submit`` syncs, as a volume, to the
namespace's private ``jobs-artifacts`` bucket (``HfApi.sync_job_volume``) under
``harness-trainer-wheel-<sha256[:16]>``, so a later submit with another build never replaces the wheel of a
job still queued, and the same build is not uploaded twice. The job mounts it read-only at
:data:`WHEEL_MOUNT` and runs ``python3 -m pip install --no-cache-dir 'harness-trainer[EXTRAS] @
file:///opt/harness-trainer/wheel/<wheel>'`` (:attr:`InstallSpec.pip_command`) before its launcher. A bucket
rather than a dataset repo: Jobs mount buckets, ``sync_job_volume`` makes the bucket private and returns
the volume, and the job needs no token to read it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

PROJECT = "harness-trainer"
DEFAULT_EXTRAS = ("e2b", "train")
"""The extras a job installs unless ``--extras`` says otherwise, for the default sandbox (E2B): its SDK's and
the training extras (:func:`default_extras` for another backend)."""
WHEEL_MOUNT = "/opt/harness-trainer/wheel"
"""Where the job mounts the uploaded wheel's folder (read-only)."""
PROJECT_ROOT = Path(__file__).resolve().parents[2]
"""The checkout this module runs from (for an installed, non-editable package: its site-packages)."""
BUILD_TIMEOUT_S = 600.0
_OUTPUT_TAIL_LINES = 25
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_DIRECT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\s*(\[[^\]]*\])?\s*@")
_NAMED = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\s*(\[[^\]]*\])?\s*(==|~=|>=|<=|!=|>|<|;|$)")
_EXTRA = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")
_WHEEL_NAME = re.compile(r"(?P<name>[^-]+)-(?P<version>[^-]+)(-[^-]+)?-[^-]+-[^-]+-[^-]+\.whl")

Source = Literal["checkout", "wheel", "requirement"]
WheelBuilder = Callable[[Path], Path]
"""Makes the wheel inside the given (empty) folder and returns its path; :func:`build_wheel` by default."""


class InstallError(ValueError):
    """``--install`` or ``--extras`` cannot work; the message names the option."""


class WheelBuildError(InstallError):
    """The wheel build failed; the message names the command and ends with its output's tail."""


class InstallRequest(BaseModel):
    """What ``--install`` and ``--extras`` ask for, checked; nothing is built or read yet."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: Source
    target: str | None
    """The local wheel's path (``wheel``), the pip requirement (``requirement``); None for ``checkout``."""
    extras: tuple[str, ...]


class InstallSpec(BaseModel):
    """How the job installs this package, as the dry run shows it."""

    model_config = ConfigDict(extra="forbid")

    source: Source
    requirement: str
    """The pip requirement the job installs."""
    pip_command: str
    """The exact shell command the job runs before its launcher."""
    wheel: str | None = None
    """The uploaded wheel's file name (``checkout``, ``wheel``)."""
    sha256: str | None = None
    upload_dir: str | None = None
    """The local folder synced to the bucket: the wheel alone (it lives as long as the submission)."""
    remote_name: str | None = None
    """The folder of the ``jobs-artifacts`` bucket it goes to: ``harness-trainer-wheel-<sha256[:16]>``."""


def default_extras(sandbox_extra: str | None) -> tuple[str, ...]:
    """What a job installs without ``--extras``: the extra of the sandbox backend it uses (its class's
    ``capabilities.extra``: ``hf`` brings ``huggingface_hub``'s sandboxes, ``e2b`` the E2B SDK; none for
    ``local``) and the training extras."""
    return (sandbox_extra, "train") if sandbox_extra else ("train",)


def parse_extras(text: str | None, default: tuple[str, ...] = DEFAULT_EXTRAS) -> tuple[str, ...]:
    """``e2b,train`` as a tuple; None gives ``default``; raises InstallError for a bad name."""
    if text is None:
        return default
    extras = tuple(dict.fromkeys(extra.strip() for extra in text.split(",") if extra.strip()))
    bad = [extra for extra in extras if not _EXTRA.fullmatch(extra)]
    if bad:
        raise InstallError(f"--extras {bad[0]!r} is not an extra's name")
    return extras


def install_request(
    install: str | None, extras: str | None, default: tuple[str, ...] = DEFAULT_EXTRAS
) -> InstallRequest:
    """Classify ``--install`` (see the module docstring), with ``default`` extras when ``--extras`` is not
    given; raises InstallError for a local wheel that is not there or not a wheel of this project, and for
    ``--extras`` beside a requirement that names its own."""
    chosen = parse_extras(extras, default)
    if install is None:
        return InstallRequest(source="checkout", target=None, extras=chosen)
    text = install.strip()
    if _SCHEME.match(text):
        if text.lower().startswith("file://"):
            raise InstallError(
                f"--install {install}: give a local wheel as a path (it is uploaded with the job)"
            )
        return InstallRequest(source="requirement", target=_requirement(text, chosen), extras=chosen)
    if _DIRECT.match(text) or (_NAMED.match(text) and not text.endswith(".whl")):
        named = re.match(r"[A-Za-z0-9._-]+", text)
        if named is None or _normal(named[0]) != PROJECT:
            raise InstallError(f"--install {install!r} is a requirement of another package than {PROJECT}")
        if extras is not None:
            raise InstallError(
                f"--install {install!r} names the package: put the extras in it, not in --extras"
            )
        return InstallRequest(source="requirement", target=text, extras=())
    path = Path(text).expanduser()
    if not path.is_file():
        raise InstallError(
            f"--install {install}: no such file (a local wheel is uploaded with the job; a git or wheel URL "
            "is fetched by it; leave --install out to build this checkout's wheel)"
        )
    _check_wheel_name(path, f"--install {install}")
    return InstallRequest(source="wheel", target=str(path), extras=chosen)


def prepare_install(request: InstallRequest, folder: Path, build: WheelBuilder | None = None) -> InstallSpec:
    """The job's install for ``request``: for a wheel, build it (``checkout``) or copy it (``wheel``) alone
    into ``folder``, the folder to upload, and check it provides the extras. Raises InstallError
    (:class:`WheelBuildError` when the build fails)."""
    if request.source == "requirement":
        assert request.target is not None
        return InstallSpec(
            source="requirement", requirement=request.target, pip_command=pip_command(request.target)
        )
    upload_dir = folder / "upload"
    upload_dir.mkdir(parents=True)
    if request.source == "checkout":
        built = (build or _build_here)(folder / "built")
        _check_wheel_name(built, "the built wheel")
        wheel = Path(shutil.copy2(built, upload_dir / built.name))
    else:
        assert request.target is not None
        wheel = Path(shutil.copy2(request.target, upload_dir / Path(request.target).name))
    _check_extras(wheel, request.extras)
    with wheel.open("rb") as file:
        sha256 = hashlib.file_digest(file, "sha256").hexdigest()
    requirement = _requirement(f"file://{WHEEL_MOUNT}/{wheel.name}", request.extras)
    return InstallSpec(
        source=request.source,
        requirement=requirement,
        pip_command=pip_command(requirement),
        wheel=wheel.name,
        sha256=sha256,
        upload_dir=str(upload_dir),
        remote_name=f"harness-trainer-wheel-{sha256[:16]}",
    )


def pip_command(requirement: str) -> str:
    """The shell command the job runs to install ``requirement`` into the image's Python."""
    return f"python3 -m pip install --no-cache-dir {shlex.quote(requirement)}"


def wheel_build_command(root: Path, wheel_dir: Path) -> list[str]:
    """``pip wheel`` of the project at ``root`` into ``wheel_dir``, with this Python; offline (no build
    isolation) when setuptools, the project's build backend, is importable here."""
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check", *isolation]
    return [*command, "--wheel-dir", str(wheel_dir), str(root)]


def build_wheel(root: Path, wheel_dir: Path, *, timeout_s: float = BUILD_TIMEOUT_S) -> Path:
    """Build the wheel of the project at ``root`` into ``wheel_dir`` and return it, writing nothing into
    ``root``. Raises InstallError when ``root`` is not a checkout of this project, WheelBuildError (the
    command and its output's tail) when the build fails or times out."""
    pyproject = root / "pyproject.toml"
    try:
        name = tomllib.loads(pyproject.read_text())["project"]["name"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        name = None
    if name != PROJECT:
        raise InstallError(
            f"{root} is not a checkout of {PROJECT} (an installed package has no source to build a wheel "
            "from): pass --install with a wheel or a git URL"
        )
    command = wheel_build_command(root, wheel_dir)
    print(f"building the wheel of {root}: {shlex.join(command)}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="harness-trainer-build-") as scratch:
        config = Path(scratch) / "build.cfg"
        config.write_text(f"[build]\nbuild_base = {scratch}/build\n[egg_info]\negg_base = {scratch}\n")
        env = {**os.environ, "DIST_EXTRA_CONFIG": str(config)}
        try:
            result = subprocess.run(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired as exc:
            output = exc.output.decode(errors="replace") if isinstance(exc.output, bytes) else exc.output
            raise WheelBuildError(
                _build_failure(command, f"timed out after {timeout_s:g} s", output)
            ) from exc
    if result.returncode != 0:
        raise WheelBuildError(_build_failure(command, f"exit {result.returncode}", result.stdout))
    wheels = sorted(wheel_dir.glob("*.whl"))
    if len(wheels) != 1:
        found = ", ".join(wheel.name for wheel in wheels) or "none"
        raise WheelBuildError(_build_failure(command, f"expected one wheel, found {found}", result.stdout))
    return wheels[0]


def _build_here(wheel_dir: Path) -> Path:
    return build_wheel(PROJECT_ROOT, wheel_dir)


def _build_failure(command: list[str], why: str, output: str | None) -> str:
    tail = "\n".join((output or "").rstrip().splitlines()[-_OUTPUT_TAIL_LINES:])
    return f"building the wheel failed ({why}): {shlex.join(command)}\n{tail}".rstrip()


def _requirement(url: str, extras: tuple[str, ...]) -> str:
    return f"{PROJECT}{'[' + ','.join(extras) + ']' if extras else ''} @ {url}"


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _check_wheel_name(path: Path, what: str) -> None:
    match = _WHEEL_NAME.fullmatch(path.name)
    if match is None:
        raise InstallError(f"{what}: {path.name} is not a wheel (NAME-VERSION-TAGS.whl)")
    if _normal(match["name"]) != PROJECT:
        raise InstallError(f"{what}: {path.name} is a wheel of {match['name']}, not of {PROJECT}")


def _check_extras(wheel: Path, extras: tuple[str, ...]) -> None:
    """pip only warns about an extra a package does not provide, so a typo would surface in the job."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            name = next(
                n for n in archive.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1
            )
            metadata = archive.read(name).decode()
    except (OSError, zipfile.BadZipFile, StopIteration) as exc:
        raise InstallError(f"{wheel.name}: not a readable wheel ({exc!r})") from exc
    provided = {
        _normal(line.split(":", 1)[1].strip())
        for line in metadata.splitlines()
        if line.startswith("Provides-Extra:")
    }
    unknown = [extra for extra in extras if _normal(extra) not in provided]
    if unknown:
        known = ", ".join(sorted(provided)) or "none"
        raise InstallError(f"--extras {','.join(unknown)}: {wheel.name} provides only {known}")
