"""Every session factory and the sessions it makes conform to the rollout contract
(:mod:`harness_trainer.rollouts.client.contract`): on the class, each Protocol member is there with a
signature that takes every call the Protocol allows (and coroutine where the Protocol's is); on real
instances, where one is built without a server, the Protocols' ``isinstance`` checks pass."""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
import typing
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openenv.core.harness")  # the white-box factories speak OpenEnv's types

from openenv.core.harness import ResourceSession

from capture_proxy.sampling import SamplingPolicy
from harness_trainer.rollouts.client.contract import (
    AsyncSession,
    AsyncSessionFactory,
    Session,
    SessionFactory,
)
from harness_trainer.rollouts.client.factory import HarborSession, HarborSessionFactory
from harness_trainer.rollouts.client.local_factory import LocalSession, LocalSessionFactory
from harness_trainer.rollouts.client.local_whitebox import LocalWhiteBoxSessionFactory
from harness_trainer.rollouts.client.session import sampling_policy
from harness_trainer.rollouts.client.whitebox_session import WhiteBoxSessionFactory
from harness_trainer.rollouts.errors import RolloutConfigError
from harness_trainer.rollouts.result import RolloutResult
from harness_trainer.trainer.feed.sync_adapter import ThreadedSession, ThreadedSessionFactory, as_async
from harness_trainer.trainer.feed.whitebox import WhiteBoxRolloutFactory
from tests.rollouts.conftest import EXAMPLES
from tests.trainer.handmade import HandmadeFactory

EMPTY = inspect.Parameter.empty
POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def members(protocol: type) -> dict[str, Any]:
    """The methods and properties a Protocol declares in its own body."""
    return {
        name: value
        for name, value in vars(protocol).items()
        if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property))
    }


def assert_takes(got: inspect.Signature, wanted: inspect.Signature, where: str) -> None:
    """``got`` accepts every call ``wanted`` allows: the same positions (names too, unless positional-only
    in ``wanted``), a default wherever ``wanted`` has one, and defaults on anything more it takes."""
    have = [p for p in got.parameters.values() if p.name != "self"]
    need = [p for p in wanted.parameters.values() if p.name != "self"]
    assert len(have) >= len(need), f"{where} takes fewer parameters than {wanted}"
    for g, w in zip(have, need, strict=False):
        if w.kind is inspect.Parameter.POSITIONAL_ONLY:
            assert g.kind in POSITIONAL, f"{where}: {g.name} must be positional"
        else:
            assert (g.name, g.kind) == (w.name, w.kind), f"{where}: {g} where the contract has {w}"
        assert w.default is EMPTY or g.default is not EMPTY, f"{where}: {g.name} needs a default"
    for extra in have[len(need) :]:
        optional = extra.default is not EMPTY or extra.kind in (extra.VAR_POSITIONAL, extra.VAR_KEYWORD)
        assert optional, f"{where}: {extra.name} is required"


def assert_conforms(cls: type, protocol: type) -> None:
    for name, wanted in members(protocol).items():
        where = f"{cls.__name__}.{name}"
        if isinstance(wanted, property):
            declared = any(name in vars(klass).get("__annotations__", {}) for klass in cls.__mro__)
            assert declared or isinstance(inspect.getattr_static(cls, name, None), property), (
                f"{where} is not declared (an annotation or a property)"
            )
            continue
        got = inspect.getattr_static(cls, name, None)
        assert inspect.isfunction(got), f"{where} is missing"
        assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(wanted), (
            f"{where} must {'' if inspect.iscoroutinefunction(wanted) else 'not '}be a coroutine function"
        )
        assert_takes(inspect.signature(got), inspect.signature(wanted), where)


def made_by(factory: type, method: str) -> type:
    """The class ``factory.method`` is annotated to return."""
    made = typing.get_type_hints(getattr(factory, method))["return"]
    assert inspect.isclass(made), f"{factory.__name__}.{method} names no class it returns"
    return made


@pytest.mark.parametrize(
    ("factory", "method", "session"),
    [
        (HarborSessionFactory, "create", Session),
        (LocalSessionFactory, "create", Session),
        (LocalSessionFactory, "acreate", AsyncSession),
        (WhiteBoxRolloutFactory, "create", Session),
        (ThreadedSessionFactory, "acreate", AsyncSession),
    ],
)
def test_the_trainers_factories_and_their_sessions_have_the_contracts_shape(
    factory: type, method: str, session: type
) -> None:
    assert_conforms(factory, AsyncSessionFactory if method == "acreate" else SessionFactory)
    assert_conforms(made_by(factory, method), session)


