"""Reading the engine's raw reply cheaply: the big parts are cut out of the bytes before the JSON parse.

A vLLM reply with capture fields is mostly two things the proxy never hands to the agent: the prompt's
ids (thousands of integers) and one logprob object per sampled token. Parsed into Python objects they
are most of the cost of a call, so they are cut out of the compact JSON first:

- ``prompt_token_ids`` stays text (the journal compares and stores it as text);
- ``choices[0].logprobs`` is decoded by msgspec into small structs holding only ``token`` and
  ``logprob`` (vLLM's ``bytes`` and ``top_logprobs`` are skipped without being built);
- the rest, now small, is parsed with orjson.

A key can only match as a real object key: inside a JSON string every ``"`` is escaped, so the bytes
``"logprobs":`` cannot occur there. Anything unexpected (a key absent, twice, spaced, NaN logprobs, a
cut that does not parse) falls back to parsing the whole reply, where the checks in
:mod:`capture_proxy.capture` say what is wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson

_PROMPT_KEY = b'"prompt_token_ids":['
_LOGPROBS_KEY = b'"logprobs":{"content":['
_LOGPROBS_END = b"}]}"  # the last entry, the content array and the logprobs object closing together


class LogprobEntry(msgspec.Struct, gc=False):
    """One sampled token's entry in ``choices[0].logprobs.content``: what the capture check reads."""

    token: str
    logprob: float


class _Logprobs(msgspec.Struct, gc=False):
    content: list[LogprobEntry] | None = None


_decode_logprobs = msgspec.json.Decoder(_Logprobs).decode


@dataclass
class EngineReply:
    """A 200 reply: the parsed JSON without the parts cut out, and those parts."""

    body: dict[str, Any]  # without ``prompt_token_ids`` when cut, without choices[0].logprobs when cut
    prompt_text: bytes | None = None  # ``prompt_token_ids`` as JSON text without brackets, when cut
    logprobs: list[LogprobEntry] | None = None  # ``choices[0].logprobs.content``, when cut


def read_reply(raw: bytes) -> EngineReply:
    """The engine's reply; raises ``ValueError`` if it is not a JSON object."""
    cut = _cut_both(raw)
    if cut is not None:
        small, prompt_text, logprobs_text = cut
        try:
            body, decoded = loads(small), _decode_logprobs(logprobs_text)
        except (ValueError, msgspec.DecodeError):
            pass
        else:
            if _logprobs_were_cut(body) and "prompt_token_ids" not in body and decoded.content is not None:
                return EngineReply(body, prompt_text, decoded.content)
    prompt_text, rest = split_prompt_ids(raw)
    try:
        body = loads(rest)
    except ValueError:
        prompt_text = None
        try:
            body = loads(raw)
        except ValueError as exc:
            raise ValueError(f"the engine's reply is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ValueError("the engine's reply is not a JSON object")
    return EngineReply(body, prompt_text)


def _cut_both(raw: bytes) -> tuple[bytes, bytes, memoryview] | None:
    """``(rest, ids_text, logprobs_text)`` with both big members cut out in one pass, or None.

    The fast path for a vLLM reply: the rest is assembled from the three pieces around the two members
    (copying ~2 KB instead of the whole reply twice), and the logprobs stay a view into ``raw``. Each key
    must occur once: the rest is checked to hold neither, and the parsed body to lack both members.
    """
    prompt = raw.rfind(_PROMPT_KEY)  # vLLM sends it last but for a few short members
    logprobs = raw.find(_LOGPROBS_KEY)
    if prompt < 0 or logprobs < 0:
        return None
    ids_start = prompt + len(_PROMPT_KEY)
    ids_end = raw.find(b"]", ids_start)
    if logprobs < prompt:
        # Scanning back from the prompt ids crosses a few short members, not every logprob entry; an
        # end found too late (inside a string) leaves a cut that does not parse, so the reply is parsed whole.
        logprobs_end = raw.rfind(_LOGPROBS_END, logprobs, prompt)
    else:
        logprobs_end = raw.find(_LOGPROBS_END, logprobs)
    if ids_end < 0 or logprobs_end < 0:
        return None
    logprobs_end += len(_LOGPROBS_END)
    first, second = sorted((_member(raw, prompt, ids_end + 1), _member(raw, logprobs, logprobs_end)))
    if first[1] > second[0]:
        return None
    rest = raw[: first[0]] + raw[first[1] : second[0]] + raw[second[1] :]
    if _PROMPT_KEY in rest or _LOGPROBS_KEY in rest:
        return None
    view = memoryview(raw)[logprobs + len(b'"logprobs":') : logprobs_end]
    return rest, raw[ids_start:ids_end], view


def _member(raw: bytes, start: int, end: int) -> tuple[int, int]:
    """The span of the object member at ``[start, end)`` with one comma beside it."""
    if raw[end : end + 1] == b",":
        return start, end + 1
    if raw[start - 1 : start] == b",":
        return start - 1, end
    return start, end


def split_prompt_ids(raw: bytes) -> tuple[bytes | None, bytes]:
    """``(ids_text, rest)``: the top-level ``prompt_token_ids`` array's text cut out of a compact JSON reply.

    vLLM has the key once, at the top level; anything else (absent, null, spaced, twice) returns
    ``(None, raw)``. ``rest`` may still fail to parse (unusual spacing around the member): the caller
    then parses the whole reply.
    """
    start = raw.find(_PROMPT_KEY)
    if start < 0:
        return None, raw
    value = start + len(_PROMPT_KEY)
    end = raw.find(b"]", value)
    if end < 0 or raw.find(_PROMPT_KEY, end) >= 0:
        return None, raw
    return raw[value:end], _without(raw, start, end + 1)


def loads(raw: bytes) -> Any:
    """Parse JSON fast; fall back to the stdlib for NaN/Infinity, which some engines emit in logprobs."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def _without(raw: bytes, start: int, end: int) -> bytes:
    """``raw`` without the object member at ``[start, end)`` and one comma beside it."""
    start, end = _member(raw, start, end)
    return raw[:start] + raw[end:]


def _logprobs_were_cut(body: Any) -> bool:
    """Whether the cut member was ``choices[0].logprobs`` (it is gone from there, and nothing else is)."""
    if not isinstance(body, dict):
        return False
    choices = body.get("choices")
    return (
        isinstance(choices, list)
        and len(choices) >= 1
        and isinstance(choices[0], dict)
        and "logprobs" not in choices[0]
    )
