"""Evaluation in a run that mixes harnesses: every eval task under every harness of the mix.

A factory that mixes harnesses and can be asked for one by name (:class:`PicksHarness`) is wrapped in
:class:`EveryHarness` for an evaluation: group ``h × tasks + i`` is task ``i`` under the ``h``-th harness, so
each (task, harness) gets its own group, seed and samples (:mod:`.evaluation` scores them per harness).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from harness_trainer.rollouts.client.contract import AsyncSessionFactory, RolloutFactory
from harness_trainer.rollouts.client.servers import group_index
from harness_trainer.rollouts.harness_mix import HarnessMix


@runtime_checkable
class PicksHarness(Protocol):
    """A session factory that mixes harnesses and runs a session on the harness it is asked for (the
    rollout clients': :class:`~harness_trainer.rollouts.client.factory.HarborSessionFactory`,
    :class:`~harness_trainer.rollouts.client.local_factory.LocalSessionFactory`)."""

    harness_mix: HarnessMix

    def create(
        self, task: Any, seed: int | None = None, episode_id: str | None = None, *, harness: str | None = None
    ) -> Any: ...


class EveryHarness:
    """The eval factory as an evaluation's scheduler sees it in a mix: group ``g`` runs on harness
    ``names[g // tasks]`` (the scheduler gives it row ``g mod tasks``: it cycles the rows in order), asked
    of ``factory`` by name; :meth:`harness_for_group` says which, so each sample's record names it."""

    def __init__(self, factory: PicksHarness, tasks: int) -> None:
        self.factory, self.names, self.tasks = factory, factory.harness_mix.names, tasks
        if isinstance(factory, AsyncSessionFactory):  # stays async: the scheduler awaits it on its own loop
            self.acreate = self._acreate

    @classmethod
    def of(cls, factory: RolloutFactory, tasks: int) -> EveryHarness | None:
        """``factory`` seen so, when it mixes harnesses and can be asked for one; else None (one group per
        task, on the harness the factory deals it)."""
        if isinstance(factory, PicksHarness) and factory.harness_mix.mixed:
            return cls(factory, tasks)
        return None

    def harness_for_group(self, group: int) -> str:
        return self.names[group // self.tasks]

    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> Any:
        harness = self._harness(episode_id)
        return self.factory.create(task, seed=seed, episode_id=episode_id, harness=harness)

    async def _acreate(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> Any:
        harness = self._harness(episode_id)
        return await self.factory.acreate(  # type: ignore[attr-defined]
            task, seed=seed, episode_id=episode_id, harness=harness
        )

    def _harness(self, episode_id: str | None) -> str:
        group = group_index(episode_id)
        if group is None:
            raise ValueError(f"an eval episode id names its group (groupG-memberM), got {episode_id!r}")
        return self.harness_for_group(group)
