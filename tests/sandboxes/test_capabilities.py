"""Each backend's facts live on its class (``capabilities``) and are read from the registry: preflight,
the Jobs plan, ``serve`` and the help texts ask the registry, and no other module compares a backend's name
to a string."""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

import harness_trainer
from harness_trainer.rollouts.server.runtime import RolloutRuntime, RuntimeConfig
from harness_trainer.sandboxes import (
    SANDBOXES,
    Capabilities,
    capabilities,
    credential_variables,
    describe_backends,
    missing_credentials,
)
from tests.sandboxes.test_contract import CONTRACT_BACKENDS

PACKAGE = Path(harness_trainer.__file__).parent
NAME_COMPARISON = re.compile(r"""sandbox\w*\s*(==|!=|\bin\b)\s*[("']""")


def test_every_registered_backend_declares_its_capabilities_and_has_a_contract_fixture() -> None:
    for name, backend_class in SANDBOXES.items():
        caps = backend_class.capabilities
        assert isinstance(caps, Capabilities) and caps.summary, name
        assert backend_class.name == name
    assert set(CONTRACT_BACKENDS) == set(SANDBOXES)


def test_the_registry_answers_from_the_classes() -> None:
    assert capabilities("e2b").remote and not capabilities("local").remote
    assert capabilities("e2b").isolation.network and capabilities("local").isolation.network
    assert not capabilities("local").isolation.filesystem
    assert not capabilities("docker").remote and capabilities("docker").builds == "images"
    assert capabilities("docker").wants_proxy_url and capabilities("local").wants_proxy_url
    assert not capabilities("e2b").wants_proxy_url
    assert capabilities("hf").remote and not capabilities("hf").wants_proxy_url
    assert capabilities("e2b").credentials == ("E2B_API_KEY",)
    assert capabilities("hf").credentials == ("HF_TOKEN",)
    assert credential_variables() == ("E2B_API_KEY", "HF_TOKEN")  # each backend's, in registry order
    assert missing_credentials("e2b", {}) == ["E2B_API_KEY"]
    assert missing_credentials("hf", {"E2B_API_KEY": "k"}) == ["HF_TOKEN"]
    assert missing_credentials("e2b", {"E2B_API_KEY": ""}) == ["E2B_API_KEY"]
    assert missing_credentials("e2b", {"E2B_API_KEY": "k"}) == [] == missing_credentials("local", {})
    with pytest.raises(ValueError, match="unknown sandbox backend 'nope'; known: docker, e2b, hf, local"):
        capabilities("nope")
    described = describe_backends()
    assert "e2b (E2B cloud microVMs; needs E2B_API_KEY and a public URL" in described
    assert "needs HF_TOKEN (or a login stored by `hf auth login`) and a public URL" in described
    assert described.startswith("local (")


def test_no_module_outside_the_sandboxes_package_compares_a_backend_name() -> None:
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "sandboxes":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if NAME_COMPARISON.search(line):
                offenders.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    assert not offenders, "ask the registry (capabilities) instead:\n" + "\n".join(offenders)


@pytest.mark.parametrize(
    ("config", "environ", "problem"),
    [
        (RuntimeConfig("http://e", Path("d")), {}, "sandbox e2b needs E2B_API_KEY in the rollout server's"),
        (RuntimeConfig("http://e", Path("d")), {"E2B_API_KEY": "k"}, "loopback (127.0.0.1): start the"),
        (
            RuntimeConfig("http://e", Path("d"), capture_url="http://localhost:1", admin_key="a"),
            {"E2B_API_KEY": "k"},
            "--public-url",
        ),
        (
            RuntimeConfig("http://e", Path("d"), public_url="https://proxy.example"),
            {"E2B_API_KEY": "k"},
            None,
        ),
    ],
)
def test_the_runtime_refuses_a_backend_it_cannot_serve_in_one_line(
    config: RuntimeConfig, environ: dict[str, str], problem: str | None
) -> None:
    runtime = RolloutRuntime(config)
    found = runtime.sandbox_problem("e2b", environ)
    assert found is None if problem is None else problem in (found or "")
    assert runtime.sandbox_problem("local", {}) is None
    assert "known: docker, e2b, hf, local" in (runtime.sandbox_problem("docker2", {}) or "")


def test_the_runtime_gives_the_capture_proxy_url_to_the_backends_that_want_it() -> None:
    config = RuntimeConfig("http://e", Path("d"), sandbox_options={"docker": {"kill_grace_s": 1.0}})
    runtime = RolloutRuntime(config)
    runtime.capture = SimpleNamespace(public_url="http://127.0.0.1:8300")  # type: ignore[assignment]
    docker = runtime.backend("docker").backend  # type: ignore[attr-defined]
    assert (docker.proxy_url, docker.kill_grace_s) == ("http://127.0.0.1:8300", 1.0)
    assert runtime.backend("local").backend.proxy_url == "http://127.0.0.1:8300"  # type: ignore[attr-defined]


def test_the_readme_table_says_what_the_classes_declare() -> None:
    readme = (PACKAGE.parent / "docs/sandboxes.md").read_text()
    after = readme.split("<!-- sandbox-capabilities -->", 1)[1].strip().splitlines()
    table = list(itertools.takewhile(lambda line: line.startswith("|"), after))[2:]
    rows = {cells[0].strip("`"): cells[1:] for line in table
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}  # fmt: skip
    assert set(rows) == set(SANDBOXES)
    yes_no = {True: "yes", False: "no"}
    for name, cells in rows.items():
        caps = capabilities(name)
        credentials = ", ".join(f"`{v}`" for v in caps.credentials) or "-"
        isolation = caps.isolation
        assert cells[0] == credentials and cells[1] == yes_no[caps.remote], name
        assert cells[2].split(" ")[0] == (caps.builds or "no"), name
        flags = [isolation.network, isolation.filesystem, isolation.user, isolation.limits, caps.forks]
        assert cells[3:] == [yes_no[flag] for flag in flags], name
