"""GPU check of the vLLM path: push perturbed weights over NCCL, then compare vLLM's logprobs with ours.

Run on a machine with two GPUs (NCCL refuses two ranks on one device), vLLM on one, this script on the
other; ``docs/gpu-checks.md`` has the vLLM command line. It:

1. loads ``--model`` with transformers on ``--device`` and adds seeded noise to every parameter;
2. pushes the parameters with :class:`VLLMEngine` over :class:`NcclTransport` (pause, NCCL transfer,
   finish, prefix-cache reset, resume) and times the push;
3. samples one completion from vLLM (``logprobs``, ``return_token_ids``, a seed, ``--temperature``);
4. recomputes ``log_softmax(logits / temperature)`` of the sampled ids with the perturbed model, and with
   the noise taken off again (which must differ: proof the push changed what vLLM serves).

With ``--lora`` it checks the adapter path instead: a random PEFT adapter saved under ``--adapter-dir``
(which vLLM must be able to read), published with ``push_adapter``, sampled by its served name.

Prints one JSON report and exits 0 when the largest logprob difference is within ``--tolerance``.
Importing this module (and ``--help``) needs neither CUDA nor vLLM nor transformers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from typing import Any

PROMPT = [{"role": "user", "content": "Write a Python function that reverses a linked list."}]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m harness_trainer.engines.gpu_check", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--vllm-url", required=True, help="vLLM's root URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="the model vLLM serves (HF id or local path)")
    parser.add_argument("--served-model-name", help="the name vLLM serves it under (default: --model)")
    parser.add_argument("--device", default="cuda", help="this process's GPU; not one vLLM uses")
    parser.add_argument("--dtype", default="bfloat16", help="torch dtype of the trainer copy (match vLLM's)")
    parser.add_argument("--noise", type=float, default=0.01, help="std of the noise added to each parameter")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=0.05, help="largest allowed |logprob difference|")
    parser.add_argument("--packed", action="store_true", help="packed NCCL broadcast (vLLM >= 0.28)")
    parser.add_argument("--master-address", help="address vLLM's workers reach this process at")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for the weight transfer")
    parser.add_argument("--lora", action="store_true", help="check push_adapter instead of push_weights")
    parser.add_argument("--adapter-dir", help="directory shared with vLLM for --lora (default: a temp dir)")
    parser.add_argument("--lora-rank", type=int, default=8)
    return parser.parse_args(argv)


def add_noise(model: Any, std: float, seed: int, sign: float = 1.0) -> None:
    """Add (or, with ``sign=-1``, take back) the same seeded noise to every parameter, in place."""
    import torch

    with torch.no_grad():
        for index, param in enumerate(model.parameters()):
            noise = torch.Generator(device=param.device).manual_seed(seed + index)
            param.add_(
                torch.randn(param.shape, generator=noise, device=param.device, dtype=param.dtype) * std * sign
            )


def logprobs_of(model: Any, prompt: list[int], completion: list[int], temperature: float) -> Any:
    """``log_softmax(logits / temperature)`` of ``completion`` after ``prompt``, in float32."""
    import torch

    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion], device=device)).logits[0, len(prompt) - 1 : -1]
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logprobs.gather(-1, torch.tensor(completion, device=device)[:, None])[:, 0].cpu()


async def sample(url: str, model_name: str, args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    body = {
        "model": model_name,
        "messages": PROMPT,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "seed": args.seed,
        "logprobs": True,
        "top_logprobs": 0,
        "return_token_ids": True,
    }
    async with httpx.AsyncClient(timeout=600) as client:
        reply = await client.post(f"{url}/v1/chat/completions", json=body)
    reply.raise_for_status()
    return reply.json()


async def push(args: argparse.Namespace, model: Any) -> tuple[Any, str, float]:
    """Publish the trainer's policy to vLLM; return the model to score with, the served name, seconds."""
    from harness_trainer.engines import NcclTransport, VLLMEngine

    served = args.served_model_name or args.model
    if args.lora:
        from peft import LoraConfig, get_peft_model

        # init_lora_weights=False: B is random too, so the adapter is not a no-op.
        config = LoraConfig(r=args.lora_rank, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        model = get_peft_model(model, config)
        path = f"{args.adapter_dir or tempfile.mkdtemp(prefix='gpu-check-')}/v1"
        model.save_pretrained(path)
        engine = VLLMEngine(args.vllm_url, lora=True, lora_name="gpu-check")
        started = time.monotonic()
        await engine.push_adapter(path, version=1)
        return model, engine.served_model or served, time.monotonic() - started
    add_noise(model, args.noise, args.seed)
    transport = NcclTransport(args.device, master_address=args.master_address, packed=args.packed)
    engine = VLLMEngine(args.vllm_url, weight_sync=transport, weight_sync_timeout=args.timeout)
    started = time.monotonic()
    try:
        await engine.push_weights(dict(model.named_parameters()), version=1)
    finally:
        engine.close()
    return model, served, time.monotonic() - started


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()
    model, served, push_s = await push(args, model)
    reply = await sample(args.vllm_url, served, args)
    prompt, sampled = reply["prompt_token_ids"], reply["choices"][0]["token_ids"]
    engine_logprobs = torch.tensor([e["logprob"] for e in reply["choices"][0]["logprobs"]["content"]])
    diff = (engine_logprobs - logprobs_of(model, prompt, sampled, args.temperature)).abs()
    if args.lora:
        with model.disable_adapter():
            before = logprobs_of(model, prompt, sampled, args.temperature)
    else:
        add_noise(model, args.noise, args.seed, sign=-1.0)
        before = logprobs_of(model, prompt, sampled, args.temperature)
    changed = float((engine_logprobs - before).abs().max())
    return {
        "path": "lora" if args.lora else "weights",
        "push_s": round(push_s, 3),
        "sampled_tokens": len(sampled),
        "max_abs_logprob_diff": float(diff.max()),
        "mean_abs_logprob_diff": float(diff.mean()),
        "diff_to_unpushed_policy": changed,
        "tolerance": args.tolerance,
        "ok": bool(diff.max() <= args.tolerance < changed),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = asyncio.run(run(args))
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
