"""The policy loss: a hand-worked example per importance-sampling mode, the KL term, and per-rollout
normalisation that does not depend on how rows are split into rows or micro-batches."""

from __future__ import annotations

import math
import random
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from harness_trainer.trainer.step.logprobs import token_logprobs
from harness_trainer.trainer.step.loss import LossConfig, LossStats, policy_loss
from harness_trainer.trainer.step.packing import MicroBatch, collate, plan_micro_batches
from harness_trainer.trainer.step.rows import Row

# ------------------------------------------------------------------------------------ the worked example
# Two rows of three tokens; the first token of each is context. ε = 0.2, ε_high = 0.28 (set: its default
# is ε), C = 2.
#   t1  rollout 0, A = +1, r = 1.0: ρ = 1, inside the clip range: loss −1, d loss/dl = −A·ρ = −1
#   t2  rollout 0, A = +1, r = 1.5: clip(1.5) = 1.28 < 1.5, the min takes 1.28: loss −1.28, no gradient
#   t3  rollout 1, A = −1, r = 0.5: clip(0.5) = 0.8, min(−0.5, −0.8) = −0.8: loss +0.8, no gradient
#   t4  rollout 1, A = −1, r = 3.0: truncated ρ = 2, min(−2, −1.28) = −2: loss +2, gradient −A·2 = +2
# Each rollout has N_r = 2 tokens and R = 2, so every weight is 1/4:
#   loss = (−1 − 1.28 + 0.8 + 2) / 4 = 0.13;  d loss/dl = [0, −0.25, 0, 0, 0, 0.5]
BEHAVIOUR = [0.0, -1.0, -2.0, 0.0, -0.5, -3.0]
RATIOS = [1.0, 1.0, 1.5, 1.0, 0.5, 3.0]  # position 0 and 3 are context: their values are never read


def worked_example() -> tuple[torch.Tensor, MicroBatch]:
    logps = torch.tensor(
        [b + math.log(r) for b, r in zip(BEHAVIOUR, RATIOS, strict=True)], requires_grad=True
    )
    targets = torch.tensor([False, True, True, False, True, True])
    batch = MicroBatch(
        input_ids=torch.tensor([[5, 6, 7, 5, 8, 9]]),
        position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]),
        targets=targets,
        behaviour_logps=torch.tensor(BEHAVIOUR) * targets,
        advantages=torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0]),
        token_weights=torch.tensor([0.0, 0.25, 0.25, 0.0, 0.25, 0.25]),
        rollouts=torch.tensor([0, 0, 0, 1, 1, 1]),
        row_lengths=[3, 3],
    )
    return logps, batch


def test_truncated_importance_sampling_matches_the_hand_computed_example() -> None:
    logps, batch = worked_example()

    loss, stats = policy_loss(logps, batch, LossConfig(epsilon_high=0.28))
    loss.backward()

    assert loss.item() == pytest.approx(0.13, abs=1e-6)
    assert logps.grad is not None
    torch.testing.assert_close(logps.grad, torch.tensor([0.0, -0.25, 0.0, 0.0, 0.0, 0.5]))
    assert stats == LossStats(
        n_tokens=4,
        ratio_sum=pytest.approx(6.0),
        capped=1,
        clipped_low=1,
        clipped_high=1,
        loss=pytest.approx(0.13),
    )
    metrics = stats.metrics()
    assert metrics["is/ratio_mean"] == pytest.approx(1.5) and metrics["is/capped_frac"] == 0.25
    assert metrics["clip_ratio/low_mean"] == metrics["clip_ratio/high_mean"] == 0.25
    assert metrics["clip_ratio/region_mean"] == metrics["clip_ratio"] == 0.5
    assert metrics["kl"] == metrics["entropy"] == 0.0


def test_mask_mode_drops_the_token_above_the_cap() -> None:
    # t4 (r = 3 > 2) is dropped; its rollout's weight stays 1/4: loss (−1 − 1.28 + 0.8) / 4 = −0.37.
    logps, batch = worked_example()

    loss, stats = policy_loss(logps, batch, LossConfig(epsilon_high=0.28, importance_sampling="mask"))
    loss.backward()

    assert loss.item() == pytest.approx(-0.37, abs=1e-6)
    assert logps.grad is not None
    torch.testing.assert_close(logps.grad, torch.tensor([0.0, -0.25, 0.0, 0.0, 0.0, 0.0]))
    assert stats.capped == 1 and stats.clipped_low == stats.clipped_high == 1


def test_no_importance_correction_uses_the_raw_ratio() -> None:
    # t4 at ρ = r = 3: min(−3, −1.28) = −3, loss +3, gradient −A·3 = 3: loss (−1 − 1.28 + 0.8 + 3) / 4 = 0.38.
    logps, batch = worked_example()

    loss, _ = policy_loss(logps, batch, LossConfig(epsilon_high=0.28, importance_sampling="none"))
    loss.backward()

    assert loss.item() == pytest.approx(0.38, abs=1e-6)
    assert logps.grad is not None
    torch.testing.assert_close(logps.grad, torch.tensor([0.0, -0.25, 0.0, 0.0, 0.0, 0.75]))


