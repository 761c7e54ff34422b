"""Several training processes: dealing micro-batches, summing stats, the FSDP state conversions, and two
real gloo processes on CPU training exactly like one."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from accelerate.utils import DistributedType
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from transformers import AutoModelForCausalLM, get_scheduler

from harness_trainer.trainer.checkpoint import TrainerState, load_checkpoint, save_checkpoint
from harness_trainer.trainer.distributed import (
    Collective,
    MicroPlan,
    by_index,
    by_name,
    checkpoint_parts,
    prepare,
    shard_micro_batches,
    split_step,
    stats_from_vector,
    stats_vector,
)
from harness_trainer.trainer.step.batch import StepBatch
from harness_trainer.trainer.step.logprobs import token_logprobs, use_packed_attention
from harness_trainer.trainer.step.loss import LossConfig, LossStats, policy_loss
from harness_trainer.trainer.step.packing import collate, plan_micro_batches
from harness_trainer.trainer.step.rows import Row
from tests.trainer.distributed_run import FIRST_STEPS, TOTAL_STEPS, trained_alone

REPO = Path(__file__).resolve().parents[2]


def make_row(length: int, rollout: int) -> Row:
    """A row whose second half is trained, with made-up behaviour logprobs."""
    rng = random.Random(rollout)
    targets = [0] * (length // 2) + [1] * (length - length // 2)
    return Row(
        rollout=rollout,
        input_ids=[rng.randrange(4096) for _ in range(length)],
        targets=targets,
        behaviour_logps=[-rng.uniform(0.5, 3.0) if bit else 0.0 for bit in targets],
    )


def test_every_micro_batch_goes_to_exactly_one_rank_and_short_ranks_get_padding():
    plan = [[make_row(n, i)] for i, n in enumerate([9, 8, 7, 6, 5])]
    shards = shard_micro_batches(plan, 2)
    assert [len(shard) for shard in shards] == [3, 3]
    dealt = [m.rows for shard in shards for m in shard if not m.padding]
    assert sorted(map(id, (r for rows in dealt for r in rows))) == sorted(id(rows[0]) for rows in plan)
    assert [m.rows[0].rollout for m in shards[0]] == [0, 2, 4]
    padding = shards[1][-1]
    assert padding.padding and padding.rows == [plan[4][0]]  # the shortest row of the step


def test_one_rank_gets_the_whole_plan_in_order_and_an_empty_plan_gives_nothing():
    plan = [[make_row(6, 0), make_row(4, 1)], [make_row(5, 2)]]
    assert shard_micro_batches(plan, 1) == [[MicroPlan(plan[0]), MicroPlan(plan[1])]]
    assert shard_micro_batches([], 3) == [[], [], []]
    with pytest.raises(ValueError, match="world_size"):
        shard_micro_batches(plan, 0)


def test_a_split_step_gives_each_rank_the_shared_advantages_weights_and_metrics():
    rows = [make_row(6, i) for i in range(3)]
    batch = StepBatch(rows=rows, advantages={0: 1.0, 1: -1.0, 2: 0.5}, weights={0: 0.1, 1: 0.2, 2: 0.3})
    shares = split_step(batch, token_budget=8, world_size=2, metrics={"reward": 0.5}, groups_consumed=7)
    assert len(shares) == 2
    for share in shares:
        assert share.advantages == batch.advantages and share.weights == batch.weights
        assert share.metrics == {"reward": 0.5} and share.groups_consumed == 7
        assert len(share.micro_batches) == 2


def test_loss_stats_survive_the_trip_through_a_vector_with_counts_as_ints():
    stats = LossStats(n_tokens=7, ratio_sum=6.5, capped=1, clipped_low=2, clipped_high=3, kl_sum=0.25,
                      entropy_sum=9.0, loss=-0.125)  # fmt: skip
    back, forwarded = stats_from_vector(stats_vector(stats, 42))
    assert back == stats and forwarded == 42
    assert isinstance(back.n_tokens, int) and isinstance(back.loss, float)


def test_a_single_process_collective_hands_everything_back_unchanged():
    collective = Collective(rank=0, world_size=1)
    assert collective.is_main
    assert collective.scatter(["mine"]) == "mine" and collective.scatter(None) is None
    assert collective.broadcast({"a": 1}) == {"a": 1}
    stats = LossStats(n_tokens=3, loss=1.5)
    assert collective.sum_stats(stats, 9) == (stats, 9)


def test_a_single_process_deal_hands_back_the_first_item_or_the_error():
    collective = Collective(rank=0, world_size=1)
    assert collective.deal(lambda: ["only"]) == "only" and collective.deal(lambda: None) is None

    def fail() -> list[str]:
        raise RuntimeError("no groups")

    with pytest.raises(RuntimeError, match="no groups"):
        collective.deal(fail)


def collectives_worker(rank: int, store: str, out: str) -> None:
    """One of two gloo processes: what each collective gives this rank, into ``out/rank{rank}.json``."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    collective = Collective(rank, 2)
    seen: dict = {"dealt": collective.deal(lambda: ["for 0", "for 1"])}
    seen["broadcast"] = collective.broadcast({"from": rank})
    stats, forwarded = collective.sum_stats(LossStats(n_tokens=rank + 1, loss=0.5 * (rank + 1)), 10 + rank)
    seen["summed"] = [stats.n_tokens, stats.loss, forwarded]

    def fail() -> list[str]:
        raise RuntimeError("rank 0 failed")

    try:
        seen["after_failure"] = collective.deal(fail)
    except RuntimeError as exc:
        seen["error"] = str(exc)
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_two_processes_deal_broadcast_sum_and_stop_together_when_rank_0_fails(tmp_path):
    torch.multiprocessing.spawn(collectives_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    zero, one = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert (zero["dealt"], one["dealt"]) == ("for 0", "for 1")
    assert zero["broadcast"] == one["broadcast"] == {"from": 0}
    assert zero["summed"] == one["summed"] == [3, 1.5, 21]
    assert zero["error"] == "rank 0 failed" and "error" not in one and one["after_failure"] is None


def test_ranks_backpropagating_world_size_times_their_share_average_to_the_one_process_gradient(
    tiny_model_dir,
):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    use_packed_attention(model)
    rows = [make_row(n, i) for i, n in enumerate([12, 10, 8, 6, 5])]
    advantages = {i: (-1.0) ** i for i in range(5)}
    weights = {i: 1.0 / (5 * sum(rows[i].targets)) for i in range(5)}
    plan = plan_micro_batches(rows, 16)
    assert len(plan) == 3

    def gradient(micro_batches: list[MicroPlan], scale: int) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        for plan_ in micro_batches:
            micro = collate(plan_.rows, advantages, weights)
            if plan_.padding:
                micro.token_weights.zero_()
            logps, _ = token_logprobs(model, micro, 1.0, targets_only=True)
            loss, _ = policy_loss(logps, micro, LossConfig())
            (loss * scale).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    single = gradient([MicroPlan(rows) for rows in plan], 1)
    ranks = [gradient(shard, 2) for shard in shard_micro_batches(plan, 2)]
    for name, expected in single.items():
        torch.testing.assert_close((ranks[0][name] + ranks[1][name]) / 2, expected, rtol=1e-5, atol=1e-8)
    padding = gradient([MicroPlan([rows[4]], padding=True)], 2)
    assert all(not g.any() for g in padding.values())


# -- the FSDP state handling, on plain modules ----------------------------------------------------------


class PretendFsdp:
    """An accelerator that reports FSDP but shards nothing: the FSDP save and resume paths on one process.

    Its gathered state dict is a copy, as a real gather returns (tied weights no longer share storage).
    """

    distributed_type = DistributedType.FSDP
    is_main_process = True

    def prepare(self, model, optimizer):
        return model, optimizer

    def get_state_dict(self, model):
        return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def training(model_dir: Path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.model.layers[0].mlp.requires_grad_(False)  # the optimizer holds a subset, in model order
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=1, num_training_steps=10)
    return model, optimizer, scheduler


def take_steps(model, optimizer, scheduler, steps: int = 2) -> None:
    for _ in range(steps):
        model(torch.tensor([[1, 2, 3, 4]])).logits.float().square().mean().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def test_optimizer_state_by_name_converts_to_the_index_form_a_single_process_saves_and_back(tiny_model_dir):
    model, optimizer, scheduler = training(tiny_model_dir)
    take_steps(model, optimizer, scheduler)
    named = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    indexed = by_index(named)
    expected = optimizer.state_dict()
    assert indexed["param_groups"] == expected["param_groups"]
    assert indexed["state"].keys() == expected["state"].keys()
    for key, values in expected["state"].items():
        for field, value in values.items():
            torch.testing.assert_close(indexed["state"][key][field], value, rtol=0, atol=0)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert by_index(by_name(expected, names))["param_groups"] == expected["param_groups"]


@pytest.mark.slow
def test_an_fsdp_checkpoint_has_the_single_process_format_and_resumes_weights_and_optimizer(
    tiny_model_dir, tmp_path
):
    model, optimizer, scheduler = training(tiny_model_dir)
    take_steps(model, optimizer, scheduler)
    saved_model, saved_optimizer = checkpoint_parts(PretendFsdp(), model, model, optimizer)
    path = save_checkpoint(tmp_path, TrainerState(2, 4, 2), saved_model, saved_optimizer, scheduler)

    plain, plain_optimizer, plain_scheduler = training(tiny_model_dir)
    load_checkpoint(path, plain, plain_optimizer, plain_scheduler)  # what one process reads
    fresh, fresh_optimizer, fresh_scheduler = training(tiny_model_dir)
    trained, fresh_optimizer, state = prepare(PretendFsdp(), fresh, fresh_optimizer, fresh_scheduler, path)
    assert trained is fresh and state is not None and state.step == 2
    for restored, opt, sched in (
        (plain, plain_optimizer, plain_scheduler),
        (fresh, fresh_optimizer, fresh_scheduler),
    ):
        for (name, p), q in zip(model.named_parameters(), restored.parameters(), strict=True):
            torch.testing.assert_close(q, p, rtol=0, atol=0, msg=name)
        take_steps(restored, opt, sched, steps=1)
    take_steps(model, optimizer, scheduler, steps=1)
    for p, q, r in zip(model.parameters(), plain.parameters(), fresh.parameters(), strict=True):
        torch.testing.assert_close(q, p)
        torch.testing.assert_close(r, p)


def test_lora_under_accelerates_fsdp_and_deepspeed_are_refused(tiny_model_dir):
    peft = pytest.importorskip("peft")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    optimizer = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad])
    with pytest.raises(NotImplementedError, match="LoRA under accelerate's FSDP"):
        prepare(PretendFsdp(), lora, optimizer, None, None)

    class PretendDeepSpeed(PretendFsdp):
        distributed_type = DistributedType.DEEPSPEED

    with pytest.raises(NotImplementedError, match="use DDP or FSDP"):
        prepare(PretendDeepSpeed(), model, optimizer, None, None)