@pytest.mark.parametrize("factory", [WhiteBoxSessionFactory, LocalWhiteBoxSessionFactory])
def test_the_white_box_factories_make_openenv_resource_sessions_with_an_id(factory: type) -> None:
    assert_conforms(factory, SessionFactory)
    made = made_by(factory, "create")
    assert issubclass(made, ResourceSession)
    assert_conforms(made, type("Identified", (), {"session_id": Session.session_id}))


def test_the_shape_check_refuses_what_the_scheduler_could_not_call() -> None:
    class NoId:
        def wait_for_completion(self, timeout_s: float | None = None) -> int: ...

    class SyncWait:
        session_id: str | None

        def wait(self, timeout_s: float | None = None) -> int: ...

    class RenamedSeed:
        def create(self, task: Any, random_seed: int | None = None, episode_id: str | None = None) -> Any: ...

    for cls, protocol, says in [
        (NoId, Session, "NoId.session_id is not declared"),
        (SyncWait, AsyncSession, "SyncWait.wait must be a coroutine function"),
        (RenamedSeed, SessionFactory, "random_seed"),
    ]:
        with pytest.raises(AssertionError, match=says):
            assert_conforms(cls, protocol)


def test_real_sessions_pass_the_protocols_isinstance_checks() -> None:
    pending: concurrent.futures.Future[RolloutResult] = concurrent.futures.Future()
    local = LocalSession(object(), pending, asyncio.Event(), wait_timeout_s=60)  # type: ignore[arg-type]
    assert isinstance(local, Session) and isinstance(local, AsyncSession) and local.session_id is None
    harbor = HarborSession(object(), "srv-0", wait_timeout_s=60)  # type: ignore[arg-type]
    assert isinstance(harbor, Session) and not isinstance(harbor, AsyncSession)


def test_the_scheduler_gets_a_sync_factory_wrapped_and_an_async_one_as_it_is(tmp_path: Path) -> None:
    stopping = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        handmade = HandmadeFactory()
        assert isinstance(handmade, SessionFactory) and not isinstance(handmade, AsyncSessionFactory)
        wrapped = as_async(handmade, pool, stopping)
        assert isinstance(wrapped, ThreadedSessionFactory) and isinstance(wrapped, AsyncSessionFactory)
        session = asyncio.run(wrapped.acreate(handmade.prompt_rows()[0], seed=3, episode_id="group0-member0"))
        assert isinstance(session, ThreadedSession) and isinstance(session, AsyncSession)
        assert session.session_id == "hand-0" and handmade.created == [(0, 3, "group0-member0")]
        asyncio.run(session.aclose())
        assert handmade.closed == 1
        stopping.set()  # a session made once the run stops is closed at once, and never handed over
        with pytest.raises(RuntimeError, match="training stopped"):
            asyncio.run(wrapped.acreate(0))
        assert handmade.closed == 2 and not handmade.live
    base = tmp_path / "sandboxes"
    base.mkdir()
    local = {"local": {"base_dir": str(base)}}
    with LocalWhiteBoxSessionFactory(str(EXAMPLES), sandbox_options=local) as whitebox:
        assert isinstance(whitebox, SessionFactory)


def test_a_factorys_sampling_is_the_typed_policy_validated_once_and_sent_as_its_json() -> None:
    policy = SamplingPolicy(temperature=0.7, max_tokens=256)
    assert sampling_policy(policy) is policy
    assert sampling_policy({"temperature": 0.7, "max_tokens": 256}) == policy
    assert sampling_policy(None) is None
    assert policy.wire_json() == {"temperature": 0.7, "max_tokens": 256}
    assert SamplingPolicy.model_validate(policy.wire_json()) == policy
    with pytest.raises(RolloutConfigError, match="top_p must be 1"):
        sampling_policy({"temperature": 0.7, "top_p": 0.9})


def test_a_foreign_sync_session_without_an_id_reads_as_none_through_the_thread_adapter() -> None:
    class ForeignSession:  # OpenEnv's loop-owning sessions declare no session_id
        def wait_for_completion(self, timeout_s: float | None = None) -> int:
            return 0

    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        session = ThreadedSession(ForeignSession(), executor)  # type: ignore[arg-type]
        assert session.session_id is None
        assert asyncio.run(session.wait()) == 0


def test_a_threaded_session_finalised_after_its_loop_closed_is_closed_on_the_finalising_thread() -> None:
    """A stop that outwaits its drain closes the scheduler's loop with rollouts pending; their coroutines
    are finalised later, with no loop, and the session's close still runs (it used to raise there)."""

    class Counted:
        closed = 0

        def close(self) -> None:
            Counted.closed += 1

    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        closing = ThreadedSession(Counted(), executor).aclose()  # type: ignore[arg-type]
        with pytest.raises(StopIteration):
            closing.send(None)  # driven as a finaliser drives it: no running loop
        assert Counted.closed == 1
