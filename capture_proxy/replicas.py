"""Engine replicas behind one proxy: session affinity, least-loaded placement, failover and probing back in.

With ``ProxyConfig.replicas`` set, every ``--upstream`` engine is a replica of one model (checked at start,
below), in flag order: replica 0 is the first. Sessions that name their own engine (``SessionSpec.upstream``)
are never routed here; they stay on it, as without replicas.

Rules (the contract of this module):
1. *Affinity.* A session is pinned to one replica on its first call and every later call goes there, so its
   growing prompt stays in that replica's prefix cache.
2. *Placement.* A session without a pin (new, or whose replica left rotation) is pinned to the replica in
   rotation with the fewest sessions **pinned** (sessions pinned to it and not deleted; a session's pin is
   dropped by ``DELETE /sessions/{id}``, so a finished session counts until its owner deletes it); ties go to
   the lowest index. Pins live in memory: a restarted proxy pins each session again on its next call.
3. *In rotation* = healthy and not drained. A replica is judged down when a call to it fails past the
   upstream's retries with no answer from it (connection refused or reset, timeouts, a dropped reply:
   :attr:`UpstreamResult.unreachable`); an engine that answers, even with a 5xx or a 429, stays up.
4. *Failover.* The call that judged its replica down is sent again, whole, to a replica placed by rule 2,
   and the session is pinned there; this is safe because the request is the agent's whole history. Each
   replica is tried at most once per call. With no replica in rotation, a session keeps its pin (or gets
   replica 0) and its call fails as it would with one engine.
5. *Probing.* Every ``probe_interval_s`` each down replica is asked for ``/v1/models``; one that answers
   with the set's model rejoins rotation (sessions already moved stay where they are).
6. *Draining.* :meth:`ReplicaSet.drain` takes a replica out of rotation by hand (its calls in flight
   finish; its sessions move on their next call), :meth:`ReplicaSet.enable` puts it back
   (``POST /replicas/{i}/drain`` and ``/enable``). Probing does not undo a drain.
7. *Start-up check.* Each replica's ``/v1/models`` is asked once: with ``served_model`` configured, every
   replica that answers must list it; without, their first models must be the same. Otherwise the proxy
   refuses to start (:class:`ConfigError` naming both engines and their models). A replica that does not
   answer starts down and is probed in once it serves the set's model.
8. *Stale after a restart.* While a policy version is set (``PUT /policy``: the trainer has pushed weights
   that the replicas' start-up weights are not), a replica whose engine may have restarted is *stale*: out
   of rotation until ``POST /replicas/{i}/enable`` (the trainer's, once it gave the replica the current
   version). The restart is told by the engine's ``process_start_time_seconds`` on its Prometheus
   ``/metrics``, read at the start-up check, when a probe finds a down replica answering again, and on every
   probe from each healthy replica. A replica probed back in is stale unless its start time is known and
   unchanged since it was last read; a healthy one is stale once its start time changes. The latest start
   time read is the one the next is compared with, so a restart is reported once, and an enable needs no
   new reading. Without a policy version, start times are only recorded: every engine serves its start-up
   weights. A page without the line (or that cannot be read) changes nothing on a healthy replica and leaves
   one probed back in stale. With every replica stale, a call fails (502 to the agent, as when no engine
   answers) without being sent: rule 4 would otherwise send it to old weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from capture_proxy.config import ConfigError
from capture_proxy.upstream import Upstream, UpstreamResult

log = logging.getLogger(__name__)
PROBE_TIMEOUT_S = 5.0


@dataclass
class Replica:
    index: int
    upstream: Upstream
    healthy: bool = True
    drained: bool = False
    sessions: int = 0
    """Sessions pinned here (rule 2)."""
    calls: int = 0
    """Calls sent here (a failover counts one call on each replica tried)."""
    failures: int = 0
    """Calls here that failed past the retries without an answer (each took the replica out of rotation)."""
    stale: bool = False
    """Its engine may have restarted with its start-up weights since a policy version was set (rule 8)."""
    start_time: float | None = None
    """The engine's ``process_start_time_seconds`` as last read (None: never read, or not on its page)."""

    @property
    def in_rotation(self) -> bool:
        return self.healthy and not self.drained and not self.stale

    def to_json(self) -> dict[str, object]:
        return {
            "index": self.index,
            "engine": self.upstream.root,
            "healthy": self.healthy,
            "drained": self.drained,
            "stale": self.stale,
            "sessions": self.sessions,
            "calls": self.calls,
            "failures": self.failures,
        }


