"""The per-session journal: one JSON line per call, on disk before the reply goes back.

Layout under the data dir (format in ``capture_proxy/JOURNAL.md``)::

    sessions/<session_id>/session.json   the session as minted (sampling, budget, metadata)
    sessions/<session_id>/calls.jsonl    one record per call, appended and fdatasync'd

Histories grow every turn, so a record does not repeat what the previous record of its session already
holds: when the new prompt ids start with the previous call's prompt + completion ids, only the suffix is
written (``prompt_base = [seq, n]``), and likewise for the request's messages (``messages_base``). A
record therefore costs O(new tokens), hundreds of calls per session stay cheap to write and to read back,
and any prefix that does not match is simply written in full. Reading expands every record; a torn last
line (a crash mid-write) is ignored and cut off before the next append.
"""

from __future__ import annotations

import asyncio
import os
from array import array
from collections.abc import Iterator
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import orjson

from capture_proxy.records import CallRecord, Finding

FORMAT_VERSION = 1
CALLS = "calls.jsonl"
SESSION = "session.json"


class JournalError(Exception):
    """A journal that cannot be read or written."""


def write_session_file(directory: Path, meta: dict[str, Any]) -> None:
    """Write ``session.json`` atomically (temp file, fsync, rename)."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / (SESSION + ".tmp")
    with open(tmp, "wb") as handle:
        handle.write(orjson.dumps({"v": FORMAT_VERSION, **meta}))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, directory / SESSION)
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Journal:
    """Appends the calls of one session. Callers serialise :meth:`append` (one writer per session)."""

    def __init__(self, directory: Path, executor: Executor | None = None) -> None:
        self.path = directory / CALLS
        self.executor = executor
        self.next_seq = 0
        self.bytes_written = 0
        # The last model record's prompt+completion ids (packed) and messages, for delta encoding.
        self._last_seq: int | None = None
        self._last_ids: bytes | None = None
        self._last_messages: list[Any] | None = None
        self._fd: int | None = None

    def open(self) -> None:
        """Open for appending, after cutting off a torn last line; resumes ``next_seq``."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        records = list(read_records(self.path, repair=True)) if self.path.exists() else []
        self.next_seq = records[-1].seq + 1 if records else 0
        for record in reversed(records):
            if record.has_ids:
                self._remember(record.seq, record.upstream_request.get("messages"), record)
                break
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.forget()

    def forget(self) -> None:
        """Drop the delta cache (the next record is written in full); frees memory of idle sessions."""
        self._last_seq = self._last_ids = self._last_messages = None

    def encode(self, record: CallRecord, prompt: array | None = None) -> bytes:
        """The journal line for ``record`` (assigns nothing; ``record.seq`` must be ``next_seq``)."""
        line = _base_fields(record)
        request = dict(record.upstream_request)
        messages = request.get("messages")
        line["messages_base"] = None
        if self._last_messages is not None and isinstance(messages, list):
            n = len(self._last_messages)
            if len(messages) >= n and messages[:n] == self._last_messages:
                line["messages_base"] = [self._last_seq, n]
                request["messages"] = messages[n:]
        line["request"] = request
        if record.has_ids:
            assert record.prompt_token_ids is not None and record.completion_token_ids is not None
            packed = prompt if prompt is not None else array("I", record.prompt_token_ids)
            line["prompt_base"], line["prompt_ids"] = None, record.prompt_token_ids
            if self._last_ids is not None and packed.tobytes().startswith(self._last_ids):
                n = len(self._last_ids) // packed.itemsize
                line["prompt_base"], line["prompt_ids"] = [self._last_seq, n], record.prompt_token_ids[n:]
            line["completion_ids"] = record.completion_token_ids
            line["logprobs"] = record.logprobs
        return orjson.dumps(line) + b"\n"

    async def append(self, record: CallRecord, prompt: array | None = None) -> int:
        """Write ``record`` and fdatasync; returns the bytes written. The caller holds the session's lock."""
        if self._fd is None:
            raise JournalError(f"journal {self.path} is not open")
        if record.seq != self.next_seq:
            raise JournalError(f"record seq {record.seq} != next seq {self.next_seq}")
        data = self.encode(record, prompt)
        fd = self._fd
        await asyncio.get_running_loop().run_in_executor(self.executor, _write_synced, fd, data)
        self.next_seq += 1
        self.bytes_written += len(data)
        if record.has_ids:
            self._remember(record.seq, record.upstream_request.get("messages"), record, prompt)
        return len(data)

    def _remember(self, seq: int, messages: Any, record: CallRecord, prompt: array | None = None) -> None:
        assert record.prompt_token_ids is not None and record.completion_token_ids is not None
        packed = prompt if prompt is not None else array("I", record.prompt_token_ids)
        self._last_seq = seq
        self._last_ids = packed.tobytes() + array("I", record.completion_token_ids).tobytes()
        self._last_messages = messages if isinstance(messages, list) else None


