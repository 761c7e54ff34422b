"""The policy loss: a clipped surrogate with token-level importance sampling against the behaviour policy,
an optional KL (k3) penalty to a reference policy, normalised per rollout.

Per target token ``t`` with advantage ``A``, behaviour logprob ``b`` (what the engine sampled with) and
current logprob ``l`` (with grad), ``r = exp(l - b)``:

- importance sampling, ``importance_sampling``: ``"truncate"`` uses ``min(r, C)`` as value and
  ``min(r, C)·∇l`` as gradient (truncated IS, cap ``C = importance_sampling_cap``); ``"mask"`` drops
  tokens with ``r > C`` (weight 0); ``"none"`` uses ``r`` as is. Call the ratio used ``ρ``.
- surrogate ``s = min(ρ·A, clip(ρ, 1 - epsilon, 1 + epsilon_high)·A)``; the token's loss is ``-s``,
  plus ``beta · k3`` with ``k3 = exp(ref - l) - (ref - l) - 1`` when ``beta > 0``.
- the micro-batch loss is ``Σ_t token_weights[t] · loss[t]``, nothing else divided. With
  ``token_weights = 1 / (N_r · R)`` for a token of rollout ``r`` (``N_r`` its trained tokens in the whole
  step, ``R`` the rollouts in the step), summing the micro-batch losses gives the step objective: the mean
  over rollouts of each rollout's token mean, however the rows are split into micro-batches.

:class:`LossStats` holds sums over target tokens (and counts), so the stats of micro-batches merge by
addition and :meth:`LossStats.metrics` gives token means over the step. The coefficients are the run's
:class:`~harness_trainer.trainer.config.loss.LossConfig` (``AsyncGRPOConfig.loss``), defined and
checked there.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from harness_trainer.trainer.config.loss import LossConfig
from harness_trainer.trainer.step.packing import MicroBatch, PaddedBatch

__all__ = ["LossConfig", "LossStats", "policy_loss"]


@dataclass
class LossStats:
    """Sums over target tokens and counts; micro-batches :meth:`merge` by addition."""

    n_tokens: int = 0
    ratio_sum: float = 0.0  # of r = exp(l - b), before truncation or masking
    capped: int = 0  # tokens with r > importance_sampling_cap (truncated, or dropped in "mask" mode)
    clipped_low: int = 0  # ρ < 1 - epsilon and A < 0
    clipped_high: int = 0  # ρ > 1 + epsilon_high and A > 0
    kl_sum: float = 0.0  # k3, when reference logprobs were given
    entropy_sum: float = 0.0  # when entropies were given
    loss: float = 0.0  # the weighted loss itself: micro-batch losses add up to the step's

    def merge(self, other: LossStats) -> LossStats:
        """The stats of both together."""
        return LossStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def metrics(self) -> dict[str, float]:
        """Token means for logging (0 when there were no tokens), plus the loss."""
        n = max(self.n_tokens, 1)
        low, high = self.clipped_low / n, self.clipped_high / n
        return {
            "loss": self.loss,
            "is/ratio_mean": self.ratio_sum / n,
            "is/capped_frac": self.capped / n,
            "clip_ratio/low_mean": low,
            "clip_ratio/high_mean": high,
            "clip_ratio/region_mean": low + high,
            "clip_ratio": low + high,
            "kl": self.kl_sum / n,
            "entropy": self.entropy_sum / n,
        }


def policy_loss(
    logps: torch.Tensor,
    batch: MicroBatch | PaddedBatch,
    cfg: LossConfig,
    *,
    ref_logps: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """The weighted loss of one micro-batch (a scalar with grad through ``logps``) and its stats.

    ``logps``, ``ref_logps`` and ``entropy`` are shaped like ``batch.targets``; only target positions are
    read. With ``ref_logps`` the KL is measured (logged) even at ``beta = 0``.

    Raises:
        ValueError: ``beta > 0`` without ``ref_logps``.
    """
    if cfg.beta > 0 and ref_logps is None:
        raise ValueError("beta > 0 needs ref_logps (the reference policy's logprobs)")
    mask = batch.targets
    current, advantage = logps[mask], batch.advantages[mask]
    log_ratio = current - batch.behaviour_logps[mask]
    ratio = log_ratio.detach().exp()  # may be inf; only compared and logged
    capped = ratio > cfg.importance_sampling_cap
    used = _importance_ratio(current, log_ratio, ratio, capped, cfg)
    clipped = used.clamp(1 - cfg.epsilon, 1 + cfg.epsilon_high)
    per_token = -torch.minimum(used * advantage, clipped * advantage)
    if cfg.importance_sampling == "mask":
        per_token = torch.where(capped, torch.zeros_like(per_token), per_token)
    k3 = None
    if ref_logps is not None:
        delta = ref_logps[mask] - current
        k3 = torch.exp(delta) - delta - 1
        if cfg.beta > 0:
            per_token = per_token + cfg.beta * k3
    loss = (batch.token_weights[mask] * per_token).sum()
    with torch.no_grad():
        zero = loss.new_zeros(())
        sums = [
            mask.sum(),
            ratio.sum(),
            capped.sum(),
            ((used < 1 - cfg.epsilon) & (advantage < 0)).sum(),
            ((used > 1 + cfg.epsilon_high) & (advantage > 0)).sum(),
            zero if k3 is None else k3.sum(),
            zero if entropy is None else entropy[mask].sum(),
            loss,
        ]
        n, ratio_sum, n_capped, low, high, kl_sum, entropy_sum, total = torch.stack(
            [value.double() for value in sums]
        ).tolist()  # one device sync for all the stats
    stats = LossStats(
        n_tokens=int(n),
        ratio_sum=ratio_sum,
        capped=int(n_capped),
        clipped_low=int(low),
        clipped_high=int(high),
        kl_sum=kl_sum,
        entropy_sum=entropy_sum,
        loss=total,
    )
    return loss, stats


def _importance_ratio(
    current: torch.Tensor, log_ratio: torch.Tensor, ratio: torch.Tensor, capped: torch.Tensor, cfg: LossConfig
) -> torch.Tensor:
    """The ratio the surrogate uses, ρ, by ``cfg.importance_sampling`` (see the module docstring)."""
    if cfg.importance_sampling == "truncate":
        # Value min(r, C), gradient min(r, C)·∇l; exp(l - l.detach()) is 1 with gradient ∇l, and never
        # overflows where r itself would.
        return ratio.clamp(max=cfg.importance_sampling_cap) * torch.exp(current - current.detach())
    if cfg.importance_sampling == "mask":
        # Dropped tokens get ratio 1 before their loss is zeroed: an overflowing exp there would turn the
        # zeroed loss's gradient into NaN.
        return torch.exp(torch.where(capped, torch.zeros_like(log_ratio), log_ratio))
    return torch.exp(log_ratio)
