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

An open journal keeps a zeroed reserve past its last line (``RESERVE_BYTES``), and each line overwrites
the zeros in place: an fdatasync that does not change the file's size flushes the data alone, while one
after an append also commits the file system's own journal (ext4, xfs). That measured 0.20 → 0.09 ms
per sync here, and a sync is on the path of every reply. A new session's reserve is written when the
session is created (:meth:`Journal.reserve`, off the event loop); a line that outgrows it is written
with the next reserve behind it. A JSON line never holds a NUL byte, so readers stop at the first one;
closing the journal cuts the reserve off, and a reload after a crash cuts it off with a torn line.

The prefix test runs on the ids' JSON text as the engine sent it (``CallRecord.prompt_text``), so the
hot path never turns thousands of prompt ids into Python ints: only the new suffix is parsed, which also
validates it (non-negative integers below 2**32); the prefix is text already validated in an earlier
record. A prompt that fails validation is not journaled as ids: the record gets the ``bad_token_ids``
finding instead.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from capture_proxy.records import CallRecord, Finding
from capture_proxy.writer import JournalWriter

FORMAT_VERSION = 1
_COMMA = ord(",")
CALLS = "calls.jsonl"
SESSION = "session.json"
RESERVE_BYTES = 256 * 1024
_RESERVE = bytes(RESERVE_BYTES)


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

    def __init__(self, directory: Path, writer: JournalWriter | None = None) -> None:
        self.path = directory / CALLS
        self.writer = writer
        self.next_seq = 0
        self.bytes_written = 0
        # The last record with ids: its seq, prompt+completion ids as JSON text and count, and messages.
        self._last_seq: int | None = None
        self._last_text: bytes | None = None
        self._last_count = 0
        self._last_messages: list[Any] | None = None
        self._pending_count = 0  # prompt length of the record being appended, known from its delta
        self._fd: int | None = None
        self._end = 0  # where the next line goes: the end of the last line
        self._reserved = 0  # the file's size: the zeroed reserve ends here

    def open(self) -> None:
        """Open for appending, after cutting off a torn last line; resumes ``next_seq``."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        records = list(read_records(self.path, repair=True)) if self.path.exists() else []
        self.next_seq = records[-1].seq + 1 if records else 0
        for record in reversed(records):
            if record.has_ids and record.prompt_token_ids is not None:
                self._remember(record, ids_text(record.prompt_token_ids), len(record.prompt_token_ids))
                break
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
        self._end = self._reserved = os.fstat(self._fd).st_size

    def reserve(self) -> None:
        """Write the zeroed reserve and make it and the file's name durable now; blocking, so a new
        session calls it off the event loop, and its first lines' syncs then flush only their data."""
        if self._fd is None:
            raise JournalError(f"journal {self.path} is not open")
        if self._reserved == self._end:
            self._pwrite(_RESERVE, self._end)
            self._reserved = self._end + RESERVE_BYTES
        os.fdatasync(self._fd)
        _fsync_dir(self.path.parent)

    def close(self) -> None:
        """Close the file, its zeroed reserve cut off (a crash before that leaves zeros readers skip)."""
        if self._fd is not None:
            if self.writer is not None:
                self.writer.forget(self._fd)
            try:
                if self._reserved > self._end:
                    os.ftruncate(self._fd, self._end)
            finally:
                os.close(self._fd)
                self._fd = None
        self.forget()

    def forget(self) -> None:
        """Drop the delta cache (the next record is written in full); frees memory of idle sessions."""
        self._last_seq = self._last_text = self._last_messages = None
        self._last_count = 0

    def encode(self, record: CallRecord) -> tuple[bytes, bytes | None]:
        """The journal line for ``record`` and its prompt ids' text (None when it has no valid ids).

        A prompt that is not a non-empty list of non-negative integers < 2**32 is dropped from the record,
        which gets the ``bad_token_ids`` finding.
        """
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
        text = None
        if record.has_ids:
            text = record.prompt_text if record.prompt_text is not None else ids_text(record.prompt_token_ids)
            prompt = self._prompt_delta(text)
            if prompt is None:
                text, self._pending_count = None, 0
                record.prompt_token_ids = record.prompt_text = record.completion_token_ids = None
                record.logprobs = None
                record.finding = Finding("bad_token_ids", "prompt ids must be non-negative integers < 2**32")
                line["finding"] = record.finding.to_json()
            else:
                line["prompt_base"], line["prompt_ids"] = prompt
                self._pending_count = (prompt[0][1] if prompt[0] else 0) + len(prompt[1])
                line["completion_ids"] = record.completion_token_ids
                line["logprobs"] = record.logprobs
        return orjson.dumps(line) + b"\n", text

    def _prompt_delta(self, text: bytes) -> tuple[list[int] | None, list[int]] | None:
        """``(base, ids)``: the base reference and the ids to write; None if the ids are invalid.

        ``base`` is ``[seq, n]``: the prompt is the first ``n`` ids of record ``seq`` then ``ids``.
        """
        last, base = self._last_text, None
        if (
            last is not None
            and text.startswith(last)
            and (len(text) == len(last) or text[len(last)] == _COMMA)
        ):
            base, text = [self._last_seq, self._last_count], text[len(last) + 1 :]
        if b"e" in text:  # true/false parse as ints to array(); integers never hold an "e"
            return None
        try:
            ids = orjson.loads(b"[" + text + b"]")
            array("I", ids)  # non-negative ints below 2**32, in one C-level pass
        except (orjson.JSONDecodeError, TypeError, OverflowError):
            return None
        if base is None and not ids:
            return None
        return base, ids

    async def append(self, record: CallRecord, alone: bool = False) -> int:
        """Write ``record`` durably; returns the bytes written. The caller holds the session's lock.

        ``alone``: nothing else is in flight in the caller's event loop, so the line may be synced inline.
        """
        if self._fd is None:
            raise JournalError(f"journal {self.path} is not open")
        if record.seq != self.next_seq:
            raise JournalError(f"record seq {record.seq} != next seq {self.next_seq}")
        data, text = self.encode(record)
        self._write(data)
        if self.writer is not None:
            await self.writer.sync(self._fd, inline=alone)
        else:
            os.fdatasync(self._fd)
        self.next_seq += 1
        self.bytes_written += len(data)
        if text is not None:
            self._remember(record, text, self._pending_count)
        return len(data)

    def _write(self, data: bytes) -> None:
        """Write ``data`` over the reserve's zeros; a line that does not fit brings a new reserve."""
        offset = self._end
        self._end += len(data)
        if self._end > self._reserved:
            data += _RESERVE  # a copy once per reserve, not per line
            self._reserved = offset + len(data)
        self._pwrite(data, offset)

    def _pwrite(self, data: bytes, offset: int) -> None:
        assert self._fd is not None
        view = memoryview(data)
        while view:
            written = os.pwrite(self._fd, view, offset)
            view, offset = view[written:], offset + written

    def _remember(self, record: CallRecord, prompt_text: bytes, prompt_count: int) -> None:
        completion = record.completion_token_ids or []
        messages = record.upstream_request.get("messages")
        self._last_seq = record.seq
        self._last_text = prompt_text + (b"," + ids_text(completion) if completion else b"")
        self._last_count = prompt_count + len(completion)
        self._last_messages = messages if isinstance(messages, list) else None


def ids_text(ids: Any) -> bytes:
    """Token ids as compact JSON text without the brackets, the form the prefix test compares."""
    return orjson.dumps(ids)[1:-1]


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
    """Every record of a journal, expanded, in file order (up to a NUL: an open journal's reserve).

    ``repair`` truncates a torn last line and the reserve.
    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise JournalError(f"cannot read journal {path}: {exc}") from exc
    reserve = data.find(b"\0")
    end = data.rfind(b"\n", 0, len(data) if reserve < 0 else reserve) + 1
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
