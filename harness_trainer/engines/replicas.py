"""Several engines of one kind serving one model, as one ``InferenceEngine``: each step reaches every replica.

The capture proxy routes rollouts over the replicas (``python -m capture_proxy --replicas``, or
``harness-trainer serve --replicas``); this class is the trainer's side: it pauses, pushes to and resumes
each of them, and keeps the proxy from routing to one that does not serve the newest weights.

Rules (the contract of this module):
1. *Current version.* :attr:`EngineReplicas.version` is the newest version that a push got onto at least one
   replica (None before the first push: every replica then serves the weights it started with). A replica is
   *current* when its :attr:`ReplicaState.version` equals it.
2. *Every call reaches every replica, at once.* ``pause`` goes to all of them; ``push_weights`` to those that
   paused; ``resume`` to those that are current. A replica whose call raises
   :class:`~harness_trainer.engines.base.EngineUnavailable` (:class:`PushRefused` included) is *out*: the
   error is logged and kept on its :class:`ReplicaState`, and the step goes on with the others.
   ``stage_weights`` (the part of a push that needs no pause) goes to every replica that has one; one that
   fails it is out, and its push does the whole of it; when all of them refuse the tensors
   (:class:`PushRefused`: nothing sent), none goes out and the refusal is raised.
3. *Out of rotation at the proxy.* When the set knows the proxy's admin URL and key, a replica that goes out
   is drained there (``POST /replicas/{i}/drain``, ``i`` found by its engine URL in ``GET /replicas``), so no
   session is placed on it, and the proxy's own probing does not put it back (a drain outlasts probing). A
   failed drain or enable is logged and kept on the replica; it does not fail the step, and is asked again
   on the next resume. Without the proxy, the set only records it, and a proxy routing over the replicas
   keeps placing sessions on it: their calls wait while it is left paused (rule 4).
4. *Back in only when current.* An out replica is paused and pushed again on every later step; it is resumed
   and enabled at the proxy (``POST /replicas/{i}/enable``) only once a push gave it the current version.
   A replica that is not current is left paused where it answers, so it never samples from old weights
   after a step's resume without being reported out (:meth:`EngineReplicas.report`).
5. *Stale at the proxy.* A replica that restarted (with its start-up weights) while the proxy had a policy
   version set is *stale* there (rule 8 of ``capture_proxy/replicas.py``): out of rotation until enabled.
   After a step's resume, each replica that took this step's push, said it serves it (rule 7) and resumed,
   and that the proxy lists as stale, is enabled there: it now serves the current version. One the proxy
   lists as drained as well was drained by someone else, and is left as it is. A failure to ask is logged,
   as in rule 3.
6. *Failure of the whole.* ``pause`` raises :class:`EngineUnavailable` when no replica paused;
   ``push_weights`` raises when no replica took the version (:class:`PushRefused` when every push was
   refused, so every replica still serves its old weights whole, as one engine's refusal means).
7. *Asked before it resumes.* At a step's resume, before anything is resumed or enabled, each replica that
   took this step's push is asked which version it serves (``served_version``: the engine's own word, e.g.
   vLLM's ``GET /weight_info``). One that serves another version (it restarted after the push, with its
   start-up weights, or its reload did not happen) is out with the reason ``serves version X, not Y``, is
   drained as in rule 3 and paused, and is pushed again on the next step like any out replica (rule 4); one
   that cannot be asked is out as in rule 2. So a replica is resumed, put back (rule 4) or enabled as stale
   (rule 5) only when it said it serves the pushed version.

Limits: a push must carry every weight that differs from the base model (as the trainer's full-state push
does), since an out replica catches up through the next push alone. A replica that dies and restarts
*between* two steps is kept out by the proxy (stale, rule 5) from when the proxy notices, at a failed call or
its next probe (``--probe-interval``); until then it serves its start-up weights. One that restarts after
the set asked it (rule 7) and before its resume is resumed with its start-up weights, until the proxy
notices as above.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from capture_proxy.admin_client import CaptureClient, CaptureError
from harness_trainer.engines.base import EngineUnavailable, InferenceEngine, PushRefused

logger = logging.getLogger(__name__)


@dataclass
class ReplicaState:
    """What the set knows of one replica."""

    index: int
    """Its place in the set (the proxy's own index is looked up by ``engine``)."""
    engine: InferenceEngine
    version: int | None = None
    """The version it serves as far as the set knows (None: the weights it started with, or unknown after a
    push that failed once sent)."""
    out: bool = False
    """Out of rotation: a call to it failed and it has not been given the current version since."""
    drained: bool = False
    """While out: the proxy took the drain (or there is no proxy to tell)."""
    error: str | None = None
    """The last failure (a call to it, or a drain/enable at the proxy), for the report."""
    failed_at: float | None = None
    """``time.time()`` of the failure that took it out."""

    @property
    def url(self) -> str:
        return self.engine.base_url.rstrip("/").removesuffix("/v1")

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "engine": self.url, "version": self.version, "out": self.out,
                "drained": self.drained, "error": self.error, "failed_at": self.failed_at}  # fmt: skip


