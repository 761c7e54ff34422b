"""Offline export: a session's TrainingTrace straight from its journal, with no proxy running.

Works after a crash: the journal is the source of truth, and a torn last line is ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from capture_proxy.assembly import assemble_trace
from capture_proxy.journal import CALLS, read_records


def trace_from_journal(path: str | Path) -> dict[str, Any]:
    """The TrainingTrace dict of a session directory (or its ``calls.jsonl``).

    Raises :class:`capture_proxy.assembly.UntrainableSession` when nothing is trainable and
    :class:`capture_proxy.journal.JournalError` when the journal cannot be read.
    """
    path = Path(path)
    journal = path / CALLS if path.is_dir() else path
    return assemble_trace(read_records(journal))
