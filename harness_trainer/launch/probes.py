"""Behavioural probes of the inference engine: what it does, not what it says about itself.

:func:`run_probes` runs three probes against an engine (vLLM or the dev engine) and returns one
:class:`ProbeVerdict` (a line of what it saw) each, or raises :class:`ProbeError` (one line: the probe's
name and what it saw) at the first that fails. Preflight runs them after its engine check
(:func:`~harness_trainer.launch.preflight.run_preflight`; ``--skip-probes`` skips them), the dev loop
before its first rollout, and ``harness-trainer serve --prepare`` against each ``--upstream``.

1. ``logprobs``: the trainer's importance correction assumes the engine returns the logprobs of the
   distribution it sampled from (vLLM's ``--logprobs-mode processed_logprobs``: temperature applied), not
   the raw model's. One fixed prompt, one token with ``top_logprobs=5``, at temperature 1 and 2, seed 0:
   processed logprobs are the log-softmax of logits/T, so the spread of the top candidates' logprobs (the
   summed gaps between them, the candidates listed at both temperatures: vLLM lists the sampled token
   among them) at T=2 is half that at T=1; raw ones do not move. Ratio < 0.75: processed, passes; > 0.9:
   raw, refused; in between, or a spread at T=1 under 1e-3: refused as undecidable, naming the numbers
   (:func:`judge_logprobs`).
2. ``tool_calls``: the served chat template renders an assistant tool call and its result. ``POST
   /tokenize`` with ``messages`` (a user turn, an assistant turn holding one tool call, its tool result)
   and ``tools``; ``POST /detokenize`` of those ids holds, after the user turn, the call's name, its
   argument's key and value and the result (:func:`check_rendered_tool_call`); and a one-token chat
   completion of the same request is accepted and samples after exactly those ``prompt_token_ids``.
3. ``identity``: the served model is the one the trainer loads. ``--model`` is an id ``GET /v1/models``
   lists or the card's ``root`` (what the engine loaded; local folders compared resolved;
   :func:`model_matches`); then the trainer's tokenizer (``AutoTokenizer.from_pretrained(--model)``, from a
   local folder or the Hugging Face cache only, never downloaded) and the engine's ``POST /tokenize`` give
   the same ids for a few fixed strings and for the tokenizer's added tokens, which sit at the top of its
   vocabulary (the engine's vocabulary reaches as far, with the same tokens there). A tokenizer that cannot
   be loaded makes that half "skipped: <why>"; no ``--model`` (serve loads no policy) skips the probe.

Requests: ``GET /v1/models`` (when the served names are not given), ``POST /tokenize`` (one chat, one per
probe string), ``POST /detokenize`` (one), three one-token ``POST /v1/chat/completions`` with
``skip_script`` (a scripted dev engine samples them rather than handing out its replies; vLLM ignores it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx

TOP_LOGPROBS = 5
PROCESSED_BELOW = 0.75
"""Spread ratio T=2 / T=1 under which the logprobs are processed (exactly 0.5 expected)."""
RAW_ABOVE = 0.9
"""Spread ratio over which they are raw (exactly 1 expected)."""
MIN_SPREAD = 1e-3
"""A top-candidate spread at T=1 below this tells nothing (a flat distribution)."""
LOGPROB_PROMPT = [{"role": "user", "content": "Name one colour of the rainbow."}]
USER_MARK = "probe-question-5103: read the probe file."
CALL_NAME = "read_probe_file"
CALL_ARGUMENT = ("path", "probe-input-4417.txt")
RESULT_MARK = "probe-result-8812"
TOOL_MESSAGES = [
    {"role": "user", "content": USER_MARK},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_probe_0",
                "type": "function",
                "function": {"name": CALL_NAME, "arguments": json.dumps(dict([CALL_ARGUMENT]))},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_probe_0", "content": RESULT_MARK},
]
TOOL_DEFINITION = {
    "type": "function",
    "function": {
        "name": CALL_NAME,
        "description": "Read a file.",
        "parameters": {
            "type": "object",
            "properties": {CALL_ARGUMENT[0]: {"type": "string"}},
            "required": [CALL_ARGUMENT[0]],
        },
    },
}
PROBE_STRINGS = (
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b  # sum\n",
    "naïve café, 東京, ½ → ∞ 🚀",
    '{"name": "bash", "arguments": {"command": "ls -la /tmp"}}',
)
"""What the engine and the trainer's tokenizer must tokenize alike."""


