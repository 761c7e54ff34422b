"""Capture sessions: minted by the admin, keyed by an unguessable id, reloaded from disk on start.

A session id is ``cs_`` + 32 random bytes, URL-safe (256 bits, ``secrets.token_urlsafe``); the prefix
keeps an id from ever starting with ``-`` (a command line would read it as a flag). The id is also the
agent's API key, so it is the only credential a sandbox ever holds. The budget (``max_model_calls``) is
reserved before a call is forwarded and given back if the engine fails, so concurrent calls of one session
never exceed it. Everything a session has captured is in its journal; in memory it keeps only counters
and the journal's one-record delta cache.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import shutil
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, field_validator

from capture_proxy.journal import SESSION, SESSIONS, Journal, JournalError, read_records, write_session_file
from capture_proxy.records import MODEL, CallRecord, Finding
from capture_proxy.sampling import SamplingPolicy
from capture_proxy.wal import SharedLog
from capture_proxy.writer import JournalWriter

log = logging.getLogger(__name__)

_MAX_FINDINGS = 50
SESSION_ID_PREFIX = "cs_"


class SessionSpec(BaseModel):
    """The body of ``POST /sessions`` (every field optional)."""

    model_config = ConfigDict(extra="forbid")

    sampling: SamplingPolicy = Field(default_factory=SamplingPolicy)
    """The sampling policy that overrides what the agent asks for."""
    max_model_calls: int | None = Field(default=None, ge=1)
    """Model calls forwarded before the agent gets a terminal "step budget exhausted" reply."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """Free-form, returned by ``GET /sessions/{id}`` (e.g. task and episode ids)."""
    upstream: str | None = None
    """The engine this session's calls go to: the proxy's ``upstream`` (the default) or one of its
    ``allowed_upstreams``; any other is refused when the session is minted."""
    model: str | None = Field(default=None, min_length=1)
    """The served model name at that engine; default: the proxy's ``served_model`` for its own upstream,
    else the engine's first ``/v1/models`` entry. ``PUT /policy`` overrides it, as it does the default."""
    engine_headers: dict[str, str] = Field(default_factory=dict)
    """Headers sent to the engine with each of this session's calls (a token-gated engine's credential).
    Kept in the session file, so a restarted proxy can still call the engine, and never returned by the
    admin API."""

    @field_validator("engine_headers")
    @classmethod
    def _header_lines(cls, headers: dict[str, str]) -> dict[str, str]:
        for name, value in headers.items():
            if not name or not all(c.isalnum() or c in "-_" for c in name):
                raise ValueError(f"engine header name {name!r} is not a header token")
            if any(c in value for c in "\r\n\0"):
                raise ValueError(f"engine header {name} holds a line break")
        return headers


class Policy(BaseModel):
    """The body of ``PUT /policy``: the served model every call is forwarded to from now on, and the policy
    version it holds. Each call records the version current when it was sent (``dispatch_version``) and,
    unless the engine's reply names its own, the one current when its reply came back (``weight_version``).
    A trainer sets it after each push: with ``model``, to publish each version under its own name (a LoRA
    adapter per version); without (null), to stamp the version only, calls keeping their model (full or
    merged weights pushed in place)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(default=None, min_length=1)
    version: int = Field(ge=0)


@dataclass
class Session:
    id: str
    spec: SessionSpec
    created_at: float
    directory: Path
    journal: Journal
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    reserved: int = 0  # model calls forwarded or in flight; what the budget counts
    model_calls: int = 0
    records: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    findings: list[dict[str, Any]] = field(default_factory=list)
    calls_without_ids: int = 0
    closed: bool = False
    last_call_at: float | None = None
    sampling_json: dict[str, Any] = field(default_factory=dict)  # the policy as journaled, dumped once

    def __post_init__(self) -> None:
        self.sampling_json = self.spec.sampling.model_dump()

    def reserve(self) -> bool:
        """Take one model call from the budget; False once it is spent. Atomic on the event loop."""
        limit = self.spec.max_model_calls
        if limit is not None and self.reserved >= limit:
            return False
        self.reserved += 1
        return True

    def release(self) -> None:
        """Give back a reservation whose call never reached the engine's sampling."""
        self.reserved = max(0, self.reserved - 1)

    def note(self, record: CallRecord) -> None:
        """Update the counters for a journaled record."""
        self.records += 1
        self.last_call_at = record.finished_at
        if record.kind == MODEL:
            self.model_calls += 1
            if not record.has_ids:
                self.calls_without_ids += 1
        else:
            self.errors[record.kind] = self.errors.get(record.kind, 0) + 1
        if record.finding is not None and len(self.findings) < _MAX_FINDINGS:
            self.findings.append({"call_id": record.call_id, **record.finding.to_json()})

    def add_finding(self, finding: Finding) -> None:
        if len(self.findings) < _MAX_FINDINGS:
            self.findings.append(finding.to_json())

    def status(self) -> str:
        if self.closed:
            return "deleted"
        limit = self.spec.max_model_calls
        if limit is not None and self.reserved >= limit:
            return "budget_exhausted"
        return "active"

    def summary(self, base_url: str) -> dict[str, Any]:
        return {
            "session_id": self.id,
            "base_url": base_url,
            "status": self.status(),
            "created_at": self.created_at,
            "model_calls": self.model_calls,
            "max_model_calls": self.spec.max_model_calls,
            "records": self.records,
            "errors": dict(self.errors),
            "findings": list(self.findings),
            "trainable": self.model_calls > self.calls_without_ids,
            "sampling": self.spec.sampling.model_dump(),
            "metadata": self.spec.metadata,
            "upstream": self.spec.upstream,
            "model": self.spec.model,
            "journal_bytes": self.journal.bytes_written,
        }


