"""FSDP2 at world size 2 on CPU (gloo): peak memory per rank and step time against the unsharded run.

Set-up: a random Qwen2-shaped causal LM built from a config (no Hub; default about 70M parameters, float32,
tied embeddings), trained with AdamW on random tokens, in four runs as real subprocesses, one after the
other:

- **single**: one plain process, unsharded, glibc's default allocator (the baseline: the trainer's
  unsharded run);
- **single_mapped**: the same process with large allocations mapped on their own
  (:func:`harness_trainer.trainer.fsdp2.map_large_allocations`), to tell the allocator's share of the
  saving from sharding's;
- **fsdp2**: two ``torchrun`` ranks (gloo), the model sharded by the trainer's own code
  (:func:`harness_trainer.trainer.fsdp2.shard`: ``fully_shard`` per decoder layer, then the root, the
  optimizer re-pointed at the shards), large allocations mapped first, as the trainer does on CPU when
  FSDP2 is asked for;
- **ddp**: two ``torchrun`` ranks replicating the model with torch's ``DistributedDataParallel``, glibc's
  default allocator.

Every rank loads the full model first and then shards it, as the trainer does (``load_policy`` on every
rank). A step is the same global batch in every run: ``2`` micro-batches of ``--rows × --seq`` tokens, both
on the single process (gradients accumulated), one per rank at world size 2; then clip the gradient norm,
an AdamW step and ``zero_grad``. Each run does one untimed warm-up step and ``--steps`` timed ones. The
machine's cores are split evenly: the single process gets them all, each rank half (``torch`` threads).

Reported per run: the peak RSS of each rank (``ru_maxrss``, the high-water mark of the whole process:
Python, torch, the model as loaded, training; and ``VmRSS`` once loaded, once prepared, after the warm-up
and at the end), the bytes of parameters, gradients and optimizer state the
rank holds (local shards), and the median step time. The ratios: the largest rank's peak RSS over the single
process's, the held bytes' ratio, and the median step time's ratio, for each run; and FSDP2's against
``single_mapped``. No target: the issue asks for the ratios; the one verdict says whether FSDP2's peak RSS
per rank is below the unsharded run's.

Why the allocator matters: FSDP2 allocates and frees a layer's gathered weights and full gradients at every
layer, and glibc's heap keeps what is freed (its mmap threshold grows to 32 MiB as blocks are freed), so
with its default FSDP2's peak RSS per rank stays near the unsharded run's. ``--glibc-default`` measures
every run with glibc's defaults (no ``single_mapped`` run). A ``MALLOC_MMAP_THRESHOLD_`` in the environment
reaches every run, and ``map_large_allocations`` then leaves it alone.

Run: ``python benchmarks/fsdp2.py [--quick] [--hidden 640] [--layers 10] [--steps 3] [--glibc-default]
[--json OUT]``;
``--quick``: a tiny shape (hidden 64, 2 layers) and 2 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: its siblings import from the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import ROOT, print_table, print_verdicts, stop_process

VERDICT = "FSDP2 peak RSS per rank below the unsharded run's"
FULL = {"hidden": 640, "layers": 10, "intermediate": 1792, "vocab": 32000, "rows": 2, "seq": 128, "steps": 3}
QUICK = {"hidden": 64, "layers": 2, "intermediate": 128, "vocab": 1000, "rows": 1, "seq": 32, "steps": 2}
RUNS = ("single", "single_mapped", "fsdp2", "ddp")
MAPPED = {"single_mapped", "fsdp2"}
"""The runs that map large allocations on their own (unless ``--glibc-default``)."""
TIMEOUT_S = 900.0


def build_model(config: dict[str, Any]) -> Any:
    """The random Qwen2-shaped model of ``config``'s shape (seed 0), in training mode."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    heads = max(1, config["hidden"] // 64)
    shape = Qwen2Config(
        hidden_size=config["hidden"], intermediate_size=config["intermediate"],
        num_hidden_layers=config["layers"], num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
        vocab_size=config["vocab"], tie_word_embeddings=True, max_position_embeddings=4096,
    )  # fmt: skip
    model = Qwen2ForCausalLM(shape)
    model.train()
    return model