def test_the_k3_penalty_adds_beta_times_kl_and_its_gradient() -> None:
    # ref − l = ln 2 at t1, 0 elsewhere: k3 = 2 − ln 2 − 1 = 1 − ln 2, d k3/dl = 1 − exp(ref − l) = −1.
    logps, batch = worked_example()
    ref = logps.detach().clone()
    ref[1] += math.log(2)

    loss, stats = policy_loss(logps, batch, LossConfig(epsilon_high=0.28, beta=0.1), ref_logps=ref)
    loss.backward()

    kl = 1 - math.log(2)
    assert loss.item() == pytest.approx(0.13 + 0.1 * 0.25 * kl, abs=1e-6)
    assert logps.grad is not None
    torch.testing.assert_close(logps.grad, torch.tensor([0.0, -0.25 - 0.025, 0.0, 0.0, 0.0, 0.5]))
    assert stats.kl_sum == pytest.approx(kl) and stats.metrics()["kl"] == pytest.approx(kl / 4)


def test_reference_logprobs_are_measured_but_not_trained_at_beta_zero() -> None:
    logps, batch = worked_example()
    ref = logps.detach() + 0.5

    loss, stats = policy_loss(logps, batch, LossConfig(epsilon_high=0.28), ref_logps=ref)

    assert loss.item() == pytest.approx(0.13, abs=1e-6)
    assert stats.kl_sum == pytest.approx(4 * (math.exp(0.5) - 0.5 - 1))


def test_entropy_is_summed_over_targets_only() -> None:
    logps, batch = worked_example()
    entropy = torch.tensor([9.0, 1.0, 2.0, 9.0, 3.0, 4.0])

    _, stats = policy_loss(logps, batch, LossConfig(epsilon_high=0.28), entropy=entropy)

    assert stats.entropy_sum == 10.0 and stats.metrics()["entropy"] == 2.5


def test_a_huge_ratio_gives_finite_losses_and_gradients_in_every_mode() -> None:
    logps, batch = worked_example()
    far = logps.detach().clone()
    far[5] = 0.0
    behaviour = batch.behaviour_logps.clone()
    behaviour[5] = -200.0  # r = e^200 overflows float32
    batch.behaviour_logps = behaviour

    for mode in ("truncate", "mask"):
        current = far.clone().requires_grad_(True)
        loss, _ = policy_loss(current, batch, LossConfig(epsilon_high=0.28, importance_sampling=mode))
        loss.backward()
        assert torch.isfinite(loss) and current.grad is not None and torch.isfinite(current.grad).all(), mode


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"epsilon": -0.1}, "epsilon must be in"),
        ({"epsilon": 1.0}, "epsilon must be in"),
        ({"epsilon_high": -0.1}, "epsilon_high"),
        ({"importance_sampling": "clip"}, "importance_sampling 'clip' is not one of"),
        ({"importance_sampling_cap": 1.0}, "importance_sampling_cap must be greater than 1"),
        ({"beta": -1.0}, "beta"),
    ],
)
def test_invalid_loss_configs_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LossConfig(**kwargs)  # type: ignore[arg-type]


def test_a_kl_coefficient_without_reference_logprobs_is_refused() -> None:
    logps, batch = worked_example()

    with pytest.raises(ValueError, match="ref_logps"):
        policy_loss(logps, batch, LossConfig(epsilon_high=0.28, beta=0.1))


def test_stats_merge_by_addition() -> None:
    a = LossStats(n_tokens=2, ratio_sum=2.5, capped=1, clipped_low=0, clipped_high=1, kl_sum=0.5, loss=0.25)
    b = LossStats(
        n_tokens=3, ratio_sum=3.0, capped=0, clipped_low=2, clipped_high=0, entropy_sum=6.0, loss=0.5
    )

    merged = a.merge(b)

    assert merged == LossStats(5, 5.5, 1, 2, 1, 0.5, 6.0, 0.75)
    assert LossStats().metrics()["is/ratio_mean"] == 0.0


# ---------------------------------------------------------------------------- normalisation per rollout


class Bigram(torch.nn.Module):
    """A duck-typed causal LM whose logits depend on the current token only: exact, whatever the packing."""

    def __init__(self, vocab: int = 32) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0)))

    def forward(self, input_ids: torch.Tensor, logits_to_keep: torch.Tensor, **_: object) -> SimpleNamespace:
        return SimpleNamespace(logits=self.table[input_ids][logits_to_keep])


def random_rows(seed: int, vocab: int = 32) -> list[Row]:
    """Rows of 4 rollouts, one of them split into several rows, with lengths from 3 to 40."""
    rng = random.Random(seed)
    rows = []
    for rollout, count in enumerate([1, 3, 1, 2]):
        for _ in range(count):
            n = rng.randint(3, 40)
            targets = [0] + [int(rng.random() < 0.6) for _ in range(n - 1)]
            logps = [-rng.uniform(0.5, 5.0) if bit else 0.0 for bit in targets]
            rows.append(Row(rollout, [rng.randrange(vocab) for _ in range(n)], targets, logps))
    return rows


def step_weights(rows: list[Row]) -> dict[int, float]:
    """1 / (N_r · R): N_r trained tokens of rollout r across all its rows, R rollouts."""
    trained: dict[int, int] = defaultdict(int)
    for row in rows:
        trained[row.rollout] += row.n_targets
    return {rollout: 1.0 / (n * len(trained)) for rollout, n in trained.items()}


ADVANTAGES = {0: 1.2, 1: -0.7, 2: 0.3, 3: -1.1}


def step_loss(
    model: torch.nn.Module, plan: list[list[Row]], weights: dict[int, float]
) -> tuple[float, LossStats]:
    """Forward + backward per micro-batch, as the training loop does; the summed loss and merged stats."""
    total, stats = 0.0, LossStats()
    for micro in plan:
        batch = collate(micro, ADVANTAGES, weights)
        logps, entropy = token_logprobs(model, batch, 0.9, targets_only=True)
        loss, micro_stats = policy_loss(logps, batch, LossConfig(epsilon_high=0.28), entropy=entropy)
        loss.backward()
        total += loss.item()
        stats = stats.merge(micro_stats)
    return total, stats


def grads(model: torch.nn.Module) -> list[torch.Tensor]:
    found = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return found


def test_unequal_micro_batches_give_the_loss_and_gradients_of_one_batch() -> None:
    model, rows = Bigram(), random_rows(1)
    weights = step_weights(rows)

    whole, whole_stats = step_loss(model, [rows], weights)
    whole_grads = grads(model)
    for budget in (45, 60, 100):
        plan = plan_micro_batches(rows, budget)
        assert len({sum(len(r.input_ids) for r in micro) for micro in plan}) > 1  # unequal sizes
        split, split_stats = step_loss(model, plan, weights)
        assert split == pytest.approx(whole, abs=1e-6)
        for a, b in zip(grads(model), whole_grads, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
        assert split_stats.n_tokens == whole_stats.n_tokens
        assert split_stats.ratio_sum == pytest.approx(whole_stats.ratio_sum)


def test_tiny_model_micro_batches_sum_to_the_loss_and_gradients_of_one_batch(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    # Spread the bigram ids over the tiny model's vocabulary.
    rows = [
        Row(r.rollout, [t * 97 for t in r.input_ids], r.targets, r.behaviour_logps) for r in random_rows(2)
    ]
    weights = step_weights(rows)

    whole, _ = step_loss(model, [rows], weights)
    whole_grads = grads(model)
    split, _ = step_loss(model, plan_micro_batches(rows, 50), weights)

    assert split == pytest.approx(whole, abs=1e-6)
    for a, b in zip(grads(model), whole_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_a_rollout_split_into_many_rows_weighs_the_same_as_an_unsplit_one() -> None:
    # Rollout 0 is one row; rollout 1 holds the same trained tokens spread over three rows that repeat its
    # context (as a forked trace does). Under the bigram model every token has the same logprob in both.
    model = Bigram()
    ids = [3, 4, 5, 6, 7, 8, 9, 10]
    targets = [0, 1, 1, 0, 1, 1, 1, 0]
    logps = [-1.0 * bit for bit in targets]
    whole = Row(0, ids, targets, logps)
    split = [
        Row(1, ids[:3], targets[:3], logps[:3]),
        Row(1, ids[:5], [0, 0, 0, 0, 1], [0, 0, 0, 0, -1.0]),
        Row(1, ids, [0, 0, 0, 0, 0, 1, 1, 0], [0.0] * 5 + [-1.0, -1.0, 0.0]),
    ]
    weights = step_weights([whole, *split])
    advantages = {0: 1.0, 1: 1.0}

    def contribution(rows: list[Row]) -> tuple[float, list[torch.Tensor]]:
        batch = collate(rows, advantages, weights)
        loss, _ = policy_loss(token_logprobs(model, batch, 1.0)[0], batch, LossConfig(epsilon_high=0.28))
        loss.backward()
        return loss.item(), grads(model)

    whole_loss, whole_grads = contribution([whole])
    split_loss, split_grads = contribution(split)

    assert weights == {0: 1 / 10, 1: 1 / 10}
    assert split_loss == pytest.approx(whole_loss, abs=1e-7) and whole_loss != 0
    torch.testing.assert_close(split_grads[0], whole_grads[0], atol=1e-7, rtol=0)
