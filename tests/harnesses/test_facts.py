"""What others need to know of a harness is declared on its class (``package``, ``dialect``) and read from
the registry: no module outside the harnesses package compares a harness's name to a string."""

from __future__ import annotations

import re

from harness_trainer.devloop.solver import SCRIPTED_HARNESSES
from harness_trainer.harnesses import HARNESSES, Dialect
from harness_trainer.harnesses.tools import ToolPackage
from tests.name_comparisons import name_comparisons


def test_every_registered_harness_declares_its_package_and_dialect() -> None:
    for name, harness in HARNESSES.items():
        assert harness.name == name
        assert harness.package is None or isinstance(harness.package, ToolPackage), name
        assert harness.dialect is None or isinstance(harness.dialect, Dialect), name
    assert [name for name, harness in HARNESSES.items() if harness.package is None] == ["toy"]
    # Every agent can be driven by a scripted model (the dev loop, its warm-up, the agents benchmark).
    assert set(SCRIPTED_HARNESSES) == set(HARNESSES)


def test_no_module_outside_the_harnesses_package_compares_a_harness_name() -> None:
    found = name_comparisons(HARNESSES, ["harness_trainer", "benchmarks"], ["harness_trainer/harnesses"])
    assert not found, "read the harness class's facts (package, dialect) instead:\n" + "\n".join(found)


def test_every_agent_package_and_dependency_it_pins_is_an_exact_version() -> None:
    """An agent that changes its config format in a new release must not reach a run unasked: each
    harness names the exact version it was written against (and ``serve --prepare``'s probe checks the
    running agent reports it), never a range or a tag."""
    exact = re.compile(r"^\d+\.\d+\.\d+$")
    for name, harness in HARNESSES.items():
        if harness.package is None:
            continue
        assert exact.match(harness.package.version), (name, harness.package.version)
        for dependency, version in harness.package.pins:
            assert exact.match(version), (name, dependency, version)
