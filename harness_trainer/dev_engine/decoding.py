"""Pure pieces of decoding: processed logprobs, one sampling step, stop strings, incremental text.

"Processed" logprobs are what vLLM returns under ``--logprobs-mode processed_logprobs``: the log-softmax of
the logits divided by the temperature, over the full vocabulary, i.e. the log-probability of the sampled
token under the distribution it was actually drawn from. Temperature 0 means greedy decoding, and the
logprobs are then those of the unscaled logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

GREEDY_BELOW = 1e-5


def processed_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-softmax of ``logits / temperature`` in float32 (unscaled when greedy)."""
    logits = logits.float()
    if temperature >= GREEDY_BELOW:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1)


def sample_token(logprobs: torch.Tensor, temperature: float, generator: torch.Generator) -> int:
    """Draw one token id from a 1-D logprob vector (argmax when greedy)."""
    if temperature < GREEDY_BELOW:
        return int(torch.argmax(logprobs))
    return int(torch.multinomial(logprobs.exp(), 1, generator=generator))


@dataclass
class StopMatch:
    """Where a stop string was found in the completion text."""

    stop: str
    text_end: int


def find_stop(text: str, stops: Sequence[str], search_from: int) -> StopMatch | None:
    """First stop string that occurs in ``text``, looking only where new text could complete one."""
    best: StopMatch | None = None
    for stop in stops:
        start = max(0, search_from - len(stop) + 1)
        at = text.find(stop, start)
        if at != -1 and (best is None or at < best.text_end):
            best = StopMatch(stop=stop, text_end=at)
    return best


class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas without re-decoding the whole sequence.

    A delta is held back while the tail decodes to an incomplete UTF-8 sequence (U+FFFD), so a
    multi-byte character is never split across two deltas.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""

    def push(self, token_id: int) -> str:
        """Add one id; return the text it completes (possibly empty)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Text still held back at the end (an incomplete character decodes as U+FFFD)."""
        rest = self._decode(self._ids[self._prefix_offset :])
        delta = rest[len(self._decode(self._ids[self._prefix_offset : self._read_offset])) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta
