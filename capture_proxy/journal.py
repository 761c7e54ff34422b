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

A journal on its own keeps a zeroed reserve past its last line (``RESERVE_BYTES``, see
:mod:`capture_proxy.zeroed`), and each line overwrites the zeros in place. A new session's reserve is
written when the session is created (:meth:`Journal.reserve`, off the event loop). Readers stop at the
first NUL; closing the journal cuts the reserve off, and a reload after a crash cuts it off with a torn
line. A journal beside the write-ahead log has no reserve: it is not synced line by line.

Durability: a journal on its own fdatasyncs its file before :meth:`Journal.append` returns. In the proxy
each journal has the shared write-ahead log (:mod:`capture_proxy.wal`): the line is also written there,
and the log's sync, one for every line in flight in all sessions, is the one the reply waits for; the
journal's own file is synced by the log's checkpoints and when it closes.

The prefix test runs on the ids' JSON text as the engine sent it (``CallRecord.prompt_text``), so the
hot path never turns thousands of prompt ids into Python ints: only the new suffix is parsed, which also
validates it (non-negative integers below 2**32); the prefix is text already validated in an earlier
record. A prompt that fails validation is not journaled as ids: the record gets the ``bad_token_ids``
finding instead.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from capture_proxy.records import CallRecord, Finding
from capture_proxy.writer import JournalWriter
from capture_proxy.zeroed import ZeroedFile

if TYPE_CHECKING:
    from capture_proxy.wal import SharedLog

FORMAT_VERSION = 1
_COMMA = ord(",")
SESSIONS = "sessions"  # DATA_DIR/sessions/<session id>/
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
    fsync_dir(directory)


