"""Root filesystems for the fake E2B cloud, so that what runs in a fake sandbox sees its template's image
and not this machine.

An image's filesystem is exported once per machine from the Docker daemon (``docker export``) into
``$HT_FAKE_E2B_CACHE`` (default ``/var/tmp/ht-fake-e2b``), keyed by the image's id. An image that is not on
the daemon is stood in for as the Docker backend does (no registry is reachable): ``python:*`` by the base
image with ``python``, ``python3`` and ``pip`` (the Docker backend's ``PYTHON_STAND_IN``), anything else by
the base image itself.

A :class:`RootFs` namespace is one init process in fresh mount and PID namespaces, chrooted into an overlay:
read-only lower layers (the image's export, then each template build's own layer above it) and a writable
upper layer of its own, so a template's build and each sandbox of it write only their own layer. ``/dev``,
``/proc``, ``/etc/resolv.conf`` and ``/etc/hosts`` come from this machine (the cloud's sandboxes have
networking), and so does its CA bundle, at :data:`CA_PATH` with the usual variables in :data:`CA_ENV`
(:func:`cloud_env`): E2B reaches the internet directly, these machines through an egress proxy whose CA only
the host trusts. Commands enter it with ``nsenter -r`` (the init's root). Needs root and a Docker daemon
(``scripts/setup_docker.sh``).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

from harness_trainer.sandboxes.docker_daemon import BASE_IMAGE
from harness_trainer.sandboxes.docker_images import PYTHON_STAND_IN
from harness_trainer.sandboxes.host_trust import CA_ENV, host_ca_bundle
from harness_trainer.sandboxes.processes import Namespace, tool
from harness_trainer.sandboxes.rootless import Mode

CA_PATH = "/etc/ssl/harness-trainer-host-ca.crt"
STANDARD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PYTHON_TAG = "ht-fake-e2b-python:stand-in"
CHROOT = Mode(
    "fake-e2b",
    "fake E2B: mount + PID namespaces chrooted into an overlay of the template's image",
    (),
    ("-m", "-p", "-r"),
    needs_root=True,
)
_INIT = """
L=$1; U=$2; W=$3; M=$4; CA=$5
fail() { echo "cannot $*" >&2; exit 125; }
mount -t overlay ht-fake-e2b -o "lowerdir=$L,upperdir=$U,workdir=$W" "$M" || fail "mount the overlay"
for d in dev proc; do mkdir -p "$M/$d"; done
mount --rbind /dev "$M/dev" || fail "bind /dev"
mount -t proc proc "$M/proc" || fail "mount /proc"
mkdir -p "$M/etc"
for f in /etc/resolv.conf /etc/hosts; do
  [ -e "$M$f" ] || : > "$M$f"; mount --bind "$f" "$M$f" || fail "bind $f"
done
if [ -n "$CA" ]; then
  mkdir -p "$M$(dirname "$CA_PATH")"; : > "$M$CA_PATH"; mount --bind "$CA" "$M$CA_PATH" || fail "bind the CA"
