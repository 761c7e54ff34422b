"""The learning benchmark's whole search, on the record: every run it made, every other try, every decision.

``benchmarks/learning_search.jsonl`` (in the repository) holds one JSON object a line, appended, never
rewritten:

- ``{"kind": "run", ...}``: one dev-loop run of ``benchmarks/learning.py`` (it appends each as it ends,
  but in ``--quick``, the test's configuration): ``logged_at``, ``commit`` (and ``dirty``: uncommitted
  changes), ``configuration`` (what decides the run but its seed: the task family, mode, engine, recipe,
  steps, evaluation) with its ``configuration_id`` (a digest of it), ``seed``, ``arm`` (``trained`` or
  ``frozen``), ``held_out_pass_at_1`` (``start``, ``end``), ``reward`` (``first``, ``last``: the training
  reward over the first and the last quarter of its steps), ``minutes``, and ``note`` (why the
  configuration was tried, when given);
- ``{"kind": "note", ...}``: a try that is not a benchmark run (a warm-up probe, a family design given up
  before any run, a run of another tool), in words with its numbers (``logged_at``, ``commit``, ``text``,
  and the ``configuration_id`` it is about, if any);
- ``{"kind": "decision", ...}``: a configuration ``kept`` or ``dropped``, and why;
- ``{"kind": "history", ...}``: what was tried before this log existed, as the commits and BENCHMARKS.md
  of the time recorded it (``when``, ``commit``, ``text``).

:func:`render` makes the markdown that ``BENCHMARKS.md``'s learning section carries (the benchmark's report
renders it; a test checks the committed BENCHMARKS.md holds the current log's rendering): how many
configurations, each one's runs and pass@1 means per arm, which were dropped and why, then the notes and
the history. Pure functions but :func:`append` and :func:`read`.

Command line: ``python -m benchmarks.learning_search note "TEXT" [--configuration-id ID]``,
``python -m benchmarks.learning_search decide ID kept|dropped "WHY"``, ``python -m benchmarks.learning_search
render [--into BENCHMARKS.md]`` (the file's block between :data:`START` and :data:`END`).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

SEARCH_LOG = Path(__file__).resolve().parent / "learning_search.jsonl"
BENCHMARKS_MD = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"
START, END = "<!-- learning-search:start -->", "<!-- learning-search:end -->"
"""Where ``BENCHMARKS.md`` carries the rendering (``render --into``, and the benchmark's report)."""
KINDS = ("run", "note", "decision", "history")
DECISIONS = ("kept", "dropped")
CONFIGURATION_KEYS = (
    "tasks", "mode", "engine", "recipe", "max_steps", "eval_steps", "eval_num_generations",
    "eval_temperature",
)  # fmt: skip
"""What decides a run but its seed and arm: a configuration."""


def configuration_of(config: dict[str, Any], mode: str, engine: str) -> dict[str, Any]:
    """The configuration of the benchmark's runs in ``mode`` on ``engine``: its :data:`CONFIGURATION_KEYS`,
    the task folder by its name (the same family wherever the repository lies)."""
    chosen = {key: config[key] for key in CONFIGURATION_KEYS if key in config}
    chosen["mode"], chosen["engine"] = mode, engine
    chosen["tasks"] = Path(str(config["tasks"])).name
    return chosen


def configuration_id(configuration: dict[str, Any]) -> str:
    """A short digest naming ``configuration`` (the same settings, the same id)."""
    return hashlib.sha256(json.dumps(configuration, sort_keys=True).encode()).hexdigest()[:8]


def run_entry(
    configuration: dict[str, Any], run: dict[str, Any], *, commit: str, dirty: bool, when: str, note: str = ""
) -> dict[str, Any]:
    """The log line of one finished run (``run``: :func:`benchmarks.learning.dev_run`'s record)."""
    return {
        "kind": "run", "logged_at": when, "commit": commit, "dirty": dirty,
        "configuration_id": configuration_id(configuration), "configuration": configuration,
        "seed": run["seed"], "arm": run["kind"],
        "held_out_pass_at_1": {"start": run["start"], "end": run["end"]},
        "reward": {"first": run["first"], "last": run["last"]},
        "minutes": round(run["seconds"] / 60, 2), "note": note,
    }  # fmt: skip


def note_entry(text: str, *, commit: str, when: str, configuration: str | None = None) -> dict[str, Any]:
    """A try that is not a benchmark run, in words."""
    if not text.strip():
        raise ValueError("a note needs its text")
    return {
        "kind": "note",
        "logged_at": when,
        "commit": commit,
        "text": text,
        "configuration_id": configuration,
    }


def decision_entry(configuration: str, decision: str, why: str, *, when: str) -> dict[str, Any]:
    """A configuration kept or dropped, and why."""
    if decision not in DECISIONS or not why.strip():
        raise ValueError(f"a decision is one of {DECISIONS} with its reason, got {decision!r}, {why!r}")
    return {"kind": "decision", "logged_at": when, "configuration_id": configuration, "decision": decision,
            "why": why}  # fmt: skip


def render(entries: Sequence[dict[str, Any]]) -> str:
    """The whole search as markdown (see the module docstring)."""
    runs = [e for e in entries if e["kind"] == "run"]
    configurations: dict[str, dict[str, Any]] = {}
    for entry in runs:
        configurations.setdefault(entry["configuration_id"], entry["configuration"])
    decided = {e["configuration_id"]: e for e in entries if e["kind"] == "decision"}
    history = [e for e in entries if e["kind"] == "history"]
    notes = [e for e in entries if e["kind"] == "note"]
    dropped = sum(1 for c in configurations if decided.get(c, {}).get("decision") == "dropped")
    lines = [
        "### The whole search (rendered from `benchmarks/learning_search.jsonl`)\n",
        f"{len(configurations)} configuration(s) run by the benchmark since its log began, {dropped} "
        f"dropped; {len(runs)} run(s); {_count(len(notes), 'other try')}; "
        f"{_count(len(history), 'earlier try')} from before the log.\n",
    ]
    if configurations:
        lines += [
            "| configuration | family | mode | engine | steps | recipe | seeds | trained: held-out pass@1 "
            "start → end (mean) | frozen | decision |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for cid, configuration in configurations.items():
            mine = [e for e in runs if e["configuration_id"] == cid]
            seeds = sorted({e["seed"] for e in mine})
            verdict = decided.get(cid)
            said = f"{verdict['decision']}: {verdict['why']}" if verdict else "-"
            lines.append(
                f"| {cid} | {configuration.get('tasks', '?')} | {configuration.get('mode', '?')} | "
                f"{configuration.get('engine', '?')} | {configuration.get('max_steps', '?')} | "
                f"`{configuration.get('recipe', '') or '(defaults)'}` | {','.join(map(str, seeds))} | "
                f"{_arm(mine, 'trained')} | {_arm(mine, 'frozen')} | {said} |"
            )
        lines.append("")
    if notes:
        lines.append("Other tries, as logged:\n")
        lines += [f"- {e['logged_at'][:10]} ({e['commit']}): {e['text']}" for e in notes]
        lines.append("")
    if history:
        lines.append("Before the log (from the commits and BENCHMARKS.md of the time):\n")
        lines += [f"- {e['when']} ({e['commit']}): {e['text']}" for e in history]
        lines.append("")
    return "\n".join(lines)


def _count(n: int, what: str) -> str:
    return f"{n} {what[:-1]}ies" if n != 1 and what.endswith("y") else f"{n} {what}"


def _arm(runs: Iterable[dict[str, Any]], arm: str) -> str:
    mine = [e for e in runs if e["arm"] == arm]
    if not mine:
        return "-"
    start = sum(e["held_out_pass_at_1"]["start"] for e in mine) / len(mine)
    end = sum(e["held_out_pass_at_1"]["end"] for e in mine) / len(mine)
    return f"{start:.3f} → {end:.3f} ({len(mine)} run{'s' if len(mine) > 1 else ''})"


def block(entries: Sequence[dict[str, Any]]) -> str:
    """:func:`render` between the markers, as ``BENCHMARKS.md`` carries it."""
    return f"{START}\n{render(entries).rstrip()}\n{END}"


def replace_block(text: str, entries: Sequence[dict[str, Any]]) -> str:
    """``text`` with its marked block replaced by the current rendering.

    Raises:
        ValueError: ``text`` has no marked block.
    """
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no {START} ... {END} block to replace")
    return text[:start] + block(entries) + text[end + len(END) :]


def read(path: Path = SEARCH_LOG) -> list[dict[str, Any]]:
    """The log's entries, in order; an empty list where there is no log.

    Raises:
        ValueError: a line is not JSON, or not an entry of a known kind (naming the line).
    """
    if not path.is_file():
        return []
    entries = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON: {exc}") from exc
        if not isinstance(entry, dict) or entry.get("kind") not in KINDS:
            raise ValueError(f"{path}:{number}: not a search entry (kind one of {KINDS})")
        entries.append(entry)
    return entries


def append(entries: Sequence[dict[str, Any]], path: Path = SEARCH_LOG) -> None:
    """Append ``entries`` to the log, one line each (flushed: a run logged is not lost to a later crash)."""
    with path.open("a") as handle:
        handle.writelines(json.dumps(entry, sort_keys=True) + "\n" for entry in entries)
        handle.flush()


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def commit() -> tuple[str, bool]:
    """This checkout's commit (short) and whether it has uncommitted changes; ``unknown`` outside git."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, check=True).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown", False
    return head, bool(status.strip())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--log", type=Path, default=SEARCH_LOG)
    sub = parser.add_subparsers(dest="command", required=True)
    note = sub.add_parser("note", help="log a try that is not a benchmark run")
    note.add_argument("text")
    note.add_argument("--configuration-id", default=None)
    decide = sub.add_parser("decide", help="log a configuration kept or dropped, and why")
    decide.add_argument("configuration_id")
    decide.add_argument("decision", choices=DECISIONS)
    decide.add_argument("why")
    shown = sub.add_parser("render", help="print the search as BENCHMARKS.md carries it")
    shown.add_argument("--into", type=Path, default=None, help="replace the marked block of this file")
    args = parser.parse_args(argv)
    entries = read(args.log)
    if args.command == "render":
        if args.into is None:
            print(render(entries))
        else:
            args.into.write_text(replace_block(args.into.read_text(), entries))
        return 0
    if args.command == "note":
        head, _ = commit()
        entry = note_entry(args.text, commit=head, when=now(), configuration=args.configuration_id)
    else:
        known = {e["configuration_id"] for e in entries if e["kind"] == "run"}
        if args.configuration_id not in known:
            parser.error(
                f"no run of configuration {args.configuration_id!r} is logged (known: {sorted(known)})"
            )
        entry = decision_entry(args.configuration_id, args.decision, args.why, when=now())
    append([entry], args.log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
