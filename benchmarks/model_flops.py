"""Model FLOPs of a training step and the utilisation they make: what the GPU trainer check divides by
(see :mod:`benchmarks.gpu_trainer`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Shape:
    """What the model FLOPs of a step depend on."""

    parameters: int  # every parameter, tied embeddings once
    body: int  # non-embedding: every parameter but the input embedding and the output head
    head: int  # hidden × vocabulary: the output projection
    layers: int
    attention_width: int  # query heads × head_dim


def shape_of(model: Any) -> Shape:
    """The :class:`Shape` of a transformers causal LM (before sharding: it counts local parameters)."""
    config = model.config
    embeddings = {
        id(m.weight): m.weight.numel() for m in (model.get_input_embeddings(), model.get_output_embeddings())
    }
    parameters = sum(p.numel() for p in model.parameters())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return Shape(
        parameters=parameters,
        body=parameters - sum(embeddings.values()),
        head=config.hidden_size * config.vocab_size,
        layers=config.num_hidden_layers,
        attention_width=config.num_attention_heads * head_dim,
    )


def train_flops(shape: Shape, row_lengths: Sequence[int], projected: int) -> float:
    """Model FLOPs of forward + backward (3× the forward's 2 per multiply-add) over rows of ``row_lengths``
    with ``projected`` positions sent through the output head: ``6·body·Σn`` for the weights,
    ``6·layers·width·Σn²`` for causal attention (``QKᵀ`` and ``AV``, half of each ``n × n`` product) and
    ``6·head·projected``."""
    weights = 6 * shape.body * sum(row_lengths)
    attention = 6 * shape.layers * shape.attention_width * sum(n * n for n in row_lengths)
    return float(weights + attention + 6 * shape.head * projected)


def tree_train_flops(shape: Shape, nodes: Sequence[tuple[int, int]], projected: int) -> float:
    """:func:`train_flops` of a forward by prefix: ``nodes`` as ``(context, span)`` pairs, each node's
    ``span`` ids forwarded once on a cache of ``context`` ids. A node's queries see the whole context and
    its own ids causally, ``2·context·span + span²`` in the units of a row's ``n²``."""
    weights = 6 * shape.body * sum(span for _, span in nodes)
    pairs = sum(2 * context * span + span * span for context, span in nodes)
    return float(weights + 6 * shape.layers * shape.attention_width * pairs + 6 * shape.head * projected)


def mfu(flops: float, seconds: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation: ``flops`` done in ``seconds`` as a fraction of ``peak_tflops`` × 10¹²/s."""
    return flops / seconds / (peak_tflops * 1e12)
