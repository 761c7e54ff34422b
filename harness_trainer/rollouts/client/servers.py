"""The rollout servers behind one :class:`~harness_trainer.rollouts.client.factory.HarborSessionFactory`.

A :class:`ServerPool` holds, per server, its HTTP client (made on use), the factory's metadata session
there, its capacity (``max_concurrent_envs`` from ``GET /health``), the sessions the factory has open
there, and whether it is up. The contract:

- Placement: the members of one GRPO group (episode ids ``group{G}-member{M}``: key ``group{G}``) go to
  one server; a new group, or any other create, goes to the up server with the most free capacity
  (capacity minus the factory's open sessions there, its metadata session included), ties by order
  (:func:`pick_server`). A group's pin is released when its last open session closes.
- A request that fails with no HTTP status (refused, reset, timed out) marks its server down (one
  warning naming it). Every session placed on it before that keeps raising :class:`RolloutServerError`
  (counted as lost: its rollout is unscorable, and it may have missed a policy change); new groups, and a
  down server's group's later members, go to the others.
- Policies (``PUT /policy``) go to every up server; one that is unreachable is marked down and skipped;
  the call raises only when no server took it. The pool remembers the last policy sent.
- A down server is probed (``GET /health``) at most every :data:`PROBE_EVERY_S` when placing (at once
  when no server is up); one that answers is sent the last policy first and only then takes rollouts, so
  it never samples with a stale policy.
- Thread-safe: the trainer creates and closes sessions from several threads.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

log = logging.getLogger(__name__)
PROBE_EVERY_S = 10.0
"""How often, at most, a down server is asked whether it is back (read at each placement)."""
POLL_S = 30.0
"""The longest long poll a session sends (the client's timeout is the request timeout plus this)."""
_CLOSE_TIMEOUT_S = 5.0
"""Closing on a down server: one short try (it may be a blip), never the full request timeout."""
_GROUP = re.compile(r"^group(\d+)-member\d+$")


class RolloutServerError(RuntimeError):
    """The rollout server refused (``status``, its HTTP status) or could not be reached (``status`` None)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def group_of(episode_id: str | None) -> str | None:
    """The GRPO group an episode id (``group{G}-member{M}``, the trainer's) belongs to; None for others."""
    index = group_index(episode_id)
    return None if index is None else f"group{index}"


def group_index(episode_id: str | None) -> int | None:
    """The index of the GRPO group an episode id of the trainer's names; None for others."""
    match = _GROUP.match(episode_id or "")
    return int(match.group(1)) if match else None


def pick_server(servers: Sequence[tuple[bool, int, int]]) -> int | None:
    """Of ``(up, capacity, open)`` per server: the index of the up one with the most free capacity (ties:
    the first), or None when none is up. A full pick is still a pick: its server answers 429, as one
    server alone would."""
    best: int | None = None
    for index, (up, capacity, opened) in enumerate(servers):
        if up and (best is None or capacity - opened > servers[best][1] - servers[best][2]):
            best = index
    return best


@dataclass(eq=False)
class Server:
    url: str
    capacity: int = 0
    opened: int = 0
    """Sessions the factory holds open here (its metadata session included)."""
    up: bool = True
    epoch: int = 0
    """Bumped each time the server is marked down: a session placed in an earlier epoch is lost."""
    probed: float = 0.0
    probing: bool = False
    placed: int = 0
    lost: int = 0
    metadata_session: str | None = None
    client: httpx.Client | None = None

    def http(self, timeout_s: float) -> httpx.Client:
        if self.client is None:
            self.client = httpx.Client(base_url=self.url, timeout=timeout_s + POLL_S)
        return self.client

    def send(self, method: str, path: str, timeout_s: float, **kwargs: Any) -> Any:
        """One request; :class:`RolloutServerError` with the status, or none when unreachable."""
        try:
            response = self.http(timeout_s).request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise RolloutServerError(f"rollout server {self.url} unreachable: {exc!r}") from exc
        if response.status_code >= 400:
            message = f"{method} {path}: {response.status_code} {error_message(response)}"
            raise RolloutServerError(message, status=response.status_code)
        return response.json()


@dataclass(eq=False)
class Placement:
    """Where one session runs: its server, the server's epoch then, and its group (if any)."""

    server: Server
    epoch: int
    group: str | None
    lost: bool = False
    released: bool = False


@dataclass(eq=False)
class ServerPool:
    urls: Sequence[str]
    timeout_s: float
    servers: list[Server] = field(init=False)
    policy: dict[str, Any] = field(init=False, default_factory=dict)
    """The last policy sent (``model`` and/or ``version``): what a server coming back gets first."""

    def __post_init__(self) -> None:
        self.servers = [Server(url) for url in self.urls]
        self._lock = threading.Lock()  # placement state: pins, open counts, up/down
        self._policy_lock = threading.Lock()  # a policy change and a server's return never interleave
        self._pins: dict[str, Server] = {}
        self._members: dict[str, int] = {}

    def __getstate__(self) -> dict[str, Any]:
        # Settings only: another process's pool starts with every server up and nothing open there.
        return {"urls": list(self.urls), "timeout_s": self.timeout_s, "capacity": self.capacities()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.urls, self.timeout_s, self.policy = state["urls"], state["timeout_s"], {}
        self.__post_init__()
        for server, capacity in zip(self.servers, state["capacity"], strict=True):
            server.capacity = capacity

    def capacities(self) -> list[int]:
        return [server.capacity for server in self.servers]

    def primary(self) -> Server:
        """The first up server (the first of all when none is up): it answers the task listing."""
        return next((server for server in self.servers if server.up), self.servers[0])

    def call(self, server: Server, method: str, path: str, **kwargs: Any) -> Any:
        try:
            return server.send(method, path, self.timeout_s, **kwargs)
        except RolloutServerError as exc:
            if exc.status is None:
                self.mark_down(server, exc)
            raise

    def mark_down(self, server: Server, why: BaseException) -> None:
        with self._lock:
            if not server.up:
                return
            server.up, server.epoch, server.probed = False, server.epoch + 1, time.monotonic()
            others = sum(other.up for other in self.servers)
        log.warning(
            "rollout server %s is down (%s): its open rollouts are lost (unscorable); %d other server(s) up "
            "take new ones; it is probed again every %.0f s",
            server.url, why, others, PROBE_EVERY_S,
        )  # fmt: skip

    def open_metadata_session(self, server: Server) -> None:
        """The factory's metadata session on ``server`` (one per server, opened once; it takes a slot)."""
        if server.metadata_session is None:
            server.metadata_session = self.call(server, "POST", "/sessions")["session_id"]
            with self._lock:
                server.opened += 1

    def place(self, group: str | None) -> Placement:
        """A slot for one session (see the module docstring); release it with :meth:`release`."""
        self._revive_due()
        with self._lock:
            server = self._pins.get(group) if group is not None else None
            if server is None or not server.up:
                index = pick_server([(s.up, s.capacity, s.opened) for s in self.servers])
                if index is None:
                    raise RolloutServerError(
                        f"no rollout server is up: all {len(self.servers)} ({', '.join(self.urls)}) are "
                        "unreachable"
                    )
                server = self.servers[index]
                if group is not None:
                    self._pins[group] = server  # a down server's group moves for its later members
            server.opened += 1
            server.placed += 1
            if group is not None:
                self._members[group] = self._members.get(group, 0) + 1
            return Placement(server, server.epoch, group)

    def release(self, placement: Placement) -> None:
        with self._lock:
            if placement.released:
                return
            placement.released = True
            placement.server.opened -= 1
            if placement.group is not None:
                self._members[placement.group] -= 1
                if self._members[placement.group] == 0:
                    del self._members[placement.group], self._pins[placement.group]

    def session_call(self, placement: Placement, method: str, path: str, **kwargs: Any) -> Any:
        """A request of a placed session: it fails once its server has been down since it was placed."""
        server = placement.server
        if server.epoch != placement.epoch:
            self._lose(placement)
            raise RolloutServerError(
                f"rollout server {server.url} went away during this rollout (it may have missed a policy "
                "change); the rollout is lost"
            )
        try:
            return self.call(server, method, path, **kwargs)
        except RolloutServerError as exc:
            if exc.status is None:
                self._lose(placement)
            raise

    def close_session(self, placement: Placement, session_id: str) -> None:
        """Free a session's slot on its server, on every path (a gone server's slot is gone with it)."""
        try:
            timeout = self.timeout_s if placement.server.up else _CLOSE_TIMEOUT_S
            placement.server.send("DELETE", f"/sessions/{session_id}", self.timeout_s, timeout=timeout)
        except RolloutServerError:
            pass  # already gone (server restarted or down); closing twice or late is not an error
        finally:
            self.release(placement)

    def _lose(self, placement: Placement) -> None:
        with self._lock:
            if not placement.lost:
                placement.lost = True
                placement.server.lost += 1

    def _revive_due(self) -> None:
        """Probe the down servers that are due (all at once when none is up); bring back those that answer."""
        now = time.monotonic()
        with self._lock:
            none_up = not any(server.up for server in self.servers)
            due = [
                server
                for server in self.servers
                if not server.up and not server.probing and (none_up or now - server.probed >= PROBE_EVERY_S)
            ]
            for server in due:
                server.probing, server.probed = True, now
        for server in due:
            try:
                self._revive(server)
            finally:
                server.probing = False

    def _revive(self, server: Server) -> None:
        try:
            health = server.send("GET", "/health", self.timeout_s, timeout=_CLOSE_TIMEOUT_S)
        except RolloutServerError:
            return  # still down
        with self._policy_lock:
            try:
                if self.policy:  # the policy it missed, before any rollout
                    server.send("PUT", "/policy", self.timeout_s, json=self.policy)
            except RolloutServerError as exc:
                log.warning("rollout server %s answers but did not take the policy: %s", server.url, exc)
                return  # still down: it must not sample with a stale policy
            if server.metadata_session is not None:  # after a blip it still holds it; after a restart not
                stale, server.metadata_session = server.metadata_session, None
                with self._lock:
                    server.opened -= 1
                try:
                    server.send("DELETE", f"/sessions/{stale}", self.timeout_s, timeout=_CLOSE_TIMEOUT_S)
                except RolloutServerError:
                    pass
            with self._lock:
                server.capacity = int(health.get("max_concurrent_envs", server.capacity))
                server.up = True
        log.warning("rollout server %s is back (sent the last policy %s); it takes new rollouts", server.url,
                    self.policy or "(none yet)")  # fmt: skip

    def set_policy(self, body: dict[str, Any]) -> None:
        """``PUT /policy`` to every up server; remembered for servers coming back (module docstring)."""
        with self._policy_lock:
            took, gone = 0, []
            for server in [s for s in self.servers if s.up]:
                try:
                    self.call(server, "PUT", "/policy", json=body)
                    took += 1
                except RolloutServerError as exc:
                    if exc.status is not None:
                        raise  # refused (a bad policy): every server would refuse it; not remembered
                    gone.append(f"{server.url}: {exc}")
            if not took:
                raise RolloutServerError(
                    "no rollout server is up to take the policy " + (f"({'; '.join(gone)})" if gone else "")
                )
            self.policy = {**self.policy, **{k: v for k, v in body.items() if v is not None}}

    def report(self) -> list[dict[str, Any]]:
        """Per server: ``url``, ``up``, ``open`` (sessions held, metadata included), ``capacity``,
        ``placed`` and ``lost`` rollouts (lost: its server went away during it)."""
        with self._lock:
            return [
                {"url": s.url, "up": s.up, "open": s.opened, "capacity": s.capacity, "placed": s.placed,
                 "lost": s.lost}
                for s in self.servers
            ]  # fmt: skip

    def close(self) -> None:
        """Close the metadata session and the client of every server, up or not, on every path."""
        for server in self.servers:
            try:
                if server.metadata_session is not None:
                    timeout = self.timeout_s if server.up else _CLOSE_TIMEOUT_S
                    path = f"/sessions/{server.metadata_session}"
                    server.send("DELETE", path, self.timeout_s, timeout=timeout)
            except RolloutServerError:
                pass  # the server may be gone; nothing of ours is left to leak there
            finally:
                if server.metadata_session is not None:
                    server.metadata_session = None
                    with self._lock:
                        server.opened -= 1
                if server.client is not None:
                    server.client.close()
                    server.client = None


def error_message(response: httpx.Response) -> str:
    """A rollout server's error reply's message (``{"error": {"message"}}``), else the start of its body."""
    try:
        error = response.json().get("error", {})
        return str(error.get("message", response.text[:500]))
    except (ValueError, AttributeError):
        return response.text[:500]