class EngineReplicas:
    """An ``InferenceEngine`` over ``engines`` (replicas of one model, same kind); see the module docstring.

    ``proxy_url`` and ``admin_key``: the capture proxy routing over these replicas (started with
    ``--replicas``), to drain a replica that goes out and enable it once current; None: only recorded.
    """

    def __init__(
        self,
        engines: Sequence[InferenceEngine],
        *,
        proxy_url: str | None = None,
        admin_key: str | None = None,
        proxy_timeout_s: float = 30.0,
    ) -> None:
        if not engines:
            raise ValueError("EngineReplicas needs at least one engine")
        if len({type(engine) for engine in engines}) > 1:
            raise ValueError("EngineReplicas takes engines of one kind")
        self.replicas = [ReplicaState(index, engine) for index, engine in enumerate(engines)]
        self.base_url = self.replicas[0].url
        self.version: int | None = None
        self.proxy_url = proxy_url.rstrip("/") if proxy_url else None
        self._admin_key = admin_key
        self._proxy_timeout_s = proxy_timeout_s
        self._paused: set[int] = set()
        self._pushed: set[int] = set()
        """Replicas that took the current version in this step's push (rule 5)."""

    @property
    def out_of_rotation(self) -> list[int]:
        """Indexes of the replicas that are out (rule 2)."""
        return [replica.index for replica in self.replicas if replica.out]

    def report(self) -> list[dict[str, Any]]:
        """Each replica's state, as JSON."""
        return [replica.to_json() for replica in self.replicas]

    async def pause(self) -> None:
        results = await self._each(self.replicas, lambda replica: replica.engine.pause(), "pause")
        self._paused = {replica.index for replica, error in results if error is None}
        self._pushed = set()
        if not self._paused:
            raise EngineUnavailable(f"no replica paused: {self._errors()}")

    async def push_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> int:
        targets = [replica for replica in self.replicas if replica.index in self._paused]

        async def push(replica: ReplicaState) -> None:
            replica.version = await replica.engine.push_weights(named_tensors, version)

        results = await self._each(targets, push, f"push of version {version}")
        if not any(error is None and replica.version == version for replica, error in results):
            refused = bool(results) and all(isinstance(error, PushRefused) for _, error in results)
            raise (PushRefused if refused else EngineUnavailable)(
                f"no replica took version {version}: {self._errors()}"
            )
        self.version = version
        self._pushed = {r.index for r, error in results if error is None and r.version == version}
        for replica, error in results:
            if error is None and replica.version != version:  # answered, but with another version
                await self._take_out(replica, f"serves version {replica.version} after a push of {version}")
        return version

    async def stage_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Each replica's part of the push that needs no pause (its ``stage_weights``, e.g. the file path's
        write), at once; a replica without one has nothing to stage. One that fails is out (rule 2) and
        still gets the push, which does the whole of it.

        Raises:
            PushRefused: every replica refused the tensors (they serve one model: it cannot load them).
        """
        staging = [replica for replica in self.replicas if hasattr(replica.engine, "stage_weights")]
        calls = (replica.engine.stage_weights(named_tensors, version) for replica in staging)
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        if outcomes and all(isinstance(outcome, PushRefused) for outcome in outcomes):
            # Nothing was sent anywhere and every replica serves its old weights whole: none goes out.
            raise PushRefused(f"no replica can load version {version}: {outcomes[0]}")
        for replica, outcome in zip(staging, outcomes, strict=True):
            if isinstance(outcome, EngineUnavailable):
                await self._take_out(replica, f"{type(outcome).__name__} on staging of {version}: {outcome}")
            elif isinstance(outcome, BaseException):
                raise outcome

    def close(self) -> None:
        """Close each replica's client that has a ``close`` (the file path's folders, a transfer group)."""
        for replica in self.replicas:
            if hasattr(replica.engine, "close"):
                replica.engine.close()

    async def resume(self) -> None:
        await self._check_served()
        current = [replica for replica in self.replicas if replica.version == self.version]
        results = await self._each(current, lambda replica: replica.engine.resume(), "resume")
        for replica, error in results:
            if error is None and replica.out:
                await self._put_back(replica)
        pushed = [r for r, error in results if error is None and r.index in self._pushed and not r.out]
        await self._enable_stale(pushed)
        for replica in self.replicas:
            if replica.out and not replica.drained:  # a drain the proxy missed: asked again each step
                replica.drained = await self._at_proxy(replica, "drain")
        if not any(error is None for _, error in results):
            raise EngineUnavailable(f"no replica serving version {self.version} resumed: {self._errors()}")
        if stale := [r.index for r in self.replicas if r.out]:
            logger.warning("replicas %s are out of rotation (not at version %s)", stale, self.version)

    async def health(self) -> bool:
        """Whether any replica answers its health check."""
        return any(await asyncio.gather(*(replica.engine.health() for replica in self.replicas)))

    async def served_version(self) -> int | None:
        """What the replicas in rotation serve, each asked: the current version when one of them says so
        (rules 4 and 7 keep the others out), else what the first that answered says.

        Raises:
            EngineUnavailable: no replica in rotation answered.
        """
        live = [replica for replica in self.replicas if not replica.out]
        outcomes = await asyncio.gather(*(r.engine.served_version() for r in live), return_exceptions=True)
        served = [outcome for outcome in outcomes if not isinstance(outcome, BaseException)]
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, EngineUnavailable):
                raise outcome
        if not served:
            raise EngineUnavailable(
                f"no replica in rotation told its served version: {outcomes or 'none in'}"
            )
        return self.version if self.version in served else served[0]

    async def _check_served(self) -> None:
        """Rule 7: ask each replica that took this step's push which version it serves; take out (and pause)
        one that does not serve the pushed version."""
        pushed = [replica for replica in self.replicas if replica.index in self._pushed]
        served: dict[int, int | None] = {}

        async def ask(replica: ReplicaState) -> None:
            served[replica.index] = await replica.engine.served_version()

        results = await self._each(pushed, ask, f"served_version after the push of {self.version}")
        answered = [replica for replica, error in results if error is None]
        wrong = [replica for replica in answered if served[replica.index] != self.version]
        self._pushed = {replica.index for replica in answered if served[replica.index] == self.version}
        for replica in wrong:
            replica.version = served[replica.index]
            shown = "none (its start-up weights)" if replica.version is None else replica.version
            await self._take_out(replica, f"serves version {shown}, not {self.version}")
        # Left paused, as every replica that is not current is (rule 4); one that restarted is not.
        outcomes = await asyncio.gather(*(r.engine.pause() for r in wrong), return_exceptions=True)
        for replica, outcome in zip(wrong, outcomes, strict=True):
            if isinstance(outcome, EngineUnavailable):  # already out and drained: only worth the record
                logger.warning("replica %d (%s): pause failed: %s", replica.index, replica.url, outcome)
                replica.error = f"{replica.error}; pause failed: {outcome}"
            elif isinstance(outcome, BaseException):
                raise outcome

    async def _each(
        self, replicas: list[ReplicaState], call: Callable[[ReplicaState], Awaitable[Any]], what: str
    ) -> list[tuple[ReplicaState, EngineUnavailable | None]]:
        """``call`` on every replica at once; each that raises EngineUnavailable is taken out (rule 2), and,
        unless it refused a push (its old weights whole), its version becomes unknown: it may have restarted
        with its start-up weights."""
        outcomes = await asyncio.gather(*(call(replica) for replica in replicas), return_exceptions=True)
        results: list[tuple[ReplicaState, EngineUnavailable | None]] = []
        for replica, outcome in zip(replicas, outcomes, strict=True):
            if isinstance(outcome, EngineUnavailable):
                if not isinstance(outcome, PushRefused):
                    replica.version = None
                await self._take_out(replica, f"{type(outcome).__name__} on {what}: {outcome}")
                results.append((replica, outcome))
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                results.append((replica, None))
        return results

    async def _take_out(self, replica: ReplicaState, why: str) -> None:
        logger.warning("replica %d (%s) out of rotation: %s", replica.index, replica.url, why)
        replica.error, replica.failed_at = why, time.time()
        if not replica.out:
            replica.out = True
            replica.drained = await self._at_proxy(replica, "drain")

    async def _put_back(self, replica: ReplicaState) -> None:
        if await self._at_proxy(replica, "enable"):
            logger.info(
                "replica %d (%s) back in rotation at version %s", replica.index, replica.url, self.version
            )
            replica.out, replica.drained, replica.error, replica.failed_at = False, False, None, None

    async def _enable_stale(self, pushed: list[ReplicaState]) -> None:
        """Enable at the proxy each of ``pushed`` (current, resumed) that it lists as stale (rule 5)."""
        if self.proxy_url is None or not pushed:
            return
        client = CaptureClient(
            self.proxy_url, self._admin_key, timeout_s=self._proxy_timeout_s, reconnect_s=0
        )
        try:
            listed = {str(r["engine"]).rstrip("/"): r for r in await client.replicas()}
            for replica in pushed:
                row = listed.get(replica.url)
                if row is None or not row.get("stale") or row.get("drained"):
                    continue
                await client.replica_action(int(row["index"]), "enable")
                logger.info(
                    "replica %d (%s) restarted and now holds version %s: enabled again at the proxy",
                    replica.index, replica.url, self.version,
                )  # fmt: skip
        except (CaptureError, KeyError, ValueError) as exc:
            # As for a drain (rule 3): the replica stays out at the proxy, and the next resume asks again.
            logger.warning("enabling stale replicas at the proxy %s failed: %r", self.proxy_url, exc)
        finally:
            await client.aclose()

    async def _at_proxy(self, replica: ReplicaState, action: str) -> bool:
        """``POST /replicas/{i}/{action}`` at the proxy for ``replica``; True when done or when there is no
        proxy to tell (rule 3)."""
        if self.proxy_url is None:
            return True
        # No reconnect wait: a proxy that is down is asked again at the next resume.
        client = CaptureClient(
            self.proxy_url, self._admin_key, timeout_s=self._proxy_timeout_s, reconnect_s=0
        )
        try:
            listed = await client.replicas()
            index = next(r["index"] for r in listed if str(r["engine"]).rstrip("/") == replica.url)
            await client.replica_action(index, action)
        except (CaptureError, KeyError, StopIteration, ValueError) as exc:
            # Not worth failing the step: the set's own record stands, and the next resume asks again.
            message = f"{action} at the proxy {self.proxy_url} failed: {exc!r}"
            logger.warning("replica %d (%s): %s", replica.index, replica.url, message)
            replica.error = f"{replica.error}; {message}" if replica.error else message
            return False
        finally:
            await client.aclose()
        return True

    def _errors(self) -> str:
        return "; ".join(f"replica {r.index} ({r.url}): {r.error}" for r in self.replicas if r.error) or "-"
