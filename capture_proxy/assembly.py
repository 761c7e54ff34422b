"""Trace assembly: a session's call records in, a TrainingTrace JSON dict out. Pure, stdlib only.

``assemble_trace(records)`` returns ``{"schema_version": 1, "turns": [...]}``, the wire form of
``harness_trainer.trace.TrainingTrace`` (and of OpenEnv's); the caller validates it. It never imports the
trainer. The rules, in the order they apply:

1. **Candidates.** Only ``kind == "model"`` records whose token ids are usable (``has_ids``, a non-empty
   prompt, ids that are ints in ``[0, 2**32)``) take part. Budget, context and upstream-error records are
   never turns. No model record at all, or model records of which none has usable ids, raise
   :class:`UntrainableSession` with the reason.
2. **Parent.** :func:`capture_proxy.forest.parents` over the candidates in ``(seq, call_id)`` order: a
   call's parent is the *other* candidate whose prompt+completion ids are the longest exact prefix of its
   prompt ids; ties (identical full sequences) go to the lowest ``seq``. A candidate with the same prompt is
   a sibling, never a parent (so an empty completion cannot make a cycle). A call without a parent is a
   root: a rewritten history (compaction, stripped reasoning) opens a new root. Parents depend on the ids
   and ``seq`` only, never on the order the records arrive in.
3. **Abandoned retries are discarded.** Among siblings (identical prompts), those without descendants
   are dropped when at least one sibling has descendants; when none has, only the highest-``seq`` one
   (the answer the agent went on with) stays. Only leaves are dropped, so no other parent changes.
4. **Each sampled token is supervised once.** Applied after rule 3, among kept calls: of calls with an
   identical prompt *and* completion only the lowest-``seq`` one is supervised; the others are context
   (``metadata["duplicate_of"]``). Rule 2's tie-break sends every child of such twins to the lowest
   ``seq``, so rule 3 already leaves at most one of them; this is the guard that makes it a promise.
5. **Auxiliary calls.** When some candidate carries tools, every tree (a root and all its descendants)
   in which no candidate carries tools is auxiliary (opencode's title call): kept, never supervised,
   ``metadata["auxiliary"] = True``. A session in which no call carries tools has no auxiliary calls.
6. **Findings.** A call whose capture failed validation stays as context: never supervised,
   ``metadata["finding"]`` set. Its logprobs, when unusable (missing, misaligned, not finite or > 0), are
   replaced by ``0.0`` placeholders so the trace stays valid (``metadata["placeholder_logprobs"]``).
7. **Turns**, sorted by ``seq``: ``node_id`` = ``call_id``; ``loss_mask`` = 0 per prompt id, then 1 per
   completion id when supervised (else 0); ``per_token_logps`` = the record's logprobs; ``request`` = the
   upstream request; ``response`` = the engine's reply or ``{}``. ``metadata``: ``seq``, ``parent``,
   ``root``, ``depth``, ``dialect``, ``has_tools``, ``weight_version`` (the version that answered: the
   engine reply's own, else the policy version the proxy knew when the reply came back), ``dispatch_version``
   (the policy version the proxy knew when it sent the call; None when none was set, and in journals older
   than it), ``sampling``, ``agent_params``, ``timings``, ``started_at``, ``finished_at``, ``auxiliary``,
   ``duplicate_of`` and ``finding``. An empty completion is legal and kept.

Cost: ids are packed once into ``uint32`` bytes, which checks them; :mod:`capture_proxy.forest` searches
parents on those bytes (memcmp), linear in the total number of ids for an append-only conversation, and
they key the sibling and twin groups. The turns share id lists with the records (no copies).
"""

from __future__ import annotations

import math
from array import array
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

from capture_proxy.forest import parents
from capture_proxy.records import MODEL, CallRecord

SCHEMA_VERSION = 1


