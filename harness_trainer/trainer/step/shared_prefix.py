"""Target logprobs of rows that share prefixes, forwarding each shared prefix once.

A GRPO group's members share their system prompt and task; the warm-up's solver and distractor of a task
share their first ~1,400 ids. A packed forward computes those ids once per row. Here the rows' prefix tree
(:mod:`harness_trainer.trainer.step.prefix_tree`) is forwarded node by node, depth first: a node's ids once
(batch 1), on a copy of its parent's key/value cache, keeping its own cache for its children. The logits
of a position are projected once, however many rows train the token after it (a sampled token inside a
shared prefix, or each member's first sampled token after it). Gradients flow through the caches into the
shared ids, so logprobs and gradients are the packed forward's (the tests compare them, LoRA and FSDP2
included), at the tree's forwarded ids.

For causal LMs whose forward takes ``position_ids``, a key/value cache (``cache``, or ``past_key_values``
before transformers renamed it) and ``logits_to_keep`` as a mask: Qwen2, Llama and the like. Called
through the model's own forward (its wrappers' hooks run: PEFT, FSDP2, DDP). Not with gradient
checkpointing, which drops the cache during training (:func:`check_shareable` says so).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from harness_trainer.trainer.step.logprobs import entropy_of
from harness_trainer.trainer.step.packing import MicroBatch
from harness_trainer.trainer.step.prefix_tree import MIN_SPAN, PrefixNode, node_targets, prefix_tree
from harness_trainer.trainer.step.rows import Row


@dataclass
class SharedLogprobs:
    """Each row's logprobs at its target positions in order (differentiable), their entropies (None
    unless asked for), and the ids the forward computed."""

    logps: list[torch.Tensor]
    entropy: list[torch.Tensor] | None
    forwarded: int


def check_shareable(model: torch.nn.Module) -> None:
    """Raise ``ValueError`` when ``model`` cannot be forwarded by prefix: gradient checkpointing in
    training mode makes transformers drop the key/value cache the children attend to."""
    if model.training and any(getattr(m, "gradient_checkpointing", False) for m in model.modules()):
        raise ValueError(
            "shared-prefix forwards need the key/value cache, which gradient checkpointing drops in "
            "training: turn one of them off (shared_prefix=False)"
        )


def tree_logprobs(
    model: torch.nn.Module,
    rows: Sequence[Row],
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    min_span: int = MIN_SPAN,
) -> SharedLogprobs:
    """Each row's target logprobs, each shared prefix forwarded once (see the module docstring).

    Raises:
        ValueError: ``temperature`` is not positive, a row's first id is a target (nothing predicts it),
            or the model checkpoints gradients (:func:`check_shareable`).
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    for number, row in enumerate(rows):
        if row.targets and row.targets[0]:
            raise ValueError(f"row {number}: its first id is a target, and nothing predicts a first id")
    check_shareable(model)
    tree = prefix_tree([row.input_ids for row in rows], min_span)
    walk = _Walk(model, rows, temperature, with_entropy)
    walk.forward(tree, None)
    logps = [_joined(pieces, walk.empty) for pieces in walk.logps]
    entropy = [_joined(pieces, walk.empty) for pieces in walk.entropy] if with_entropy else None
    return SharedLogprobs(logps, entropy, walk.forwarded)


def shared_prefix_logprobs(
    model: torch.nn.Module, rows: Sequence[Row], temperature: float = 1.0, min_span: int = MIN_SPAN
) -> list[torch.Tensor]:
    """Each row's logprobs at its target positions, in order (one tensor per row, differentiable).

    Raises:
        ValueError: as :func:`tree_logprobs`.
    """
    return tree_logprobs(model, rows, temperature, min_span=min_span).logps


def micro_batch_logprobs(
    model: torch.nn.Module,
    batch: MicroBatch,
    rows: Sequence[Row],
    temperature: float,
    *,
    with_entropy: bool = True,
    min_span: int = MIN_SPAN,
) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """:func:`harness_trainer.trainer.step.logprobs.token_logprobs` with ``targets_only`` for the packed
    ``batch`` collated from ``rows`` (in its order), forwarded by prefix: logprobs ``[T]`` (and
    entropies) at its targets, 0 elsewhere, and the ids forwarded.

    Raises:
        ValueError: as :func:`tree_logprobs`, or ``rows`` are not the batch's.
    """
    if [len(row.input_ids) for row in rows] != batch.row_lengths:
        raise ValueError("the rows are not the micro-batch's: their lengths differ")
    shared = tree_logprobs(model, rows, temperature, with_entropy=with_entropy, min_span=min_span)
    index = batch.targets.nonzero().squeeze(-1)
    logps = _scatter(torch.cat(shared.logps), index, batch.n_tokens)
    entropy = None if shared.entropy is None else _scatter(torch.cat(shared.entropy), index, batch.n_tokens)
    return logps, entropy, shared.forwarded


