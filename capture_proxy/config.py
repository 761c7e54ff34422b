"""The proxy's configuration, shared by the CLI and :func:`capture_proxy.app.build_app`."""

from __future__ import annotations

import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

ADMIN_KEY_ENV = "CAPTURE_PROXY_ADMIN_KEY"
ADMIN_KEY_FILE = "admin_key"


class ConfigError(ValueError):
    """A configuration the proxy refuses to start with."""


@dataclass
class ProxyConfig:
    upstream: str
    """Engine base URL (vLLM or the dev engine), e.g. ``http://127.0.0.1:8000``: where a session's calls go
    unless it names another engine."""
    data_dir: Path
    """Where sessions and journals live; reloaded on start."""
    admin_key: str | None = None
    """Bearer key for the admin routes; defaults to $CAPTURE_PROXY_ADMIN_KEY. Required off loopback."""
    host: str = "127.0.0.1"
    port: int = 8300
    public_url: str | None = None
    """How agents reach the proxy (for ``base_url`` in minted sessions); default ``http://host:port``."""
    served_model: str | None = None
    """Model name sent upstream; default: the first of the engine's ``/v1/models``."""
    allowed_upstreams: tuple[str, ...] = ()
    """Further engines a session may name (``SessionSpec.upstream``); no other is ever forwarded to, so the
    proxy is no open relay."""
    replicas: bool = False
    """Every engine (``upstream`` and ``allowed_upstreams``) is a replica of one model: sessions that name no
    engine are pinned to one, placed on the least loaded and moved off one that stops answering (see
    :mod:`capture_proxy.replicas`); engines serving different models are refused at start."""
    probe_interval_s: float = 5.0
    """With ``replicas``: seconds between probes of a replica that stopped answering, and between readings of
    each healthy one's engine start time (rule 8 of :mod:`capture_proxy.replicas`)."""
    upstream_api_key: str | None = None
    upstream_timeout_s: float = 600.0
    upstream_pool: int = 512
    """Connections to the engine at most (calls beyond it wait for one)."""
    upstream_attempts: int = 3
    retry_backoff_s: float = 0.5
    max_retry_after_s: float = 10.0
    keepalive_s: float = 5.0
    """A streaming client whose call takes longer than this gets headers and a keepalive comment."""
    max_body_bytes: int = 32 * 1024 * 1024
    io_threads: int = 4
    tune_gc: bool = False
    """Freeze start-up objects, collect less often (process-wide: set by the CLI, which owns the process)."""

    def resolved(self) -> ProxyConfig:
        """A copy with the admin key taken from the environment where not given, checked."""
        key = self.admin_key or os.environ.get(ADMIN_KEY_ENV) or None
        if key is None and not is_loopback(self.host):
            raise ConfigError(
                f"refusing to bind {self.host} without an admin key: pass --admin-key or set {ADMIN_KEY_ENV}"
            )
        if self.upstream_attempts < 1:
            raise ConfigError("upstream_attempts must be >= 1")
        if self.probe_interval_s <= 0:
            raise ConfigError("probe_interval_s must be > 0")
        fields = {**self.__dict__, "admin_key": key, "data_dir": Path(self.data_dir)}
        return ProxyConfig(**{**fields, "allowed_upstreams": tuple(self.allowed_upstreams)})

    @property
    def engines(self) -> list[str]:
        """Every engine a session may use, default first, each spelled by :func:`engine_root`."""
        roots = [engine_root(url) for url in (self.upstream, *self.allowed_upstreams)]
        return list(dict.fromkeys(roots))

    @property
    def base_url(self) -> str:
        return (self.public_url or f"http://{self.host}:{self.port}").rstrip("/")


def engine_root(url: str) -> str:
    """An engine's base URL in one spelling: no trailing ``/`` or ``/v1`` (how engines are compared)."""
    root = url.strip().rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def stored_admin_key(data_dir: Path) -> str:
    """The admin key kept in ``data_dir/admin_key`` (mode 0600), made on first use.

    For a proxy started without a key: agents in local sandboxes share the host's loopback, so admin routes
    left open there would let any agent list and read every session. The file outlives restarts, so a
    restarted proxy keeps its key, and only who can read the data directory can use it.
    """
    path = Path(data_dir) / ADMIN_KEY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        key = path.read_text().strip()
        if not key:
            raise ConfigError(f"{path} is empty: delete it (a new key is made) or pass --admin-key") from None
        return key
    key = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as file:
        file.write(key + "\n")
    return key
