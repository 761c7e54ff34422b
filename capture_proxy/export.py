"""Offline export: a session's TrainingTrace straight from its journal, with no proxy running.

Works after a crash, even of the machine: a torn last line is ignored, and lines that only reached the
data dir's write-ahead log (:mod:`capture_proxy.wal`) are read from there. Nothing is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from capture_proxy.assembly import assemble_trace
from capture_proxy.journal import CALLS, SESSIONS, complete_lines, parse_records
from capture_proxy.wal import missing_lines, pending_lines


def trace_from_journal(path: str | Path) -> dict[str, Any]:
    """The TrainingTrace dict of a session directory (or its ``calls.jsonl``).

    Raises :class:`capture_proxy.assembly.UntrainableSession` when nothing is trainable and
    :class:`capture_proxy.journal.JournalError` when the journal cannot be read.
    """
    path = Path(path)
    journal = path / CALLS if path.is_dir() else path
    lines = complete_lines(journal)
    session_dir = journal.parent
    if session_dir.parent.name == SESSIONS:
        logged = pending_lines(session_dir.parent.parent).get(session_dir.name, {})
        lines += b"".join(missing_lines(journal, logged))
    return assemble_trace(parse_records(lines, str(journal)))