class ReplicaSet:
    """The replicas and each session's pin; its methods run on the event loop, without awaiting."""

    def __init__(
        self,
        upstreams: list[Upstream],
        served_model: str | None,
        probe_interval_s: float,
        policy_version: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.policy_version = policy_version
        """The policy version set on the proxy now, or None (rule 8)."""
        self.replicas = [Replica(i, upstream) for i, upstream in enumerate(upstreams)]
        self.model = served_model
        """The set's model: the configured one, else the first replica's first model once known."""
        self._configured = served_model is not None
        self.probe_interval_s = probe_interval_s
        self._pins: dict[str, Replica] = {}
        self._probe: asyncio.Task[None] | None = None

    def pick(self, session_id: str) -> Replica:
        """The replica this session's next call goes to (rules 1, 2, 4), pinning it there."""
        pinned = self._pins.get(session_id)
        if pinned is not None and pinned.in_rotation:
            return pinned
        candidates = [r for r in self.replicas if r.in_rotation]
        if not candidates:
            if pinned is not None and not pinned.stale:
                return pinned
            candidates = [r for r in self.replicas if not r.stale] or self.replicas
        chosen = min(candidates, key=lambda r: (r.sessions, r.index))
        self._pin(session_id, chosen)
        return chosen

    def release(self, session_id: str) -> None:
        """Drop a deleted session's pin."""
        pinned = self._pins.pop(session_id, None)
        if pinned is not None:
            pinned.sessions -= 1

    def observe(self, replica: Replica, result: UpstreamResult) -> None:
        """Count a call sent to ``replica``; take it out of rotation if it did not answer (rule 3)."""
        replica.calls += 1
        if result.reply is None and result.unreachable:
            replica.failures += 1
            if replica.healthy:
                log.warning("replica %d (%s) is down: %s", replica.index, replica.upstream.root, result.error)
            replica.healthy = False

    def drain(self, index: int) -> Replica:
        """Take replica ``index`` out of rotation by hand; IndexError for no such replica."""
        replica = self.replicas[index]
        replica.drained = True
        return replica

    def enable(self, index: int) -> Replica:
        """Undo :meth:`drain` and clear stale (rule 8); the replica is in rotation again if it is healthy."""
        replica = self.replicas[index]
        replica.drained = replica.stale = False
        return replica

    def note_start(self, replica: Replica, start: float | None, *, back: bool) -> None:
        """Rule 8 for one reading of ``replica``'s start time (None: not read): ``back`` for a replica being
        probed back in (stale unless known and unchanged), else for a healthy one (stale once changed)."""
        previous = replica.start_time
        if start is not None:
            replica.start_time = start
        if back:
            restarted = start is None or start != previous
        else:
            restarted = start is not None and previous is not None and start != previous
        version = self.policy_version()
        if restarted and version is not None and not replica.stale:
            replica.stale = True
            log.warning(
                "replica %d (%s) may have restarted (start time %s, was %s): stale until enabled with "
                "policy version %s",
                replica.index, replica.upstream.root, start, previous, version,
            )  # fmt: skip

    def _pin(self, session_id: str, replica: Replica) -> None:
        self.release(session_id)
        self._pins[session_id] = replica
        replica.sessions += 1

    async def start(self) -> None:
        """The start-up check (rule 7), then the probe loop."""
        answered: list[tuple[Replica, list[str]]] = []
        for replica in self.replicas:
            names = await self._models(replica)
            if names is None:
                replica.healthy = False
                root = replica.upstream.root
                log.warning("replica %d (%s) does not answer; probing it", replica.index, root)
            else:
                answered.append((replica, names))
                replica.start_time = await self._start_time(replica)
        reference: tuple[Replica, list[str]] | None = None
        for replica, names in answered:
            if self._configured:
                if self.model not in names:
                    raise ConfigError(
                        f"replica {replica.upstream.root} does not serve --served-model {self.model!r} "
                        f"(it serves {', '.join(names) or 'nothing'})"
                    )
            elif reference is None:
                reference = (replica, names)
                self.model = names[0] if names else None
            elif (names[:1] or [None])[0] != self.model:
                first, first_names = reference
                raise ConfigError(
                    f"replicas serve different models: {first.upstream.root} serves "
                    f"{', '.join(first_names) or 'nothing'}, {replica.upstream.root} serves "
                    f"{', '.join(names) or 'nothing'} (every --upstream must serve the same model)"
                )
        self._probe = asyncio.create_task(self._probe_loop(), name="capture-proxy-replica-probe")

    async def stop(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe
            self._probe = None

    async def _models(self, replica: Replica) -> list[str] | None:
        """The replica's served models, or None if it does not answer."""
        try:
            return await replica.upstream.models(timeout_s=PROBE_TIMEOUT_S)
        except Exception:  # any failure to answer (refused, timeout, a non-200, a bad body) means "down"
            return None

    async def _start_time(self, replica: Replica) -> float | None:
        """The replica's engine start time (rule 8), or None if it is not on its page or not read."""
        try:
            return await replica.upstream.start_time(timeout_s=PROBE_TIMEOUT_S)
        except Exception:  # any failure to read it means "unknown"; rule 3 alone judges a replica down
            return None

    def _serves(self, names: list[str]) -> bool:
        if self.model is None:
            return True
        return self.model in names if self._configured else names[:1] == [self.model]

    async def probe_once(self) -> None:
        """Ask every down replica for its models; one serving the set's model rejoins rotation (rule 5),
        stale if it may have restarted (rule 8). Read every healthy replica's start time (rule 8)."""
        healthy = [replica for replica in self.replicas if replica.healthy]
        starts = await asyncio.gather(*(self._start_time(replica) for replica in healthy))
        for replica, start in zip(healthy, starts, strict=True):
            if replica.healthy:  # a call may have found it down meanwhile: then the probe-back decides
                self.note_start(replica, start, back=False)
        for replica in self.replicas:
            if replica.healthy:
                continue
            names = await self._models(replica)
            if names is None:
                continue
            if not self._serves(names):
                root = replica.upstream.root
                log.warning("replica %s answers but serves %s, not %s", root, names, self.model)
                continue
            if self.model is None and names:
                self.model = names[0]
            self.note_start(replica, await self._start_time(replica), back=True)
            replica.healthy = True
            where = "stale, out of rotation" if replica.stale else "in rotation"
            log.info("replica %d (%s) answers again: %s", replica.index, replica.upstream.root, where)

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            await self.probe_once()

    def render(self) -> list[str]:
        """Per-replica Prometheus lines, labelled ``replica`` (index) and ``engine`` (its base URL)."""
        families = (
            ("capture_proxy_replica_sessions", "gauge", "Sessions pinned to the replica", "sessions"),
            ("capture_proxy_replica_calls_total", "counter", "Calls sent to the replica", "calls"),
            ("capture_proxy_replica_failures_total", "counter", "Calls it did not answer", "failures"),
            ("capture_proxy_replica_healthy", "gauge", "1 while the replica answers", "healthy"),
            ("capture_proxy_replica_stale", "gauge", "1 while it waits for the current weights", "stale"),
            ("capture_proxy_replica_in_rotation", "gauge", "1 while it takes sessions", "in_rotation"),
        )
        lines: list[str] = []
        for name, kind, help_text, attribute in families:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            for replica in self.replicas:
                labels = f'replica="{replica.index}",engine="{replica.upstream.root}"'
                lines.append(f"{name}{{{labels}}} {int(getattr(replica, attribute))}")
        return lines
