"""The model worker: one thread that owns the model and runs every job against it, in order.

Why one thread: the model's weights, its KV caches and weight updates must never race, and torch already
spreads one forward pass over every core. The event loop never runs model code; it submits jobs and
receives events through ``loop.call_soon_threadsafe``.

Jobs run FIFO, so a weight update naturally drains: requests queued before it finish on the old weights,
requests queued after it sample from the new ones, and every result is tagged with the weight version
that sampled it. ``pause()`` stops new generations from starting and returns once the one in flight has
finished; weight updates still run while paused.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from harness_trainer.dev_engine.decoding import (
    IncrementalDetokenizer,
    find_stop,
    processed_logprobs,
    sample_token,
)


class WeightUpdateError(ValueError):
    """A weight update that does not fit the served model: names or shapes (400), version order (409)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class GenerationParams:
    """What one generation may do; validated by the HTTP layer before it gets here."""

    max_tokens: int
    temperature: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    top_logprobs: int = 0


@dataclass
class TokenEvent:
    """One sampled token, the text it makes safe to show, and the finish info on the last one."""

    token_id: int
    logprob: float
    text: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    top: list[tuple[int, float]] = field(default_factory=list)
    weight_version: int | None = None  # set on the last event: the weights that sampled the reply


@dataclass(frozen=True)
class WorkerLoad:
    """A snapshot of the worker's queue: what the engine's ``/metrics`` reports."""

    running: int
    """Generations being decoded: 1 or 0 (one at a time)."""
    waiting: int
    """Generations queued behind it."""
    held_tokens: int
    """Tokens in the running generation's KV cache (its prompt and what it sampled so far)."""


@dataclass
class Job:
    """A unit of work for the worker; ``emit`` delivers events on the submitting event loop."""

    run: Callable[[Job], Any]
    emit: Callable[[str, Any], None]
    is_generation: bool = True
    cancelled: threading.Event = field(default_factory=threading.Event)