class UntrainableSession(Exception):
    """Nothing in the session can be trained on; ``reason`` says why (the admin route answers 409)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class CallTree:
    """The prefix forest over a session's candidate calls (rules 1 and 2), every map keyed by ``call_id``.

    ``calls`` is in ``(seq, call_id)`` order; ``children`` lists are in that order too. ``siblings`` holds
    each group of two or more calls with an identical prompt, ``twins`` each group of two or more with an
    identical prompt and completion, every group in ``seq`` order.
    """

    calls: dict[str, CallRecord]
    parent: dict[str, str | None]
    children: dict[str, list[str]]
    root: dict[str, str]
    depth: dict[str, int]
    siblings: list[list[str]]
    twins: list[list[str]]


@dataclass(eq=False)
class _Packed:
    """A candidate's ids as ``uint32`` bytes: packing checks them, the parent search compares them with
    memcmp, and they are compact keys for grouping."""

    call_id: str
    prompt: bytes
    completion: bytes


def _pack(record: CallRecord) -> _Packed | None:
    """The record's ids packed as ``uint32``; None when they are not usable ids."""
    prompt, completion = record.prompt_token_ids, record.completion_token_ids
    if prompt is None or completion is None or not prompt:
        return None
    try:
        packed_prompt, packed_completion = array("I", prompt).tobytes(), array("I", completion).tobytes()
    except (OverflowError, TypeError):  # a negative, huge or non-int id: the capture flagged it
        return None
    return _Packed(record.call_id, packed_prompt, packed_completion)


def _order(record: CallRecord) -> tuple[int, str]:
    return record.seq, record.call_id


def call_tree(records: Iterable[CallRecord]) -> CallTree:
    """The prefix forest over the candidates among ``records`` (others are ignored); see rule 2."""
    packed: dict[str, _Packed] = {}
    calls: dict[str, CallRecord] = {}
    for record in sorted(records, key=_order):
        if record.kind == MODEL and (entry := _pack(record)) is not None:
            packed[record.call_id], calls[record.call_id] = entry, record
    entries = list(packed.values())
    found = parents([entry.prompt for entry in entries], [entry.completion for entry in entries])
    parent = {
        entry.call_id: None if index is None else entries[index].call_id
        for entry, index in zip(entries, found, strict=True)
    }
    children: dict[str, list[str]] = {call_id: [] for call_id in calls}
    for call_id, parent_id in parent.items():
        if parent_id is not None:
            children[parent_id].append(call_id)
    root: dict[str, str] = {}
    depth: dict[str, int] = {}
    # A parent's prompt is strictly shorter than its child's, so this order visits parents first.
    for entry in sorted(entries, key=lambda entry: len(entry.prompt)):
        call_id, parent_id = entry.call_id, parent[entry.call_id]
        root[call_id] = call_id if parent_id is None else root[parent_id]
        depth[call_id] = 0 if parent_id is None else depth[parent_id] + 1
    siblings = _groups(packed.values(), lambda entry: entry.prompt)
    twins = _groups(packed.values(), lambda entry: (entry.prompt, entry.completion))
    return CallTree(calls, parent, children, root, depth, siblings, twins)


def _groups(entries: Iterable[_Packed], key: Callable[[_Packed], Hashable]) -> list[list[str]]:
    by_key: dict[Hashable, list[str]] = defaultdict(list)
    for entry in entries:  # in seq order, so each group is too
        by_key[key(entry)].append(entry.call_id)
    return [group for group in by_key.values() if len(group) > 1]


def abandoned_retries(tree: CallTree) -> set[str]:
    """The calls rule 3 discards: siblings the conversation did not go on from."""
    dropped: set[str] = set()
    for group in tree.siblings:
        continued = [call_id for call_id in group if tree.children[call_id]]
        kept = set(continued) if continued else {group[-1]}
        dropped.update(call_id for call_id in group if call_id not in kept)
    return dropped


def duplicate_of(tree: CallTree, kept: set[str]) -> dict[str, str]:
    """Rule 4: each kept call that repeats an earlier kept call's prompt and completion, and that call."""
    duplicates: dict[str, str] = {}
    for group in tree.twins:
        survivors = [call_id for call_id in group if call_id in kept]
        duplicates.update((call_id, survivors[0]) for call_id in survivors[1:])
    return duplicates


