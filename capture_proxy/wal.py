"""The shared write-ahead log: one fdatasync makes the lines of every session in flight durable.

Every journal line is written twice: into its session's ``calls.jsonl`` (the page cache only) and into
this log, ``DATA_DIR/wal/<generation>.log``, as ``<session id> <line>``. A reply waits for the log's
fdatasync alone, and the sync helper (:mod:`capture_proxy.writer`) syncs each file once for all the
requests waiting, so 64 agents in flight cost one fdatasync per batch instead of one per session. Each
fdatasync also costs the machine CPU outside the proxy (the kernel's and the virtual disk's): measured on
the proxy benchmark at 64 agents, per-session syncs held throughput at ~0.70 of the pass-through, the
shared log at ~0.85. A lone call still costs one sync.

**Checkpoints.** Once a generation holds ``limit_bytes``, new lines go to the next generation and the
journals written during the old one are fdatasync'd (through the helper, off the event loop); then the old
file is deleted. A journal that closes meanwhile syncs itself as it closes (one being deleted need not).
On a clean shutdown every journal closes durably and the log is deleted.

**Recovery** (:func:`replay`, before the sessions are loaded): the lines of each generation, in order, up
to the first torn or zeroed one. A session's ``calls.jsonl`` is cut back to its last complete line; the
log's lines past it are appended there, in ``seq`` order, and synced; then the logs are deleted. Lines of a
session whose journal no longer exists (deleted before the crash) are dropped. :func:`pending_lines` reads
the same without writing anything, for an offline export after a crash.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from capture_proxy.journal import CALLS, Journal, JournalError, complete_lines, fsync_dir
from capture_proxy.writer import JournalWriter, start_writeback
from capture_proxy.zeroed import ZeroedFile

log = logging.getLogger(__name__)

WAL = "wal"
SUFFIX = ".log"
LIMIT_BYTES = 64 * 1024 * 1024
RESERVE_BYTES = 1024 * 1024


@dataclass(eq=False)
class _Generation:
    number: int
    path: Path
    file: ZeroedFile
    journals: dict[int, Journal] = field(default_factory=dict)  # written during it, by id()
    syncing: int = 0  # fdatasyncs of this file in flight
    drained: asyncio.Event | None = None


class SharedLog:
    """The write-ahead log of one proxy's data dir. :meth:`open` after :func:`replay`."""

    def __init__(
        self,
        data_dir: Path,
        writer: JournalWriter | None = None,
        limit_bytes: int = LIMIT_BYTES,
        reserve_bytes: int = RESERVE_BYTES,
    ) -> None:
        self.directory = data_dir / WAL
        self.writer = writer
        self.limit_bytes = limit_bytes
        self.bytes_written = 0
        self._zeros = bytes(reserve_bytes)
        self._current: _Generation | None = None
        self._retired: list[_Generation] = []  # rotated out, their checkpoint not done
        self._checkpoints: set[asyncio.Task[None]] = set()
        self._rotate_at = limit_bytes
        self._keep_files = False  # a journal could not be made durable: the logs must outlive us

    def open(self) -> None:
        """Start a generation numbered past any log present (blocking: at start-up)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._current = self._new_generation(max(generations(self.directory), default=0) + 1)

    async def append(
        self,
        journal: Journal,
        line: bytes,
        quiet: bool = False,
        meanwhile: Callable[[], None] | None = None,
    ) -> None:
        """Write ``journal``'s new ``line`` and return once it is durable (raises the ``OSError``).

        ``meanwhile`` runs after the line is written and its write-out started, before the sync.
        """
        generation = self._current
        if generation is None:
            raise JournalError("the write-ahead log is not open")
        start = generation.file.end
        generation.file.write(journal.session_id.encode() + b" " + line)
        if quiet:  # under load, one write-out per helper batch costs less than one per line
            start_writeback(generation.file.fd, start, generation.file.end - start)
        generation.journals[id(journal)] = journal
        self.bytes_written += len(line)
        if generation.file.end >= self._rotate_at:
            self._rotate(generation)
        generation.syncing += 1
        try:
            if meanwhile is not None:
                meanwhile()
            if self.writer is not None:
                await self.writer.sync(generation.file.fd, inline=quiet)
            else:
                os.fdatasync(generation.file.fd)
        finally:
            generation.syncing -= 1
            if not generation.syncing and generation.drained is not None:
                generation.drained.set()

    def release(self, journal: Journal, durable: bool) -> None:
        """``journal`` closed; ``durable``: everything it holds is on stable storage (or unwanted)."""
        for generation in (self._current, *self._retired):
            if generation is not None:
                generation.journals.pop(id(journal), None)
        self._keep_files |= not durable

    async def stop_checkpoints(self) -> None:
        """Cancel the checkpoints under way (at shutdown, before the sync helper stops)."""
        for task in list(self._checkpoints):
            task.cancel()
        if self._checkpoints:
            await asyncio.wait(set(self._checkpoints))

    def close(self) -> None:
        """After every journal closed: delete the logs, unless a journal could not be made durable."""
        left = [g for g in (*self._retired, self._current) if g is not None]
        self._retired, self._current = [], None
        keep = self._keep_files or any(g.journals for g in left)
        for generation in left:
            self._close_file(generation)
            if not keep:
                generation.path.unlink(missing_ok=True)
        if left and not keep:
            fsync_dir(self.directory)

    def _new_generation(self, number: int) -> _Generation:
        path = self.directory / f"{number:08d}{SUFFIX}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            file = ZeroedFile(fd, self._zeros)
            file.reserve()
            os.fdatasync(fd)  # once per generation, so the lines' syncs flush only their data
            fsync_dir(self.directory)  # the new log's name must be durable before a line relies on it
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return _Generation(number, path, file)

    def _rotate(self, old: _Generation) -> None:
        try:
            self._current = self._new_generation(old.number + 1)
        except OSError as exc:
            log.warning("write-ahead log: cannot start generation %d (%s)", old.number + 1, exc)
            self._rotate_at = old.file.end + self.limit_bytes // 4
            return
        self._rotate_at = self.limit_bytes
        self._retired.append(old)
        task = asyncio.ensure_future(self._checkpoint(old))
        self._checkpoints.add(task)
        task.add_done_callback(self._checkpoints.discard)

    async def _checkpoint(self, old: _Generation) -> None:
        """Sync the journals ``old`` holds lines of, wait for its own syncs in flight, then delete it."""
        try:
            await asyncio.gather(*(journal.flush() for journal in list(old.journals.values())))
            old.drained = asyncio.Event()
            if not old.syncing:
                old.drained.set()
            await old.drained.wait()
        except OSError as exc:
            log.warning("write-ahead log: checkpoint of %s failed (%s); kept for replay", old.path, exc)
            self._keep_files = True
            return  # closed with the rest by close()
        self._retired.remove(old)
        self._close_file(old)
        if not self._keep_files:
            old.path.unlink(missing_ok=True)
            fsync_dir(self.directory)

    def _close_file(self, generation: _Generation) -> None:
        if self.writer is not None:
            self.writer.forget(generation.file.fd)
        os.close(generation.file.fd)


def generations(directory: Path) -> list[int]:
    """The generation numbers of the logs in ``directory``, in order."""
    if not directory.is_dir():
        return []
    numbers = [path.stem for path in directory.iterdir() if path.suffix == SUFFIX]
    return sorted(int(number) for number in numbers if number.isdigit())


def pending_lines(data_dir: Path) -> dict[str, dict[int, bytes]]:
    """Every log's complete lines: session id → seq → journal line (the latest log wins a repeated seq)."""
    directory = data_dir / WAL
    lines: dict[str, dict[int, bytes]] = {}
    for number in generations(directory):
        for entry in complete_lines(directory / f"{number:08d}{SUFFIX}").splitlines(keepends=True):
            session_id, _, line = entry.partition(b" ")
            try:
                seq = orjson.loads(line)["seq"]
            except (orjson.JSONDecodeError, KeyError, TypeError):
                break  # a torn line that happened to end in a newline: nothing after it was acknowledged
            lines.setdefault(session_id.decode("utf-8", "replace"), {})[seq] = line
    return lines