def rss_mb() -> float:
    """This process's resident set now, in MB (``VmRSS``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def worker(run: str, config: dict[str, Any], out: Path) -> None:
    """One rank of ``run``: train and write ``out/{run}-rank{R}.json``."""
    import torch
    import torch.distributed as dist

    from harness_trainer.trainer.fsdp2 import local_bytes, map_large_allocations, shard

    mapped = run in MAPPED and not config["glibc_default"] and map_large_allocations()  # before loading
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        dist.init_process_group("gloo")
    model = build_model(config)
    loaded_rss = rss_mb()
    parameters = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    trained: Any = model
    if run == "fsdp2":
        trained = shard(model, optimizer, world)
    elif run == "ddp":
        trained = torch.nn.parallel.DistributedDataParallel(model)
    micro = 2 // world  # the same global batch of 2 micro-batches in every run
    generator = torch.Generator().manual_seed(rank)

    def step() -> float:
        started = time.perf_counter()
        for _ in range(micro):
            tokens = torch.randint(config["vocab"], (config["rows"], config["seq"]), generator=generator)
            loss = trained(input_ids=tokens, labels=tokens).loss / 2
            (loss * world).backward()  # the backend averages over ranks: the global step's gradient
        norm = torch.nn.utils.clip_grad_norm_(trained.parameters(), 1.0)
        float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        optimizer.step()
        held = {
            "params": local_bytes(list(model.parameters())),
            "grads": local_bytes([p.grad for p in model.parameters() if p.grad is not None]),
            "optimizer": local_bytes([v for s in optimizer.state.values() for v in s.values() if v.dim()]),
        }
        optimizer.zero_grad(set_to_none=True)
        step.held = held  # type: ignore[attr-defined]
        return time.perf_counter() - started

    sharded_rss = rss_mb()
    step()  # warm-up
    after_warmup = rss_mb()
    times = [step() for _ in range(config["steps"])]
    result = {
        "rank": rank,
        "world_size": world,
        "mapped": mapped,
        "parameters": parameters,
        "step_s": times,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # kB on Linux
        "rss_mb": {"loaded": loaded_rss, "prepared": sharded_rss, "warmed_up": after_warmup, "end": rss_mb()},
        "held_mb": {key: value / 2**20 for key, value in step.held.items()},  # type: ignore[attr-defined]
    }
    (out / f"{run}-rank{rank}.json").write_text(json.dumps(result))
    if world > 1:
        dist.barrier()  # gloo aborts a process whose peer destroys the group while it still talks
        dist.destroy_process_group()


def launch(run: str, config: dict[str, Any], out: Path) -> list[dict[str, Any]]:
    """Run ``run`` as subprocesses (``torchrun`` with 2 ranks, or one plain process); each rank's result.

    Raises:
        RuntimeError: it exited non-zero or ran past its time (the end of its output attached).
    """
    script = [str(Path(__file__).resolve()), "--worker", run, "--config", json.dumps(config)]
    script += ["--out", str(out)]
    if run.startswith("single"):
        command = [sys.executable, *script]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        command += script
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        output = ""
    finally:
        stop_process(process, 30.0)
        if not run.startswith("single"):  # torchrun's ranks, whatever happened to torchrun
            try:
                os.killpg(process.pid, 9)
            except ProcessLookupError:
                pass
    if process.returncode != 0:
        raise RuntimeError(f"{run} exited with {process.returncode}:\n{output[-3000:]}")
    ranks = 2 if run in ("fsdp2", "ddp") else 1
    return [json.loads((out / f"{run}-rank{r}.json").read_text()) for r in range(ranks)]


def summarise(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's numbers: the largest rank's peak RSS and held bytes, the slowest rank's median step."""
    return {
        "ranks": ranks,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
        "mapped": all(r.get("mapped", False) for r in ranks),
        "held_mb": max(sum(r["held_mb"].values()) for r in ranks),
        "step_s": max(statistics.median(r["step_s"]) for r in ranks),
        "parameters": ranks[0]["parameters"],
    }


def ratios(runs: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each run against the single process: peak RSS, held bytes and step time, as ratios."""
    single = runs["single"]
    return {
        run: {key: runs[run][key] / single[key] for key in ("peak_rss_mb", "held_mb", "step_s")}
        for run in runs
        if run != "single"
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny shape and 2 steps")
    parser.add_argument("--hidden", type=int, default=FULL["hidden"])
    parser.add_argument("--layers", type=int, default=FULL["layers"])
    parser.add_argument("--steps", type=int, default=FULL["steps"])
    parser.add_argument("--glibc-default", action="store_true", help="glibc's defaults in every run")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", choices=RUNS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--config", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, json.loads(args.config), args.out)
        return 0
    config = dict(QUICK) if args.quick else {**FULL, "hidden": args.hidden, "layers": args.layers}
    config["steps"] = QUICK["steps"] if args.quick else args.steps
    config["glibc_default"] = args.glibc_default
    config["malloc_mmap_threshold_env"] = os.environ.get("MALLOC_MMAP_THRESHOLD_")  # reaches every run
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fsdp2-") as scratch:
        runs = {}
        for run in RUNS:
            if run == "single_mapped" and args.glibc_default:
                continue
            runs[run] = summarise(launch(run, config, Path(scratch)))
            rss, step = runs[run]["peak_rss_mb"], runs[run]["step_s"]
            print(f"{run}: peak RSS {rss:.0f} MB, step {step:.2f} s", flush=True)
    against = ratios(runs)
    rss = against["fsdp2"]["peak_rss_mb"]
    result = {
        "config": {**config, "quick": args.quick, "cores": os.cpu_count()},
        "runs": runs,
        "ratios": against,
        "fsdp2_vs_single_mapped": (
            {key: runs["fsdp2"][key] / runs["single_mapped"][key] for key in ("peak_rss_mb", "step_s")}
            if "single_mapped" in runs
            else None
        ),
        "verdicts": [{"target": VERDICT, "pass": rss < 1.0, "measured": f"{rss:.2f}x the single process"}],
        "elapsed_s": time.perf_counter() - started,
    }
    result["all_pass"] = all(v["pass"] for v in result["verdicts"])
    rows = [("run", "peak RSS/rank MB", "held MB/rank", "step s", "RSS ratio", "held ratio", "step ratio")]
    for name, run in runs.items():
        r = against.get(name, {"peak_rss_mb": 1.0, "held_mb": 1.0, "step_s": 1.0})
        rows.append((
            name, f"{run['peak_rss_mb']:.0f}", f"{run['held_mb']:.0f}", f"{run['step_s']:.2f}",
            f"{r['peak_rss_mb']:.2f}", f"{r['held_mb']:.2f}", f"{r['step_s']:.2f}",
        ))  # fmt: skip
    print(f"{runs['single']['parameters'] / 1e6:.1f}M parameters, float32")
    print_table(rows)
    print_verdicts(result, len(VERDICT))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
