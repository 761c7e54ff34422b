"""Decode throughput of the dev engine against a plain ``model.generate`` baseline, on CPU.

What is measured: generated tokens per second, one request at a time, for the same model, the same
chat-template-rendered prompts, sampling at temperature 1 with seed ``i`` for prompt ``i``:

- baseline: ``AutoModelForCausalLM`` (float32, CPU) in this process, ``model.generate(do_sample=True,
  top_k=0, max_new_tokens=min_new_tokens=--max-tokens)``: the full distribution, as the engine samples,
  and EOS never stops it early; it counts new tokens.
- server: ``harness-trainer engine`` started as a real subprocess on a free loopback port, hit with httpx
  at ``/v1/chat/completions`` with the capture fields (``logprobs``, ``top_logprobs: 0``,
  ``return_token_ids``). The dev engine stops at EOS (rare on the random tiny model), so its count is
  ``usage.completion_tokens``, not the requested maximum.

Both sides use the same torch thread count (``--threads``, default 1: the overhead in question is per-token
Python, HTTP and JSON work, which the thread count does not change, while on a small shared machine extra
intra-op threads mostly measure the neighbours). Each timed span covers prefill and decode (and, on the
server side, HTTP and JSON). One warm-up call per side precedes the repeats, which alternate
baseline, server, baseline, server... so both sides share the machine's noise. The report gives the median
and range of each side's tokens/s, the per-repeat ratio server/baseline, and the overhead ``1 - ratio``
against the target (overhead < 10 %). The server is stopped on every path (terminate, then kill).

Run: ``python -m benchmarks.engine [--quick] [--prompts 8 --max-tokens 128 --repeats 3 --threads N]
[--json OUT]``; ``--quick`` is a tiny configuration (2 prompts x 16 tokens, 2 repeats), the one
``python -m benchmarks --quick`` runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import positive, stop_process

TARGET_OVERHEAD = 0.10
TARGET_NAME = f"server overhead < {TARGET_OVERHEAD:.0%} of plain generate's tok/s"
FULL = {"prompts": 8, "max_tokens": 128, "repeats": 3}
QUICK = {"prompts": 2, "max_tokens": 16, "repeats": 2}
# Sampling at temperature 1 from the full distribution; generate's default top-k of 50 is switched off.
GENERATE = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
CAPTURE = {"temperature": 1.0, "logprobs": True, "top_logprobs": 0, "return_token_ids": True}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: the tiny model)")
    parser.add_argument("--quick", action="store_true", help=f"tiny configuration: {QUICK}")
    parser.add_argument(
        "--prompts", type=positive, default=None, help=f"prompts per repeat ({FULL['prompts']})"
    )
    parser.add_argument(
        "--max-tokens",
        type=positive,
        default=None,
        help=f"tokens to generate per prompt ({FULL['max_tokens']})",
    )
    parser.add_argument(
        "--repeats",
        type=positive,
        default=None,
        help=f"interleaved baseline/server repeats ({FULL['repeats']})",
    )
    parser.add_argument("--threads", type=positive, default=1, help="torch threads, both sides (see above)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    return parser


def chat_prompts(count: int) -> list[list[dict[str, str]]]:
    topics = ("a lighthouse", "sorting algorithms", "bread", "a chess opening", "rain", "the moon")
    return [
        [{"role": "user", "content": f"Tell me about {topics[i % len(topics)]} (question {i})."}]
        for i in range(count)
    ]


def run_baseline(model: Any, prompt_ids: list[list[int]], max_tokens: int, pad_id: int) -> tuple[int, float]:
    """Generate for every prompt in turn; return (new tokens, seconds)."""
    import torch

    tokens, seconds = 0, 0.0
    for i, ids in enumerate(prompt_ids):
        torch.manual_seed(i)
        input_ids = torch.tensor([ids])
        start = time.perf_counter()
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            pad_token_id=pad_id,
            **GENERATE,
        )
        seconds += time.perf_counter() - start
        tokens += out.shape[1] - input_ids.shape[1]
    return tokens, seconds


def run_server(
    client: Any, prompts: list[list[dict[str, str]]], prompt_ids: list[list[int]], max_tokens: int
) -> tuple[int, float]:
    """Send every prompt in turn; return (completion tokens, seconds)."""
    tokens, seconds = 0, 0.0
    for i, messages in enumerate(prompts):
        body = {"messages": messages, "max_tokens": max_tokens, "seed": i, **CAPTURE}
        start = time.perf_counter()
        response = client.post("/v1/chat/completions", json=body)
        seconds += time.perf_counter() - start
        response.raise_for_status()
        reply = response.json()
        if reply["prompt_token_ids"] != prompt_ids[i]:
            raise RuntimeError(f"prompt {i}: the server rendered different prompt ids than the baseline")
        tokens += reply["usage"]["completion_tokens"]
    return tokens, seconds


@contextlib.contextmanager
def running_engine(model: str, threads: int) -> Iterator[tuple[str, subprocess.Popen]]:
    """``harness-trainer engine`` on a free loopback port; stopped (terminate, then kill) on every path."""
    from harness_trainer.net import free_port, wait_until_healthy

    port = free_port()
    command = [sys.executable, "-m", "harness_trainer.cli", "engine", "--model", model, "--port", str(port)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryFile() as log:
        engine = subprocess.Popen(
            [*command, "--threads", str(threads)], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            wait_until_healthy(f"http://127.0.0.1:{port}", engine)
            yield f"http://127.0.0.1:{port}", engine
        except Exception:
            log.seek(0)  # the engine's own account of what went wrong
            print(log.read().decode(errors="replace")[-4000:], file=sys.stderr)
            raise
        finally:
            stop_process(engine, 15.0)


def summarize(samples: list[dict[str, float]], config: dict[str, Any], server_pid: int) -> dict[str, Any]:
    def spread(values: list[float]) -> dict[str, float]:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    ratio = spread([s["server_tps"] / s["baseline_tps"] for s in samples])
    overhead = 1 - ratio["median"]
    result = {"config": config, "repeats": samples, "server_pid": server_pid}
    result |= {f"{side}_tps": spread([s[f"{side}_tps"] for s in samples]) for side in ("baseline", "server")}
    result |= {"ratio": ratio, "overhead": overhead, "target_overhead": TARGET_OVERHEAD}
    return result | {"meets_target": overhead < TARGET_OVERHEAD}


def print_report(result: dict[str, Any]) -> None:
    c = result["config"]
    print(
        f"\nmodel {c['model']}: {c['prompts']} prompts x {c['max_tokens']} tokens, "
        f"{c['repeats']} repeats, {c['threads']} torch threads, sequential requests"
    )
    ratio = result["ratio"]
    overhead = {"median": 1 - ratio["median"], "min": 1 - ratio["max"], "max": 1 - ratio["min"]}
    rows = [("", {k: k for k in ratio}, "{:>10}"), ("baseline tok/s", result["baseline_tps"], "{:10.1f}")]
    rows += [("server tok/s", result["server_tps"], "{:10.1f}"), ("ratio server/baseline", ratio, "{:10.3f}")]
    for label, values, fmt in [*rows, ("server overhead", overhead, "{:10.1%}")]:
        print(f"{label:<24}" + "".join(fmt.format(values[k]) for k in ("median", "min", "max")))
    verdict = "PASS" if result["meets_target"] else "FAIL"
    print(
        f"verdict: {verdict}: server overhead {result['overhead']:.1%} (median) against the target "
        f"< {TARGET_OVERHEAD:.0%}"
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the table, return the results (also written to ``--json``)."""
    args = build_parser().parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():  # --quick or the full defaults, flags on top
        if getattr(args, key) is None:
            setattr(args, key, value)
    started = time.perf_counter()
    import httpx
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from harness_trainer.dev_engine.chat import render_prompt_ids
    from harness_trainer.models.tiny import ensure_tiny_model

    model_dir = args.model or str(ensure_tiny_model())
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompts = chat_prompts(args.prompts)
    prompt_ids = [render_prompt_ids(tokenizer, messages, None) for messages in prompts]
    config = {"model": model_dir, "threads": args.threads}
    config |= {"prompts": args.prompts, "max_tokens": args.max_tokens, "repeats": args.repeats}

    samples: list[dict[str, float]] = []
    with (
        running_engine(model_dir, args.threads) as (url, engine),
        httpx.Client(base_url=url, timeout=600) as client,
    ):
        run_baseline(model, prompt_ids[:1], 4, pad_id)  # warm-up, not timed
        run_server(client, prompts[:1], prompt_ids[:1], 4)
        for repeat in range(args.repeats):
            b_tokens, b_seconds = run_baseline(model, prompt_ids, args.max_tokens, pad_id)
            s_tokens, s_seconds = run_server(client, prompts, prompt_ids, args.max_tokens)
            sample = {"baseline_tokens": b_tokens, "baseline_tps": b_tokens / b_seconds}
            sample |= {"server_tokens": s_tokens, "server_tps": s_tokens / s_seconds}
            samples.append(sample)
            print(
                f"repeat {repeat + 1}/{args.repeats}: baseline {sample['baseline_tps']:.1f} tok/s, "
                f"server {sample['server_tps']:.1f} tok/s ({s_tokens} of {b_tokens} tokens)",
                flush=True,
            )
    result = summarize(samples, config | {"quick": args.quick}, engine.pid)
    result["elapsed_s"] = time.perf_counter() - started
    measured = f"{result['overhead']:.1%} (median; ratio server/baseline {result['ratio']['median']:.3f})"
    result["verdicts"] = [{"target": TARGET_NAME, "pass": result["meets_target"], "measured": measured}]
    result["all_pass"] = result["meets_target"]
    print_report(result)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops the engine server too
    main()