fi
cd "$M" && exec chroot . /bin/sh -c 'echo ready; trap "" TERM INT HUP; while :; do sleep 86400 & wait; done'
"""


def cache_dir() -> Path:
    return Path(os.environ.get("HT_FAKE_E2B_CACHE") or "/var/tmp/ht-fake-e2b")


def cloud_env() -> dict[str, str]:
    """What every command and build step of the fake cloud gets: the standard PATH and the CA variables."""
    return {"PATH": STANDARD_PATH, **({name: CA_PATH for name in CA_ENV} if host_ca_bundle() else {})}


def _docker(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["docker", *args], input=stdin, capture_output=True, timeout=900)


def _stand_in(image: str) -> str:
    """The image on the daemon that ``image`` runs as (itself, or a stand-in as the Docker backend's)."""
    if _docker("image", "inspect", image).returncode == 0:
        return image
    repository = image.split("@", 1)[0].rsplit("/", 1)[-1].split(":", 1)[0]
    if repository != "python":
        return BASE_IMAGE
    if _docker("image", "inspect", PYTHON_TAG).returncode != 0:
        built = _docker(
            "build", "-q", "-t", PYTHON_TAG, "-", stdin=PYTHON_STAND_IN.format(base=BASE_IMAGE).encode()
        )
        if built.returncode != 0:
            raise RuntimeError(f"fake E2B: cannot build the python stand-in: {built.stderr.decode()[-2000:]}")
    return PYTHON_TAG


def image_env(rootfs: Path) -> dict[str, str]:
    """The ``ENV`` of the image exported to ``rootfs`` (an export has only the files: E2B, like Docker,
    starts from the image's environment too)."""
    return dict(json.loads((rootfs / ".exported-env.json").read_text()))


def image_rootfs(image: str) -> Path:
    """The exported filesystem of ``image`` (or its stand-in), made once per machine; its ``ENV`` is
    :func:`image_env`."""
    chosen = _stand_in(image)
    inspected = _docker("image", "inspect", "--format", "{{.Id}}", chosen)
    if inspected.returncode != 0:
        raise RuntimeError(f"fake E2B: image {chosen} is not on the Docker daemon (scripts/setup_docker.sh)")
    folder = cache_dir() / "images" / f"v2-{inspected.stdout.decode().strip().removeprefix('sha256:')[:16]}"
    if (folder / ".exported").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / ".exported").is_file():
            staging = folder.with_name(f"{folder.name}.{uuid.uuid4().hex[:8]}")
            staging.mkdir()
            container = _docker("create", chosen, "true").stdout.decode().strip()
            try:
                exported = subprocess.run(
                    f"docker export {container} | tar -x -C {staging}", shell=True, capture_output=True
                )
                if exported.returncode != 0:
                    raise RuntimeError(
                        f"fake E2B: cannot export {chosen}: {exported.stderr.decode()[-2000:]}"
                    )
            finally:
                _docker("rm", "-f", container)
            shutil.rmtree(folder, ignore_errors=True)
            config = _docker("image", "inspect", "--format", "{{json .Config.Env}}", chosen).stdout
            env = dict(item.partition("=")[::2] for item in json.loads(config) or [])
            (staging / ".exported-env.json").write_text(json.dumps(env))
            (staging / ".exported").write_text(chosen + "\n")
            staging.rename(folder)
    return folder


class RootFs:
    """One overlay root (``layers``: read-only, topmost first) with its own upper layer in ``folder``."""

    def __init__(self, layers: list[Path], folder: Path) -> None:
        self.layers = layers
        self.folder = folder
        self.upper = folder / "upper"
        self.namespace: Namespace | None = None

    async def start(self, timeout_s: float = 30.0) -> Namespace:
        for name in ("upper", "work", "merged"):
            (self.folder / name).mkdir(parents=True, exist_ok=True)
        ca = host_ca_bundle()
        setpriv, unshare = (tool(name) or name for name in ("setpriv", "unshare"))
        argv = [setpriv, "--pdeathsig", "KILL", unshare, "--fork", "--kill-child=KILL", "--pid", "--mount"]
        argv += ["--propagation", "private", "--", "/bin/sh", "-c", _INIT, "ht-fake-e2b"]
        argv += [":".join(map(str, self.layers)), str(self.upper), str(self.folder / "work")]
        argv += [str(self.folder / "merged"), str(ca or "")]
        env = {"PATH": os.environ.get("PATH", os.defpath), "CA_PATH": CA_PATH}
        self.namespace = await Namespace.launch(argv, env, mode=CHROOT, timeout_s=timeout_s)
        return self.namespace

    def host(self, path: str) -> Path:
        """``path`` in this root, seen from this machine (through the init's root)."""
        assert self.namespace is not None
        return Path(f"/proc/{self.namespace.init_pid}/root") / path.lstrip("/")

    async def stop(self, *, keep_upper: bool = False) -> None:
        """Kill every process in it (the overlay goes with its mount namespace); remove its folder, or all
        but its upper layer with ``keep_upper`` (a template's build, kept as a layer)."""
        if self.namespace is not None:
            await self.namespace.kill()
        for name in ("work", "merged") if keep_upper else ("upper", "work", "merged"):
            await asyncio.to_thread(shutil.rmtree, self.folder / name, True)
