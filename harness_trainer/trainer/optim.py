"""The optimizer a config names."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def build_optimizer(
    name: str, params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float
) -> torch.optim.Optimizer:
    """``adamw_torch`` (the default) or ``sgd``: plain gradient steps, whose size follows the gradient's.

    Adam's first steps move every weight by about ``lr`` whatever its gradient, so from a handful of
    rollouts they are mostly noise; SGD moves the weights a step's gradient is really about.
    """
    if name == "adamw_torch":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r} (adamw_torch or sgd)")