def missing_lines(journal_path: Path, logged: dict[int, bytes], repair: bool = False) -> list[bytes]:
    """The log's lines that ``journal_path`` lacks: those past its last complete line, in seq order."""
    data = complete_lines(journal_path, repair=repair)
    last = -1
    if data:
        try:
            last = orjson.loads(data[data.rfind(b"\n", 0, len(data) - 1) + 1 :])["seq"]
        except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
            raise JournalError(f"{journal_path}: the last line is not a record: {exc}") from exc
    missing = []
    for seq in sorted(s for s in logged if s > last):
        if seq != last + 1 + len(missing):
            raise JournalError(f"{journal_path}: the write-ahead log skips from seq {last} to {seq}")
        missing.append(logged[seq])
    return missing


def replay(data_dir: Path, sessions_root: Path) -> list[str]:
    """Put the logs' lines back into the journals that lack them, then delete the logs; returns problems.

    Blocking; run before the sessions are loaded. A log is kept when a journal could not be repaired.
    """
    directory = data_dir / WAL
    if not generations(directory):
        return []
    problems: list[str] = []
    sessions = {path.name: path for path in sessions_root.iterdir()} if sessions_root.is_dir() else {}
    for session_id, logged in pending_lines(data_dir).items():
        session_dir = sessions.get(session_id)
        path = session_dir / CALLS if session_dir is not None else None
        if path is None or not path.exists():
            continue  # deleted before the crash
        try:
            missing = missing_lines(path, logged, repair=True)
            if missing:
                with open(path, "ab") as handle:
                    handle.write(b"".join(missing))
                    handle.flush()
                    os.fdatasync(handle.fileno())
        except (OSError, JournalError) as exc:
            problems.append(f"{session_id}: write-ahead log not replayed: {exc}")
    if not problems:
        for number in generations(directory):
            (directory / f"{number:08d}{SUFFIX}").unlink()
        fsync_dir(directory)
    return problems
