"""The report's sections for the sandbox backends: pooled HF sandbox starts (:mod:`benchmarks.hf_pool`) and
one setup per GRPO group (:mod:`benchmarks.group_setup`); each a function of the benchmark's JSON result."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.report_rows import Row, Section, spread_of


def hf_pool_section(result: dict[str, Any]) -> Section:
    """The last of a burst of pooled HF sandbox starts against its yardstick (one host's start + starts /
    create rate), per repeat; the failed starts and the jobs left running."""
    config, runs = result["config"], result["runs"]
    ratios = [r["ratio"] for r in runs]
    failed = sum(r["failed"] for r in runs)
    last = ", ".join(f"{r['t_last_s']:.2f} s" for r in runs)
    bound = ", ".join(f"{r['bound_s']:.2f} s" for r in runs)
    rows = [
        Row(f"last of {config['starts']} pooled starts vs host start + starts / rate", last, bound, ratios),
        Row("failed starts", str(failed)),
        Row("host jobs booted", ", ".join(str(r["hosts"]) for r in runs)),
        Row("jobs left running", str(result["leftover_jobs"])),
    ]
    real = config["real"]
    notes = [
        f"fake Hub, latencies assumed (scaled by {config['scale']:g}): a host starts in "
        f"{real['host_start_s']:g} s, {real['create_rate_per_s']:g} pooled creates/s Hub-wide; a start is "
        "create_sandbox (made + first command answered), not a Harbor task's start (a pooled sandbox writes "
        "only its home)"
    ]
    return Section(
        "hf_pool", f"last start {spread_of(ratios)} of its yardstick", rows, result["verdicts"], notes
    )


def group_setup_section(result: dict[str, Any]) -> Section:
    """One setup per GRPO group against G cold starts: start work per member, per backend."""
    c, rows = result["config"], []
    for name, runs in result["runs"].items():
        cold = statistics.median(r["cold"]["work_per_member_s"] for r in runs)
        one = statistics.median(r["one_setup"]["work_per_member_s"] for r in runs)
        rows.append(Row(f"{name}: start work per member, one setup per group vs cold", f"{one:.2f} s",
                        f"{cold:.2f} s", [r["ratio"] for r in runs]))  # fmt: skip
        last_cold = statistics.median(r["cold"]["last_ready_s"] for r in runs)
        last_one = statistics.median(r["one_setup"]["last_ready_s"] for r in runs)
        latencies = [r["one_setup"]["last_ready_s"] / r["cold"]["last_ready_s"] for r in runs]
        rows.append(Row(f"  {name}: the group's last member ready (no target)", f"{last_one:.1f} s",
                        f"{last_cold:.1f} s", latencies))  # fmt: skip
    latency = c["e2b_latency"]
    notes = [
        f"a group of {c['members']}, a setup of {c['setup_s']:g} s (an install that sleeps in the sandbox); "
        "start work: seconds from each create request to that sandbox ready for its agent, the setup's "
        "included, summed over the group and divided by its size",
        f"e2b: the fake cloud, a create {latency['create_s'][0]:g}-{latency['create_s'][1]:g} s, a snapshot "
        f"{latency['snapshot_s']:g} s, a create from a snapshot {latency['create_from_snapshot_s']:g} s; "
        "docker: the real daemon",
    ]
    ratios = ", ".join(
        f"{name} {statistics.median(r['ratio'] for r in runs):.2f}x" for name, runs in result["runs"].items()
    )
    return Section("group_setup", f"start work per member with one setup per group: {ratios} of cold", rows,
                   notes=notes)  # fmt: skip