class ModelWorker:
    """Owns model + tokenizer; serves generation, scoring and weight-update jobs on one thread."""

    def __init__(self, model: Any, tokenizer: Any, eos_token_ids: tuple[int, ...], seed: int = 0) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        # Like vLLM: the tokenizer's eos stops with stop_reason None; the generation config's other
        # eos ids act as stop token ids, and the stop_reason names the id.
        self.eos_token_ids = eos_token_ids
        self._extra_stop_ids = tuple(t for t in eos_token_ids if t != tokenizer.eos_token_id)
        self.weight_version = 0
        self._seed_source = torch.Generator().manual_seed(seed)
        self._cond = threading.Condition()
        self._control: deque[Job] = deque()
        self._generation: deque[Job] = deque()
        self._paused = False
        self._busy_generating = False
        self._held_tokens = 0  # the running generation's KV-cache length, written by the worker thread
        self._stopping = False
        self._shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        # transformers renamed ``past_key_values`` to ``cache``; use whichever this version takes.
        self._cache_kwarg = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )
        self._thread = threading.Thread(target=self._loop, name="dev-engine-worker", daemon=True)
        self._thread.start()

    # -- submission (any thread) ---------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._stopping:
                raise RuntimeError("the model worker is stopped")
            (self._generation if job.is_generation else self._control).append(job)
            self._cond.notify_all()

    def pause(self) -> None:
        """Hold new generations; return once the one in flight (if any) has finished."""
        with self._cond:
            self._paused = True
            self._cond.wait_for(lambda: not self._busy_generating)

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    def load(self) -> WorkerLoad:
        """What runs and what waits now (any thread)."""
        with self._cond:
            return WorkerLoad(int(self._busy_generating), len(self._generation), self._held_tokens)

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            pending = [*self._control, *self._generation]
            self._control.clear()
            self._generation.clear()
            self._cond.notify_all()
        for job in pending:
            job.emit("error", RuntimeError("the engine is shutting down"))
        self._thread.join(timeout=30)

    # -- the worker thread ---------------------------------------------------------------------------

    def _take(self) -> Job | None:
        with self._cond:
            self._cond.wait_for(
                lambda: self._stopping or self._control or (self._generation and not self._paused)
            )
            if self._stopping:
                return None
            if self._control:
                return self._control.popleft()
            self._busy_generating = True
            return self._generation.popleft()

    def _loop(self) -> None:
        while (job := self._take()) is not None:
            try:
                if not job.cancelled.is_set():
                    job.emit("done", job.run(job))
            except Exception as exc:  # a job's failure belongs to its request, not to the worker
                job.emit("error", exc)
            finally:
                with self._cond:
                    self._busy_generating = False
                    self._held_tokens = 0
                    self._cond.notify_all()

    # -- job bodies (run on the worker thread) --------------------------------------------------------

    def generate(self, job: Job, prompt_ids: list[int], params: GenerationParams) -> int:
        """Sample up to ``max_tokens`` tokens, emitting a TokenEvent per token; return the weight version."""
        generator = torch.Generator().manual_seed(
            params.seed
            if params.seed is not None
            else int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
        )
        version = self.weight_version
        detok = IncrementalDetokenizer(lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True))
        holdback = max((len(s) for s in params.stop), default=1) - 1
        shown = 0
        stop_ids = set(self.eos_token_ids) | set(params.stop_token_ids)
        named_stops = set(self._extra_stop_ids) | set(params.stop_token_ids)
        cache = self._new_cache()
        self._held_tokens = len(prompt_ids)
        with torch.inference_mode():
            logits = self.model(
                input_ids=torch.tensor([prompt_ids]),
                **{self._cache_kwarg: cache},
                use_cache=True,
                logits_to_keep=1,
            ).logits[0, -1]
            for step in range(params.max_tokens):
                logprobs = processed_logprobs(logits, params.temperature)
                token = sample_token(logprobs, params.temperature, generator)
                searched = len(detok.text)
                detok.push(token)
                finish, stop_reason, text_end = None, None, len(detok.text)
                if token in stop_ids:
                    finish = "stop"
                    stop_reason = token if token in named_stops else None
                elif params.stop and (match := find_stop(detok.text, params.stop, searched)):
                    finish, stop_reason, text_end = "stop", match.stop, match.text_end
                elif job.cancelled.is_set():
                    finish = "abort"
                elif step == params.max_tokens - 1:
                    finish = "length"
                if finish is not None:
                    if finish != "stop" or stop_reason is None or isinstance(stop_reason, int):
                        detok.flush()
                        text_end = len(detok.text)
                    visible_to = text_end
                else:
                    visible_to = max(shown, len(detok.text) - holdback) if params.stop else len(detok.text)
                job.emit(
                    "token",
                    TokenEvent(
                        token,
                        float(logprobs[token]),
                        detok.text[shown:visible_to],
                        finish,
                        stop_reason,
                        _top(logprobs, params.top_logprobs),
                        version if finish is not None else None,
                    ),
                )
                shown = visible_to
                if finish is not None:
                    return version
                self._held_tokens += 1
                logits = self.model(
                    input_ids=torch.tensor([[token]]), **{self._cache_kwarg: cache}, use_cache=True
                ).logits[0, -1]
        return version

    def replay(
        self, job: Job, prompt_ids: list[int], completion_ids: list[int], params: GenerationParams
    ) -> int:
        """Emit fixed ``completion_ids`` as if sampled, with the model's own processed logprobs."""
        completion_ids = completion_ids[: params.max_tokens]
        self._held_tokens = len(prompt_ids) + len(completion_ids)  # scored in one pass: all of it at once
        logprobs = self.score(prompt_ids, completion_ids, params.temperature, params.top_logprobs)
        detok = IncrementalDetokenizer(lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True))
        for index, (token, (logprob, top)) in enumerate(zip(completion_ids, logprobs, strict=True)):
            shown = len(detok.text)
            detok.push(token)
            finish = None
            stop_reason = None
            if index == len(completion_ids) - 1:
                finish = "stop" if token in self.eos_token_ids else "length"
                stop_reason = token if token in self._extra_stop_ids else None
                detok.flush()
            version = self.weight_version if finish is not None else None
            job.emit(
                "token", TokenEvent(token, logprob, detok.text[shown:], finish, stop_reason, top, version)
            )
        return self.weight_version

    def score(
        self, prompt_ids: list[int], completion_ids: list[int], temperature: float, top_logprobs: int = 0
    ) -> list[tuple[float, list[tuple[int, float]]]]:
        """Processed logprob (and top candidates) of each of ``completion_ids`` given ``prompt_ids``."""
        ids = torch.tensor([prompt_ids + completion_ids])
        with torch.inference_mode():
            logits = self.model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1]
            logprobs = processed_logprobs(logits, temperature)
        return [
            (float(row[token]), _top(row, top_logprobs))
            for row, token in zip(logprobs, completion_ids, strict=True)
        ]

    def check_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Reject an update that names unknown tensors, has wrong shapes, or does not advance the version."""
        if not tensors:
            raise WeightUpdateError("the update holds no tensors")
        unknown = sorted(set(tensors) - set(self._shapes))
        if unknown:
            raise WeightUpdateError(f"unknown tensor names: {', '.join(unknown[:5])}")
        for name, tensor in tensors.items():
            if tuple(tensor.shape) != self._shapes[name]:
                raise WeightUpdateError(
                    f"{name}: shape {tuple(tensor.shape)} does not match the model's {self._shapes[name]}"
                )
        if version <= self.weight_version:
            raise WeightUpdateError(
                f"version {version} does not advance the served version {self.weight_version}", status=409
            )

    def load_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> int:
        """Copy ``tensors`` into the model in place (tied weights stay tied); return the new version."""
        self.check_weights(tensors, version)
        state = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in tensors.items():
                state[name].copy_(tensor.to(state[name].dtype))
        self.weight_version = version
        return version

    def _new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)


def _top(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    values, ids = torch.topk(logprobs, k)
    return [(int(i), float(v)) for i, v in zip(ids, values, strict=True)]


def event_emitter(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> Callable[[str, Any], None]:
    """An ``emit`` that hands worker events to an asyncio queue on ``loop``."""

    def emit(kind: str, payload: Any) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, (kind, payload))

    return emit
