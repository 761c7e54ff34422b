"""Per-token logprobs (and entropies) of a causal LM on packed or padded micro-batches.

``out[t]`` is the logprob of ``input_ids[t]`` under ``log_softmax(logits / temperature)`` of the same row's
position ``t - 1``: aligned with the row's ``targets``. Positions without a prediction (a row's first token,
padding, and with ``targets_only`` every non-target) are 0.

Packed batches rely on transformers 5 (``masking_utils.find_packed_sequence_indices``): given
``position_ids`` that restart at 0, no attention mask and **no cache**, every attention implementation keeps
rows apart: sdpa and eager get a block-diagonal causal mask, flash attention runs the rows varlen. The model
must be called with ``use_cache=False``: with a cache (the default of most configs) the detection is skipped
and rows attend across their boundaries. The tests check packed logprobs against one forward per row.

A dense ``[T, T]`` block mask makes sdpa and eager spend ``T²`` attention on a micro-batch whose rows need
``Σ n²/2``, and sdpa's fast causal kernels refuse explicit masks: on CPU that costs more than padding.
:func:`use_packed_attention` switches such a model to :data:`PACKED_ATTENTION`, which splits the sequence at
the position-id restarts and runs causal sdpa per row (no mask built at all); everything else (a padding
mask, a cache, decoding) goes to transformers' own sdpa unchanged. Flash-attention models stay as they are.

Only the positions that predict something are projected onto the vocabulary (``logits_to_keep`` as a boolean
mask), in float32; the entropy is computed without a graph, in chunks, so it adds no ``[T, V]`` tensor that
the backward keeps.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from harness_trainer.trainer.step.packing import MicroBatch, PaddedBatch

ENTROPY_CHUNK = 4096  # positions per softmax when computing the entropy: bounds its extra memory
PACKED_ATTENTION = "packed_sdpa"
"""The attention implementation :func:`use_packed_attention` registers: causal sdpa row by row."""


def token_logprobs(
    model: torch.nn.Module,
    batch: MicroBatch,
    temperature: float,
    *,
    with_entropy: bool = True,
    targets_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob ``[T]`` of each token of a packed batch given the earlier tokens of its row, and the entropy
    ``[T]`` of the distribution it was predicted from (None unless ``with_entropy``).

    ``targets_only`` computes them at target tokens only (all the loss needs), 0 elsewhere.

    Raises:
        ValueError: ``temperature`` is not positive.
    """
    predicted = batch.position_ids > 0  # [1, T]: the token has an earlier token in its row
    if targets_only:
        predicted = predicted & batch.targets.unsqueeze(0)
    logps, entropy = _logprobs(
        model,
        batch.input_ids,
        predicted,
        temperature,
        with_entropy,
        position_ids=batch.position_ids,
    )
    return logps.squeeze(0), None if entropy is None else entropy.squeeze(0)


def token_logprobs_padded(
    model: torch.nn.Module,
    batch: PaddedBatch,
    temperature: float,
    *,
    with_entropy: bool = True,
    targets_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`token_logprobs` for a right-padded batch: ``[B, L]`` logprobs (and entropies), 0 on padding.

    Raises:
        ValueError: ``temperature`` is not positive.
    """
    mask = batch.attention_mask.bool()
    first = torch.zeros_like(mask)
    first[:, 0] = True
    predicted = mask & ~first
    if targets_only:
        predicted = predicted & batch.targets
    return _logprobs(
        model,
        batch.input_ids,
        predicted,
        temperature,
        with_entropy,
        attention_mask=batch.attention_mask,
    )


def _logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    predicted: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    **model_inputs: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (and entropies) shaped like ``input_ids``, filled where ``predicted`` (``[B, L]`` bool)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    keep = torch.zeros_like(predicted)
    keep[:, :-1] = predicted[:, 1:]  # the logits at t - 1 predict token t
    out = model(input_ids=input_ids, use_cache=False, logits_to_keep=keep, **model_inputs)
    scaled = out.logits.float() / temperature  # [n, V]: the kept positions, in row-major order
    chosen = input_ids[predicted]
    # gather - logsumexp rather than log_softmax: backward keeps no second [n, V] tensor.
    selected = scaled.gather(-1, chosen.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
    index = predicted.flatten().nonzero().squeeze(-1)
    shape, flat = input_ids.shape, predicted.numel()
    logps = scaled.new_zeros(flat).index_put((index,), selected).view(shape)
    if not with_entropy:
        return logps, None
    with torch.no_grad():
        entropy = scaled.new_zeros(flat).index_put((index,), entropy_of(scaled)).view(shape)
    return logps, entropy


def entropy_of(logits: torch.Tensor) -> torch.Tensor:
    """The entropy of each row of ``logits`` ``[n, V]``, without a graph, :data:`ENTROPY_CHUNK` rows per
    softmax (no extra ``[n, V]`` tensor kept)."""
    with torch.no_grad():
        parts = []
        for chunk in logits.detach().split(ENTROPY_CHUNK):
            logp = torch.log_softmax(chunk, dim=-1)
            parts.append(-(logp.exp() * logp).sum(-1))
        return torch.cat(parts)


def use_packed_attention(model: torch.nn.Module) -> None:
    """Run ``model``'s sdpa or eager attention as :data:`PACKED_ATTENTION` (see the module docstring).

    For causal decoder LMs without sliding-window layers (a sliding-window layer raises
    ``NotImplementedError`` at its first packed forward). Registers the implementation with transformers
    (idempotent); other implementations (flash attention, flex attention) are left alone.
    """
    AttentionInterface.register(PACKED_ATTENTION, _packed_sdpa)
    AttentionMaskInterface.register(PACKED_ATTENTION, _packed_mask)
    if model.config._attn_implementation in ("sdpa", "eager"):
        model.set_attn_implementation(PACKED_ATTENTION)


def _packed_mask(
    *, q_length: int, kv_length: int, attention_mask: torch.Tensor | None = None, **kwargs: Any
) -> torch.Tensor | None:
    """None for a full causal pass without padding (:func:`_packed_sdpa` splits the rows), else sdpa's."""
    if attention_mask is None and q_length == kv_length:
        return None
    return sdpa_mask(q_length=q_length, kv_length=kv_length, attention_mask=attention_mask, **kwargs)


def _packed_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal sdpa over each row of a packed sequence; transformers' sdpa for anything else."""
    position_ids = kwargs.get("position_ids")
    plain = {"dropout": dropout, "scaling": scaling, **kwargs}
    if attention_mask is not None or position_ids is None or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **plain)
    if kwargs.get("sliding_window") is not None:
        # _packed_mask gave this layer no mask either, so plain causal attention would be silently wrong.
        raise NotImplementedError(f"{PACKED_ATTENTION} does not implement sliding-window attention")
    batch_size, length = query.shape[0], query.shape[2]
    position_ids = position_ids.expand(batch_size, -1)
    # A row starts wherever the position does not follow the last one, as transformers detects packing.
    restarts = (position_ids[:, 1:] != position_ids[:, :-1] + 1).nonzero().tolist()
    if not restarts:
        return sdpa_attention_forward(module, query, key, value, None, **plain)
    bounds: list[list[int]] = [[0] for _ in range(batch_size)]
    for b, t in restarts:
        bounds[b].append(t + 1)
    outputs = []
    for b in range(batch_size):
        segments = [
            F.scaled_dot_product_attention(
                query[b : b + 1, :, start:end],
                key[b : b + 1, :, start:end],
                value[b : b + 1, :, start:end],
                dropout_p=dropout,
                is_causal=True,
                scale=scaling,
                enable_gqa=True,
            )
            for start, end in pairwise([*bounds[b], length])
        ]
        outputs.append(torch.cat(segments, dim=2))
    return torch.cat(outputs).transpose(1, 2).contiguous(), None