class ProbeError(Exception):
    """A probe saw the engine do what the trainer cannot use; its message is one line: probe, what it saw."""

    def __init__(self, probe: str, saw: str) -> None:
        self.probe = probe
        self.saw = " ".join(saw.split())
        super().__init__(f"{probe}: {self.saw}")


@dataclass(frozen=True)
class ProbeVerdict:
    """What a probe that passed (or was skipped) saw."""

    probe: str
    saw: str

    def __str__(self) -> str:
        return f"{self.probe}: {self.saw}"


def run_probes(
    engine_url: str,
    model: str | None,
    *,
    served: Sequence[str] | None = None,
    timeout_s: float = 60.0,
) -> list[ProbeVerdict]:
    """Every probe (module docstring) against the engine at ``engine_url`` (with or without ``/v1``);
    ``model`` is the trainer's ``--model`` (None: no identity probe), ``served`` the engine's model ids
    when the caller has already listed them.

    Raises:
        ProbeError: the first probe that failed.
    """
    url = engine_url.rstrip("/").removesuffix("/v1")
    with httpx.Client(timeout=timeout_s) as client:
        cards = _model_cards(client, url)
        ids = list(served) if served else [str(card.get("id")) for card in cards]
        if not ids:
            raise ProbeError("identity", f"the engine at {url} lists no model on GET /v1/models")
        name = ids[0]
        return [
            probe_logprobs(client, url, name),
            probe_tool_calls(client, url, name),
            probe_identity(client, url, name, model, ids, [str(c["root"]) for c in cards if c.get("root")]),
        ]


