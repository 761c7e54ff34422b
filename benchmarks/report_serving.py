"""The report's sections for the serving side: the dev engine, the capture proxy (alone and over replicas),
the rollout server, the soak and E2B sandbox starts; each a function of the benchmark's JSON result (see
:mod:`benchmarks.report` for what each row compares)."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.report_rows import Row, Section, spread_of, table


def engine_section(result: dict[str, Any]) -> Section:
    """The dev engine's decode tok/s against a plain ``model.generate``."""
    ratios = [r["server_tps"] / r["baseline_tps"] for r in result["repeats"]]
    b, s, c = result["baseline_tps"], result["server_tps"], result["config"]
    row = Row(
        "decode tok/s, server vs generate", f"{s['median']:.1f} tok/s", f"{b['median']:.1f} tok/s", ratios
    )
    note = f"{c['prompts']} prompts x {c['max_tokens']} tokens per repeat, {c['threads']} torch thread(s)"
    return Section("engine", f"server {spread_of(ratios)} of generate's tok/s", [row], notes=[note])


def proxy_section(result: dict[str, Any]) -> Section:
    """The proxy's req/s against the pass-through and its p50 against the engine, per point; its memory."""
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
    """The proxy's req/s over replicas against one engine of their capacity, and its routing latency."""
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
    """A rollout's seconds against the agent started directly, and the concurrent sessions held."""
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


def soak_section(result: dict[str, Any]) -> Section:
    """The long-lived processes' RSS, fds and threads at the end against the start; the journal's bytes."""
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


def e2b_starts_section(result: dict[str, Any]) -> Section:
    """E2B start overhead, the agent's bundle in the template against a per-rollout network install; a
    burst of starts."""
    agent, runs, c = result["agent"], result["burst"], result["config"]
    install, bundle = agent["install"], agent["bundle"]

    def parts(arm: dict[str, Any]) -> str:
        create, setup = statistics.median(arm["create_s"]), statistics.median(arm["install_s"])
        return f"create {create:.2f} s + install {setup:.2f} s"

    rows = [
        Row(
            f"start overhead, per-rollout network install vs bundle in the template ({agent['package']})",
            f"{install['median_s']:.2f} s",
            f"{bundle['median_s']:.2f} s",
            agent["ratios"],
        ),
        Row(
            "  bundle in the template", parts(bundle) + f"; template build {bundle['template_build_s']:.1f} s"
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
    headline = f"agent bundle in the template: a per-rollout network install starts {ratio:.1f}x slower "
    headline += (
        f"({install['median_s']:.2f} s vs {bundle['median_s']:.2f} s); last of {c['rollouts']} starts "
    )
    headline += f"{statistics.median(r['ratio'] for r in runs):.2f}x slowest build + creates"
    return Section("e2b_starts", headline, rows, notes=notes)


def docker_prepare_section(result: dict[str, Any]) -> Section:
    """Cold preparation of N environments on Docker against the slowest one alone."""
    runs, c = result["runs"], result["config"]
    alone = statistics.median(r["alone_s"] for r in runs)
    together = statistics.median(r["all_s"] for r in runs)
    rows = [
        Row(
            f"{c['environments']} environments prepared at once ({c['at_once']} builds at a time) vs the "
            "slowest alone",
            f"{together:.1f} s",
            f"{alone:.1f} s",
            [r["ratio"] for r in runs],
        )
    ]
    builds = ", ".join(f"{s:.1f}" for s in c["build_s"])
    notes = [f"each build's RUN step waits its time (s): {builds}; every build cold (a fresh salt each run)"]
    headline = f"{c['environments']} cold builds ready in {statistics.median(r['ratio'] for r in runs):.2f}x "
    headline += "the slowest alone"
    return Section("docker_prepare", headline, rows, notes=notes)


def agents_section(result: dict[str, Any]) -> Section:
    """Each agent's start-up to its first model call (against the toy agent's) and the proxy's cost."""
    agents, c = result["agents"], result["config"]
    base = agents.get("toy", {}).get("startup_s")

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f} s"

    rows = []
    for name, a in agents.items():
        ratio = [a["startup_s"] / base] if a["startup_s"] is not None and base else []
        cpu = "-" if a["proxy_cpu_ms_per_call"] is None else f"{a['proxy_cpu_ms_per_call']:.2f} ms"
        own = "-" if a["proxy_ms_per_call"] is None else f"{a['proxy_ms_per_call']:.2f} ms"
        rows.append(
            Row(
                f"{name}: start-up to its first model call (worst {seconds(a['startup_worst_s'])}); agent "
                f"phase {seconds(a['agent_s'])}, {a['model_calls']:g} calls; proxy CPU {cpu} per call, its "
                f"own time {own}; solved {a['solved']}/{a['runs']}",
                seconds(a["startup_s"]),
                seconds(base),
                ratio,
            )
        )
    slowest = max((a["startup_s"] or 0.0, n) for n, a in agents.items())
    headline = f"{len(agents)} agents, {c['runs']} run(s) each on {c['task']}; slowest start-up {slowest[1]} "
    headline += f"{slowest[0]:.2f} s"
    notes = ["no speed targets: a table to choose agents by their cost; medians over the runs"]
    return Section("agents", headline, rows, notes=notes)