def auxiliary_calls(tree: CallTree) -> set[str]:
    """Rule 5: every call of a tree in which no call carries tools, when some call in the session does."""
    tool_roots = {tree.root[call_id] for call_id, record in tree.calls.items() if record.has_tools}
    if not tool_roots:
        return set()
    return {call_id for call_id in tree.calls if tree.root[call_id] not in tool_roots}


def assemble_trace(records: Iterable[CallRecord]) -> dict[str, Any]:
    """The session's TrainingTrace as a JSON dict (rules in the module docstring).

    Raises:
        UntrainableSession: no model call, or none with usable token ids.
    """
    model = [record for record in records if record.kind == MODEL]
    tree = call_tree(model)
    if not tree.calls:
        raise UntrainableSession(_untrainable_reason(model))
    kept = set(tree.calls) - abandoned_retries(tree)
    duplicates = duplicate_of(tree, kept)
    auxiliary = auxiliary_calls(tree)
    turns = [
        _turn(tree, call_id, auxiliary=call_id in auxiliary, duplicate=duplicates.get(call_id))
        for call_id in tree.calls
        if call_id in kept
    ]
    return {"schema_version": SCHEMA_VERSION, "turns": turns}


def _untrainable_reason(model: list[CallRecord]) -> str:
    if not model:
        return "no model calls were made in this session: the agent never reached the engine"
    without_ids = sum(not record.has_ids for record in model)
    reason = (
        f"none of the session's {len(model)} model calls has usable token ids: the engine returned no "
        f"token ids for {without_ids} of them"
    )
    if without_ids < len(model):
        reason += f" and invalid ones (empty prompt, ids not in [0, 2**32)) for {len(model) - without_ids}"
    return reason + (
        "; serve vLLM with --return-tokens-as-token-ids and --logprobs-mode processed_logprobs, at a version "
        "that honours return_token_ids=true"
    )


def _turn(tree: CallTree, call_id: str, *, auxiliary: bool, duplicate: str | None) -> dict[str, Any]:
    record = tree.calls[call_id]
    prompt, completion = record.prompt_token_ids or [], record.completion_token_ids or []
    supervised = not auxiliary and duplicate is None and record.finding is None
    logprobs: list[float] = record.logprobs if record.logprobs is not None else []
    placeholder = record.finding is not None and not _usable_logprobs(logprobs, len(completion))
    metadata: dict[str, Any] = {
        "seq": record.seq,
        "parent": tree.parent[call_id],
        "root": tree.root[call_id],
        "depth": tree.depth[call_id],
        "dialect": record.dialect,
        "has_tools": record.has_tools,
        "weight_version": record.weight_version,
        "dispatch_version": record.dispatch_version,
        "sampling": dict(record.sampling),
        "agent_params": dict(record.agent_params),
        "timings": dict(record.timings),
        "started_at": record.started_at,
        "finished_at": record.finished_at,
        "auxiliary": auxiliary,
        "duplicate_of": duplicate,
        "finding": record.finding.to_json() if record.finding is not None else None,
    }
    if placeholder:
        metadata["placeholder_logprobs"] = True
    return {
        "node_id": call_id,
        "prompt_token_ids": prompt,
        "completion_token_ids": completion,
        "per_token_logps": [0.0] * len(completion) if placeholder else logprobs,
        "loss_mask": [0] * len(prompt) + [int(supervised)] * len(completion),
        "request": record.upstream_request,
        "response": record.response or {},
        "metadata": metadata,
    }


def _usable_logprobs(logprobs: list[Any], count: int) -> bool:
    """Whether ``logprobs`` would pass TrainingTrace's rules: one finite number <= 0 per completion id."""
    if len(logprobs) != count:
        return False
    numbers = all(type(value) in (int, float) for value in logprobs)
    return numbers and all(math.isfinite(value) and value <= 0 for value in logprobs)
