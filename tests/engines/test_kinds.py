"""Each engine kind's facts live in one registry (``ENGINE_KIND_FACTS``, torch-free): the trainer, its
config, the dev loop and the launchers ask it, and no other module compares an engine's name to a string."""

from __future__ import annotations

import httpx
import pytest

from harness_trainer.engines import ENGINES, DevEngine, VLLMEngine, detect_engine_kind
from harness_trainer.engines.kinds import (
    ENGINE_KIND_FACTS,
    ENGINE_KINDS,
    PLAIN_KIND,
    EngineKind,
    client_kind,
    kind_of,
    syncs_adapters,
)
from tests.name_comparisons import name_comparisons


def test_every_kind_names_itself_and_a_client_class_that_loads() -> None:
    for name, kind in ENGINE_KIND_FACTS.items():
        assert isinstance(kind, EngineKind) and kind.name == name
        assert ENGINES[name] is kind.client_class()
    assert ENGINE_KINDS == ("auto", "vllm", "dev", "none")


def test_the_facts_tell_the_kinds_apart() -> None:
    assert kind_of("vllm").adapter_sync and not kind_of("dev").adapter_sync
    assert kind_of("vllm").weights_out_of_band and not kind_of("dev").weights_out_of_band
    assert kind_of("dev").answers_weight_version and not kind_of("vllm").answers_weight_version
    assert kind_of("vllm").own_python and not kind_of("dev").own_python
    assert [syncs_adapters(name) for name in ENGINE_KINDS] == [False, True, False, False]
    with pytest.raises(ValueError, match="unknown engine kind 'auto'; known kinds: dev, vllm"):
        kind_of("auto")


def test_a_client_is_of_its_class_kind_and_any_other_of_the_plain_kind() -> None:
    assert client_kind(VLLMEngine("http://127.0.0.1:1")) == "vllm"
    assert client_kind(DevEngine("http://127.0.0.1:1")) == "dev" == PLAIN_KIND
    assert client_kind(object()) == PLAIN_KIND


@pytest.mark.parametrize(
    ("reply", "kind"),
    [
        (httpx.Response(200, json={"weight_version": 0}), "dev"),
        (httpx.Response(404, json={"detail": "Not Found"}), "vllm"),
        (httpx.Response(200, text="not json"), "vllm"),
    ],
)
def test_detection_tells_the_kind_by_the_weight_version_route(monkeypatch, reply, kind) -> None:
    asked = []
    monkeypatch.setattr(httpx, "get", lambda url, timeout: asked.append(url) or reply)
    assert detect_engine_kind("http://127.0.0.1:1/v1") == kind
    assert asked == ["http://127.0.0.1:1/weight_version"]


def test_no_module_outside_the_kinds_registry_compares_an_engine_name() -> None:
    found = name_comparisons(ENGINE_KIND_FACTS, ["harness_trainer"], ["harness_trainer/engines/kinds.py"])
    assert not found, "ask the engine kind's facts (engines/kinds.py) instead:\n" + "\n".join(found)