def _write_synced(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]
    os.fdatasync(fd)


def _base_fields(record: CallRecord) -> dict[str, Any]:
    return {
        "v": FORMAT_VERSION,
        "seq": record.seq,
        "call_id": record.call_id,
        "kind": record.kind,
        "dialect": record.dialect,
        "has_tools": record.has_tools,
        "started_at": record.started_at,
        "finished_at": record.finished_at,
        "agent_params": record.agent_params,
        "sampling": record.sampling,
        "response": record.response,
        "weight_version": record.weight_version,
        "finding": record.finding.to_json() if record.finding else None,
        "timings": record.timings,
    }


def read_records(path: Path, repair: bool = False) -> Iterator[CallRecord]:
    """Every record of a journal, expanded, in file order. ``repair`` truncates a torn last line."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise JournalError(f"cannot read journal {path}: {exc}") from exc
    end = data.rfind(b"\n") + 1
    if repair and end < len(data):
        with open(path, "r+b") as handle:
            handle.truncate(end)
    expander = _Expander()
    for number, line in enumerate(data[:end].splitlines(), start=1):
        if not line.strip():
            continue
        try:
            raw = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise JournalError(f"{path}:{number}: not JSON: {exc}") from exc
        yield expander.expand(raw, f"{path}:{number}")


class _Expander:
    """Rebuilds full prompts and message lists from delta-encoded lines, in order.

    A line's base is always the latest earlier record with ids (the writer's cache), so only that one
    is kept.
    """

    def __init__(self) -> None:
        self.ids: dict[int, list[int]] = {}
        self.messages: dict[int, list[Any]] = {}

    def expand(self, raw: dict[str, Any], where: str) -> CallRecord:
        try:
            request = dict(raw["request"])
            request["messages"] = self._resolve(
                self.messages, raw.get("messages_base"), request.get("messages")
            )
            prompt = completion = None
            if raw.get("prompt_ids") is not None:
                prompt = self._resolve(self.ids, raw.get("prompt_base"), raw["prompt_ids"])
                completion = raw["completion_ids"]
            finding = raw.get("finding")
            record = CallRecord(
                seq=raw["seq"],
                call_id=raw["call_id"],
                kind=raw["kind"],
                dialect=raw["dialect"],
                has_tools=raw["has_tools"],
                started_at=raw["started_at"],
                finished_at=raw["finished_at"],
                upstream_request=request,
                agent_params=raw["agent_params"],
                sampling=raw["sampling"],
                response=raw.get("response"),
                prompt_token_ids=prompt,
                completion_token_ids=completion,
                logprobs=raw.get("logprobs"),
                weight_version=raw.get("weight_version"),
                finding=Finding(**finding) if finding else None,
                timings=raw.get("timings") or {},
            )
        except (KeyError, TypeError, IndexError) as exc:
            raise JournalError(f"{where}: malformed record: {exc!r}") from exc
        if prompt is not None and completion is not None:
            self.ids = {record.seq: prompt + completion}
            self.messages = {record.seq: request["messages"] or []}
        return record

    @staticmethod
    def _resolve(table: dict[int, list[Any]], base: Any, tail: Any) -> Any:
        if base is None:
            return tail
        seq, n = base
        if seq not in table:
            raise KeyError(f"base record {seq} not found before this one")
        return table[seq][:n] + list(tail or [])