def probe_logprobs(client: httpx.Client, url: str, name: str) -> ProbeVerdict:
    """The ``logprobs`` probe: the top candidates' logprobs at temperatures 1 and 2, judged."""
    at = {}
    for temperature in (1.0, 2.0):
        body = {
            "model": name, "messages": LOGPROB_PROMPT, "max_tokens": 1, "temperature": temperature,
            "seed": 0, "logprobs": True, "top_logprobs": TOP_LOGPROBS, "skip_script": True,
        }  # fmt: skip
        reply = _post(client, url, "/v1/chat/completions", body, "logprobs")
        try:
            entries = reply["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
            at[temperature] = {str(e["token"]): float(e["logprob"]) for e in entries}
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise ProbeError(
                "logprobs", f"no top_logprobs in a one-token reply with top_logprobs={TOP_LOGPROBS} ({exc!r})"
            ) from exc
    return ProbeVerdict("logprobs", judge_logprobs(at[1.0], at[2.0]))


def judge_logprobs(at_1: dict[str, float], at_2: dict[str, float]) -> str:
    """What the top candidates' logprobs at T=1 (``at_1``) and T=2 (``at_2``), token → logprob, say of the
    engine's logprobs mode: "processed ..." when the spread halves.

    Raises:
        ProbeError: raw logprobs (the spread does not move), or a ratio or spread that cannot tell.
    """
    common = sorted((t for t in at_1 if t in at_2), key=lambda t: at_1[t], reverse=True)
    if len(common) < 2:
        raise ProbeError(
            "logprobs", f"undecidable: the top candidates at T=1 and T=2 share {len(common)} token(s)"
        )
    values = [at_1[t] for t in common] + [at_2[t] for t in common]
    if not all(math.isfinite(v) for v in values):
        raise ProbeError("logprobs", f"undecidable: non-finite top logprobs {values}")
    spread_1 = sum(abs(at_1[a] - at_1[b]) for a, b in pairwise(common))
    spread_2 = sum(abs(at_2[a] - at_2[b]) for a, b in pairwise(common))
    numbers = (
        f"{len(common)} shared top candidates' logprob spread {spread_1:.4g} at T=1, {spread_2:.4g} at T=2"
    )
    if spread_1 < MIN_SPREAD:
        raise ProbeError(
            "logprobs", f"undecidable: {numbers} (a spread under {MIN_SPREAD} at T=1 tells nothing)"
        )
    ratio = spread_2 / spread_1
    numbers += f", ratio {ratio:.3f}"
    if ratio < PROCESSED_BELOW:
        return f"processed ({numbers}; 0.5 expected)"
    if ratio > RAW_ABOVE:
        raise ProbeError(
            "logprobs",
            f"raw, not processed ({numbers}; processed logprobs halve it): the trainer's importance "
            "correction needs the logprobs of the distribution sampled from; start vLLM with "
            "--logprobs-mode processed_logprobs",
        )
    raise ProbeError(
        "logprobs",
        f"undecidable ({numbers}; processed logprobs give 0.5 (< {PROCESSED_BELOW}), raw 1 (> {RAW_ABOVE}))",
    )


def probe_tool_calls(client: httpx.Client, url: str, name: str) -> ProbeVerdict:
    """The ``tool_calls`` probe: the template renders the call and its result, and the chat route samples
    after the same ids."""
    rendered = _post(
        client, url, "/tokenize", {"model": name, "messages": TOOL_MESSAGES, "tools": [TOOL_DEFINITION]},
        "tool_calls",
    )  # fmt: skip
    ids = rendered.get("tokens")
    if not isinstance(ids, list) or not ids:
        raise ProbeError(
            "tool_calls", f"POST /tokenize of a tool-call conversation returned no tokens: {rendered}"
        )
    text = _post(client, url, "/detokenize", {"model": name, "tokens": ids}, "tool_calls").get("prompt")
    check_rendered_tool_call(str(text))
    body = {
        "model": name, "messages": TOOL_MESSAGES, "tools": [TOOL_DEFINITION], "max_tokens": 1,
        "temperature": 1.0, "seed": 0, "return_token_ids": True, "skip_script": True,
    }  # fmt: skip
    reply = _post(client, url, "/v1/chat/completions", body, "tool_calls")
    prompt_ids = reply.get("prompt_token_ids")
    if prompt_ids != ids:
        raise ProbeError(
            "tool_calls",
            f"a chat completion of the tool-call conversation sampled after {_ids_text(prompt_ids)}, "
            f"not the {len(ids)} ids POST /tokenize rendered",
        )
    return ProbeVerdict("tool_calls", f"a tool call and its result render in {len(ids)} prompt tokens")


def check_rendered_tool_call(text: str) -> None:
    """``text``, the probe conversation as the engine rendered it, holds after the user turn the tool call's
    name, its argument's key and value, and the tool result.

    Raises:
        ProbeError: the user turn, or something of the call or its result, is not there.
    """
    at = text.find(USER_MARK)
    if at == -1:
        raise ProbeError("tool_calls", f"the rendered prompt lacks the user turn: {_tail(text)}")
    after = text[at + len(USER_MARK) :]
    missing = [
        f"{what} {part!r}"
        for what, part in (
            ("the call's name", CALL_NAME),
            ("its argument", CALL_ARGUMENT[0]),
            ("the argument's value", CALL_ARGUMENT[1]),
            ("the tool result", RESULT_MARK),
        )
        if part not in after
    ]
    if missing:
        raise ProbeError(
            "tool_calls",
            f"the chat template does not render the assistant's tool call: after the user turn the prompt "
            f"lacks {', '.join(missing)} ({_tail(after)})",
        )


def probe_identity(
    client: httpx.Client, url: str, name: str, model: str | None, ids: Sequence[str], roots: Sequence[str]
) -> ProbeVerdict:
    """The ``identity`` probe: ``model`` is what the engine serves, and its tokenizer is the engine's."""
    if model is None:
        return ProbeVerdict("identity", f"skipped: no --model to compare the served {name!r} with")
    if not model_matches(model, ids, roots):
        loaded = f" loaded from {', '.join(roots)}" if roots else ""
        raise ProbeError(
            "identity",
            f"--model {model!r} is not what the engine serves ({', '.join(map(repr, ids))}{loaded}): pass "
            "the model the engine loaded",
        )
    root = next((r for r in roots if model_matches(model, [], [r])), None)
    served = f"{name!r} is --model" if model in ids or root is None else f"{name!r} (root {root}) is --model"
    tokenizer, why = load_tokenizer(model)
    if tokenizer is None:
        return ProbeVerdict("identity", f"{served}; tokenizer skipped: {why}")
    added = added_tokens(tokenizer)
    strings = [*PROBE_STRINGS, "".join(added.values())] if added else list(PROBE_STRINGS)
    for text in strings:
        engine_ids = _post(
            client, url, "/tokenize", {"model": name, "prompt": text, "add_special_tokens": False}, "identity"
        ).get("tokens")
        own = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if engine_ids != own:
            raise ProbeError(
                "identity",
                f"the engine tokenizes {text!r} as {_ids_text(engine_ids)}, the tokenizer of --model {model} "
                f"as {_ids_text(own)}: the engine serves another model",
            )
    vocabulary = f"vocabulary {len(tokenizer)} ids"
    if added:
        vocabulary += f", its {len(added)} added tokens at ids {min(added)}–{max(added)} on both"
    return ProbeVerdict(
        "identity", f"{served}; {vocabulary}; {len(PROBE_STRINGS)} probe strings tokenized alike"
    )


def model_matches(model: str, ids: Sequence[str], roots: Sequence[str]) -> bool:
    """``model`` (the trainer's ``--model``) is a served id or a root the engine loaded, or the same local
    folder as one."""
    if model in ids or model in roots:
        return True
    folder = Path(model).expanduser()
    if not folder.is_dir():
        return False
    return any(Path(other).expanduser().is_dir() and Path(other).expanduser().resolve() == folder.resolve()
               for other in (*ids, *roots))  # fmt: skip


def load_tokenizer(model: str) -> tuple[Any, str | None]:
    """The tokenizer of ``model`` from a local folder or the Hugging Face cache (never downloaded), or None
    and why it could not be loaded."""
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        return None, f"transformers is not installed ({exc})"
    try:
        return AutoTokenizer.from_pretrained(model, local_files_only=True), None
    except Exception as exc:  # every kind: a missing folder, no cached files, a broken tokenizer file
        return None, f"cannot load the tokenizer of {model!r} without downloading it ({type(exc).__name__})"


def added_tokens(tokenizer: Any) -> dict[int, str]:
    """The tokenizer's added tokens, id → text (empty when it has none or does not say)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {int(i): str(getattr(t, "content", t)) for i, t in sorted(decoder.items())}


def _model_cards(client: httpx.Client, url: str) -> list[dict[str, Any]]:
    try:
        reply = client.get(f"{url}/v1/models")
        data = reply.json().get("data") if reply.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        raise ProbeError("identity", f"GET {url}/v1/models failed: {exc!r}") from exc
    return [card for card in data or [] if isinstance(card, dict)]


def _post(client: httpx.Client, url: str, path: str, body: dict[str, Any], probe: str) -> dict[str, Any]:
    try:
        reply = client.post(url + path, json=body)
    except httpx.HTTPError as exc:
        raise ProbeError(probe, f"POST {url}{path} failed: {exc!r}") from exc
    try:
        answer = reply.json()
    except ValueError:
        answer = None
    if reply.status_code != 200 or not isinstance(answer, dict):
        error = answer.get("error", answer) if isinstance(answer, dict) else reply.text
        message = error.get("message", error) if isinstance(error, dict) else error
        raise ProbeError(probe, f"POST {path} answered {reply.status_code}: {str(message)[:300]}")
    return answer


def _ids_text(ids: Any) -> str:
    if not isinstance(ids, list):
        return repr(ids)
    shown = ", ".join(map(str, ids[:8]))
    return f"[{shown}{', …' if len(ids) > 8 else ''}] ({len(ids)} ids)"


def _tail(text: str, size: int = 160) -> str:
    return repr(text[-size:]) if len(text) > size else repr(text)