def _scatter(values: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    return values.new_zeros(size).index_put((index.to(values.device),), values)


def _joined(pieces: list[torch.Tensor], empty: torch.Tensor) -> torch.Tensor:
    return torch.cat(pieces) if pieces else empty


class _Walk:
    """One depth-first forward of a prefix tree, collecting each row's pieces in position order."""

    def __init__(
        self, model: torch.nn.Module, rows: Sequence[Row], temperature: float, with_entropy: bool
    ) -> None:
        self.model, self.rows, self.temperature, self.with_entropy = model, rows, temperature, with_entropy
        self.device = next(model.parameters()).device
        self.cache_name = _cache_keyword(model)
        self.targets = [[t for t, is_target in enumerate(row.targets) if is_target] for row in rows]
        self.logps: list[list[torch.Tensor]] = [[] for _ in rows]
        self.entropy: list[list[torch.Tensor]] = [[] for _ in rows]
        self.empty = torch.zeros(0, device=self.device)
        self.forwarded = 0

    def forward(self, node: PrefixNode, cache: object | None, *, last: bool = False) -> None:
        """Forward ``node`` on ``cache`` (its path's, None at the top), then its children on its own. The
        ``last`` child extends its parent's cache itself: no sibling reads it after."""
        from transformers import DynamicCache

        if node.span == 0:
            for child in node.children:
                self.forward(child, cache)
            return
        spans = node_targets(node, self.targets)
        wanted = [(row, t) for row, found in spans.items() for t in found]
        positions = sorted({t - 1 for _, t in wanted})
        keep = torch.zeros(1, node.span, dtype=torch.bool, device=self.device)
        keep[0, [p - node.start for p in positions]] = True
        own = DynamicCache() if cache is None else cache if last else _branch(cache)
        ids = self.rows[node.rows[0]].input_ids[node.start : node.end]
        out = self.model(
            input_ids=torch.tensor([ids], device=self.device),
            position_ids=torch.arange(node.start, node.end, device=self.device).unsqueeze(0),
            logits_to_keep=keep,
            use_cache=True,
            **{self.cache_name: own},
        )
        self.forwarded += node.span
        if wanted:
            logits = out.logits.reshape(len(positions), -1).float() / self.temperature
            at = {p: i for i, p in enumerate(positions)}
            where = torch.tensor([at[t - 1] for _, t in wanted], device=self.device)
            chosen = torch.tensor([self.rows[row].input_ids[t] for row, t in wanted], device=self.device)
            # Indexed pairwise, not logits[where]: no [n, V] copy per wanted token.
            selected = logits[where, chosen] - torch.logsumexp(logits, dim=-1)[where]
            entropy = entropy_of(logits)[where] if self.with_entropy else None
            start = 0
            for row, found in spans.items():  # ``wanted`` lists each row's targets together, in order
                if found:
                    self.logps[row].append(selected[start : start + len(found)])
                    if entropy is not None:
                        self.entropy[row].append(entropy[start : start + len(found)])
                start += len(found)
        for number, child in enumerate(node.children, start=1):
            self.forward(child, own, last=number == len(node.children))


def _branch(cache: object) -> object:
    """A new cache holding ``cache``'s keys and values: a child's forward extends its own copy, so its
    siblings still see the parent's cache alone (the copy is part of the graph: gradients reach the
    parent's ids through it)."""
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=[(layer.keys, layer.values) for layer in cache.layers])  # type: ignore[attr-defined]


def _cache_keyword(model: torch.nn.Module) -> str:
    """The name the model's forward takes its cache by: ``cache`` (transformers 5.x) or
    ``past_key_values``."""
    for module in model.modules():
        if "lm_head" in module._modules:  # the model that owns its head, under any wrapper (PEFT's, DDP's)
            parameters = inspect.signature(module.forward).parameters
            return "cache" if "cache" in parameters else "past_key_values"
    raise ValueError(f"{type(model).__name__} has no language-model head (lm_head) to forward by prefix")