def fsync_dir(directory: Path) -> None:
    """Make ``directory``'s entries (names created, renamed or removed in it) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Journal:
    """Appends the calls of one session. Callers serialise :meth:`append` (one writer per session)."""

    def __init__(
        self, directory: Path, writer: JournalWriter | None = None, wal: SharedLog | None = None
    ) -> None:
        self.path = directory / CALLS
        self.session_id = directory.name
        self.writer = writer
        self.wal = wal
        self.next_seq = 0
        self.bytes_written = 0
        # The last record with ids: its seq, prompt and completion ids as JSON text, their count, messages.
        self._last_seq: int | None = None
        self._last_prompt: bytes | None = None
        self._last_completion = b""
        self._last_count = 0
        self._last_messages: list[Any] | None = None
        self._pending_count = 0  # prompt length of the record being appended, known from its delta
        self._file: ZeroedFile | None = None
        self._unsynced = False  # lines made durable by the write-ahead log only, so far

    def open(self) -> None:
        """Open for appending, after cutting off a torn last line; resumes ``next_seq``."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        records = list(read_records(self.path, repair=True)) if self.path.exists() else []
        self.next_seq = records[-1].seq + 1 if records else 0
        for record in reversed(records):
            if record.has_ids and record.prompt_token_ids is not None:
                self._remember(record, ids_text(record.prompt_token_ids), len(record.prompt_token_ids))
                break
        # Beside a write-ahead log the journal is synced only at checkpoints: no reserve to keep.
        zeros = _RESERVE if self.wal is None else b""
        self._file = ZeroedFile(os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600), zeros)

    @property
    def is_open(self) -> bool:
        return self._file is not None

    def reserve(self) -> None:
        """Write the zeroed reserve and make it and the file's name durable now; blocking, so a new
        session calls it off the event loop, and its first lines' syncs then flush only their data.
        Beside a write-ahead log only the name is made durable (the log's lines are what is synced)."""
        if self._file is None:
            raise JournalError(f"journal {self.path} is not open")
        if self.wal is None:
            self._file.reserve()
            os.fdatasync(self._file.fd)
        fsync_dir(self.path.parent)

    async def flush(self) -> None:
        """fdatasync the file now (the write-ahead log's checkpoint); raises ``OSError`` if that fails."""
        if self._file is None:
            return
        if self.writer is not None:
            await self.writer.sync(self._file.fd)
        else:
            os.fdatasync(self._file.fd)

    def close(self, durable: bool = True) -> None:
        """Close the file, its zeroed reserve cut off (a crash before that leaves zeros readers skip).

        ``durable``: first sync lines that only the write-ahead log holds; ``False`` for a journal about to
        be deleted.
        """
        file, self._file = self._file, None
        if file is not None:
            kept = True
            if self.writer is not None:
                self.writer.forget(file.fd)
            try:
                file.cut()
                if durable and self._unsynced:
                    os.fdatasync(file.fd)
            except OSError:
                kept = False
                raise
            finally:
                os.close(file.fd)
                if self.wal is not None:
                    self.wal.release(self, kept or not durable)
        self.forget()

    def forget(self) -> None:
        """Drop the delta cache (the next record is written in full); frees memory of idle sessions."""
        self._last_seq = self._last_prompt = self._last_messages = None
        self._last_completion = b""
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
        base, end = None, self._prefix_end(text)
        if end is not None:
            base, text = [self._last_seq, self._last_count], text[end + 1 :]
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

    def _prefix_end(self, text: bytes) -> int | None:
        """Where the last record's prompt + completion ids end in ``text``, when they are its prefix
        (compared in place: the two are never joined into one copy)."""
        prompt, completion = self._last_prompt, self._last_completion
        if prompt is None or not text.startswith(prompt):
            return None
        end = len(prompt)
        if completion:
            if text[end : end + 1] != b"," or not text.startswith(completion, end + 1):
                return None
            end += 1 + len(completion)
        if len(text) != end and text[end] != _COMMA:
            return None
        return end

    async def append(
        self, record: CallRecord, quiet: bool = False, meanwhile: Callable[[], None] | None = None
    ) -> int:
        """Write ``record`` durably; returns the bytes written. The caller holds the session's lock.

        ``quiet``: little else is in flight in the caller's event loop, so the line may be synced inline.
        ``meanwhile``: work to do while the line is on its way to the disk (after its writes, before the
        sync), such as rendering the agent's reply.
        """
        file = self._file
        if file is None:
            raise JournalError(f"journal {self.path} is not open")
        if record.seq != self.next_seq:
            raise JournalError(f"record seq {record.seq} != next seq {self.next_seq}")
        data, text = self.encode(record)
        file.write(data)
        if self.wal is not None:
            self._unsynced = True
            await self.wal.append(self, data, quiet=quiet, meanwhile=meanwhile)
        else:
            if meanwhile is not None:
                meanwhile()
            if self.writer is not None:
                await self.writer.sync(file.fd, inline=quiet)
            else:
                os.fdatasync(file.fd)
        self.next_seq += 1
        self.bytes_written += len(data)
        if text is not None:
            self._remember(record, text, self._pending_count)
        return len(data)

    def _remember(self, record: CallRecord, prompt_text: bytes, prompt_count: int) -> None:
        completion = record.completion_token_ids or []
        messages = record.upstream_request.get("messages")
        self._last_seq = record.seq
        self._last_prompt = prompt_text
        self._last_completion = ids_text(completion) if completion else b""
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
        "dispatch_version": record.dispatch_version,
        "engine": record.engine,
        "finding": record.finding.to_json() if record.finding else None,
        "timings": record.timings,
    }


def read_records(path: Path, repair: bool = False) -> Iterator[CallRecord]:
    """Every record of a journal, expanded, in file order (up to a NUL: an open journal's reserve).

    ``repair`` truncates a torn last line and the reserve.
    """
    return parse_records(complete_lines(path, repair), str(path))


def parse_records(lines: bytes, where: str) -> Iterator[CallRecord]:
    """The records of complete journal ``lines``, expanded; ``where`` names them in errors."""
    expander = _Expander()
    for number, line in enumerate(lines.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            raw = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise JournalError(f"{where}:{number}: not JSON: {exc}") from exc
        yield expander.expand(raw, f"{where}:{number}")


def complete_lines(path: Path, repair: bool = False) -> bytes:
    """The file's complete lines: up to the last newline before the first NUL (an open journal's reserve).

    ``repair`` truncates the file there, cutting off a torn last line and the reserve.
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
    return data[:end]


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
                dispatch_version=raw.get("dispatch_version"),  # absent from journals written before it
                engine=raw.get("engine"),  # likewise
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