class SessionStore:
    """Every session of one data dir."""

    def __init__(
        self,
        data_dir: Path,
        executor: Executor | None = None,
        writer: JournalWriter | None = None,
        wal: SharedLog | None = None,
    ) -> None:
        self.root = data_dir / SESSIONS
        self.executor = executor
        self.writer = writer
        self.wal = wal
        self.sessions: dict[str, Session] = {}

    def create(self, spec: SessionSpec) -> Session:
        """A new session, its files written and synced (blocking: callers run it off the event loop)."""
        session_id = SESSION_ID_PREFIX + secrets.token_urlsafe(32)
        directory = self.root / session_id
        created = time.time()
        meta = {"session_id": session_id, "created_at": created, **spec.model_dump(mode="json")}
        write_session_file(directory, meta)
        return self._add(session_id, spec, created, directory, reserve=True)

    def _add(
        self, session_id: str, spec: SessionSpec, created: float, directory: Path, reserve: bool = False
    ) -> Session:
        journal = Journal(directory, self.writer, self.wal)
        journal.open()
        if reserve:
            try:
                journal.reserve()
            except BaseException:
                journal.close()
                raise
        session = Session(session_id, spec, created, directory, journal)
        self.sessions[session_id] = session
        return session

    def load_all(self) -> list[str]:
        """Reload every session under the data dir; returns problems found (sessions skipped)."""
        problems: list[str] = []
        if not self.root.exists():
            return problems
        for directory in sorted(p for p in self.root.iterdir() if p.is_dir()):
            try:
                meta = orjson.loads((directory / SESSION).read_bytes())
                spec = SessionSpec(
                    sampling=meta["sampling"],
                    max_model_calls=meta.get("max_model_calls"),
                    metadata=meta.get("metadata") or {},
                    upstream=meta.get("upstream"),
                    model=meta.get("model"),
                    engine_headers=meta.get("engine_headers") or {},
                )
                session = self._add(meta["session_id"], spec, meta["created_at"], directory)
                for record in read_records(session.journal.path):
                    session.note(record)
                    session.reserved += record.kind == MODEL
            except (OSError, ValueError, KeyError, JournalError) as exc:
                problems.append(f"{directory.name}: {exc}")
        return problems

    def get(self, session_id: str) -> Session | None:
        session = self.sessions.get(session_id)
        return None if session is None or session.closed else session

    async def delete(self, session: Session) -> None:
        """Forget the session and remove its files, after any journal write in progress."""
        session.closed = True
        self.sessions.pop(session.id, None)
        async with session.lock:
            session.journal.close(durable=False)
        await asyncio.get_running_loop().run_in_executor(
            self.executor, lambda: shutil.rmtree(session.directory, ignore_errors=True)
        )

    def close(self) -> None:
        """Close every journal durably; one that cannot be synced is logged (the write-ahead log keeps it)."""
        for session in self.sessions.values():
            try:
                session.journal.close()
            except OSError as exc:
                log.warning("session %s: journal not closed cleanly: %s", session.id, exc)

    def records(self, session: Session) -> list[CallRecord]:
        return list(read_records(session.journal.path)) if session.journal.path.exists() else []