# -- two real processes ---------------------------------------------------------------------------------


def metrics_lines(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_two_gloo_processes_train_resume_push_and_log_like_one_process(tmp_path, tiny_model_dir):
    out = tmp_path / "two"
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "tests.trainer.distributed_run", str(tiny_model_dir), str(out)],
        cwd=REPO, env={**os.environ, "ACCELERATE_USE_CPU": "true", "HF_HUB_OFFLINE": "1"},
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    print(f"two processes: {time.monotonic() - started:.1f} s")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["factories"] == 3 and ranks[0]["created"] > 0  # one per phase, on rank 0 only
    assert ranks[0]["closed"] == ranks[0]["created"] and ranks[0]["live"] == 0
    assert ranks[1]["factories"] == ranks[1]["created"] == 0
    assert ranks[0]["steps"] == ranks[1]["steps"] == [FIRST_STEPS, TOTAL_STEPS, FIRST_STEPS]
    assert ranks[0]["loss"] == ranks[1]["loss"]
    # Rank 0 pushed every step (and once more on resume), the final weights last; rank 1 never did.
    assert ranks[0]["pushed"] == [1, 2, 2, 3, 1, 2] and ranks[0]["pushed_final"]
    assert ranks[1]["pushed"] == []
    for phase in ("full", "lora"):  # DDP keeps the ranks identical, LoRA's frozen base weights included
        zero, one = (load_file(out / f"{phase}-rank{r}.safetensors") for r in range(2))
        for name, tensor in zero.items():
            torch.testing.assert_close(one[name], tensor, rtol=0, atol=0, msg=f"{phase}: {name}")

    alone = tmp_path / "one"
    single = trained_alone(tiny_model_dir, alone)
    trained = load_file(out / "full-rank0.safetensors")
    for name, p in single.model.named_parameters():
        torch.testing.assert_close(trained[name], p.detach(), rtol=0, atol=1e-5)
    written = load_file(out / "full" / f"checkpoint-{FIRST_STEPS}" / "model" / "model.safetensors")
    expected = load_file(alone / f"checkpoint-{FIRST_STEPS}" / "model" / "model.safetensors")
    assert written.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(written[name], tensor, rtol=0, atol=1e-5)

    lines, reference = metrics_lines(out / "full"), metrics_lines(alone)
    assert [line["step"] for line in lines] == list(range(1, TOTAL_STEPS + 1))
    for line, ref in zip(lines, reference, strict=True):
        for key in ("loss", "entropy", "clip_ratio", "is/ratio_mean", "num_tokens", "reward", "grad_norm"):
            assert line[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-7), key
    assert sorted(p.name for p in (out / "full").glob("checkpoint-*")) == [
        f"checkpoint-{s}" for s in (1, 2, 3)
    ]
    assert (out / "lora" / f"checkpoint-{FIRST_STEPS}" / "model" / "adapter_model.safetensors").exists()
