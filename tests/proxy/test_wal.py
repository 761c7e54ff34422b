"""The shared write-ahead log: lines reach it before an append returns, a crash that loses journal pages is
repaired from it, checkpoints sync the journals before a generation is deleted, and nothing is replayed
twice or into a deleted session."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from capture_proxy import wal as wal_module
from capture_proxy.export import trace_from_journal
from capture_proxy.journal import CALLS, SESSIONS, Journal, read_records
from capture_proxy.records import CallRecord
from capture_proxy.wal import WAL, SharedLog, generations, pending_lines, replay
from tests.proxy.test_journal import grow


def logs(data_dir: Path) -> list[Path]:
    return sorted((data_dir / WAL).glob("*.log"))


async def run_session(
    data_dir: Path, sessions: dict[str, list[CallRecord]], limit_bytes: int = 64 << 20, close: bool = False
) -> SharedLog:
    """Append each session's records through one log (interleaved), as the proxy does; no clean shutdown
    unless ``close``."""
    log = SharedLog(data_dir, limit_bytes=limit_bytes, reserve_bytes=4096)
    log.open()
    journals = {}
    for name in sessions:
        journals[name] = Journal(data_dir / SESSIONS / name, wal=log)
        journals[name].open()
    for index in range(max(len(records) for records in sessions.values())):
        for name, records in sessions.items():
            if index < len(records):
                await journals[name].append(records[index])
    if close:
        await log.stop_checkpoints()
        for journal in journals.values():
            journal.close()
        log.close()
    else:
        await asyncio.gather(*log._checkpoints)
    return log


def lose_lines_after(path: Path, keep: int) -> bytes:
    """Zero the file past its first ``keep`` lines, as pages never written back would read after a
    machine crash; returns the file's lines as they were."""
    data = path.read_bytes()
    end = 0
    for _ in range(keep):
        end = data.index(b"\n", end) + 1
    with open(path, "r+b") as handle:
        handle.seek(end)
        handle.write(bytes(len(data) - end))
    return data


def test_each_line_is_in_the_log_and_a_clean_close_deletes_it(tmp_path: Path) -> None:
    records = grow(3)
    log = asyncio.run(run_session(tmp_path, {"cs_a": records}))
    journal = tmp_path / SESSIONS / "cs_a" / CALLS
    lines = journal.read_bytes().split(b"\0")[0].splitlines(keepends=True)
    assert pending_lines(tmp_path) == {"cs_a": {seq: line for seq, line in enumerate(lines)}}
    assert log.bytes_written == sum(map(len, lines))
    assert len(logs(tmp_path)) == 1

    asyncio.run(run_session(tmp_path, {"cs_b": grow(1)}, close=True))
    assert len(logs(tmp_path)) == 1  # its own generation (2) is gone; the crashed one (1) waits for replay
    assert generations(tmp_path / WAL) == [1]


def test_replay_restores_what_a_crash_lost_and_deletes_the_logs(tmp_path: Path) -> None:
    asyncio.run(run_session(tmp_path, {"cs_a": grow(5), "cs_b": grow(3)}))
    a, b = (tmp_path / SESSIONS / name / CALLS for name in ("cs_a", "cs_b"))
    before_a, before_b = lose_lines_after(a, 2), lose_lines_after(b, 0)
    assert len(list(read_records(a))) == 2 and list(read_records(b)) == []

    assert replay(tmp_path, tmp_path / SESSIONS) == []
    assert a.read_bytes() == before_a.split(b"\0")[0]
    assert b.read_bytes() == before_b.split(b"\0")[0]
    assert [r.prompt_token_ids for r in read_records(a)] == [r.prompt_token_ids for r in grow(5)]
    assert logs(tmp_path) == []
    assert replay(tmp_path, tmp_path / SESSIONS) == []  # nothing left to do


def test_replay_skips_deleted_sessions_and_a_torn_log_tail_and_never_duplicates(tmp_path: Path) -> None:
    asyncio.run(run_session(tmp_path, {"cs_a": grow(4), "cs_gone": grow(2)}))
    (tmp_path / SESSIONS / "cs_gone" / CALLS).unlink()
    (tmp_path / SESSIONS / "cs_gone").rmdir()
    journal = tmp_path / SESSIONS / "cs_a" / CALLS
    log_path = logs(tmp_path)[0]
    data = log_path.read_bytes()
    last = data.split(b"\0")[0].rstrip(b"\n").rfind(b"\n") + 1  # the start of the last line (cs_a, seq 3)
    with open(log_path, "r+b") as handle:  # that line torn: its agent never got a reply
        handle.seek(last + 40)
        handle.write(bytes(len(data) - last - 40))
    lose_lines_after(journal, 1)
    saved = log_path.read_bytes()

    assert replay(tmp_path, tmp_path / SESSIONS) == []
    assert [r.seq for r in read_records(journal)] == [0, 1, 2]
    log_path.write_bytes(saved)  # as if the proxy died again before deleting the log
    assert replay(tmp_path, tmp_path / SESSIONS) == []
    assert [r.seq for r in read_records(journal)] == [0, 1, 2]


def test_a_gap_in_the_log_is_reported_and_the_log_kept(tmp_path: Path) -> None:
    asyncio.run(run_session(tmp_path, {"cs_a": grow(3)}))
    journal = tmp_path / SESSIONS / "cs_a" / CALLS
    log_path = logs(tmp_path)[0]
    kept = b"".join(
        line for line in log_path.read_bytes().split(b"\0")[0].splitlines(True) if b'"seq":1,' not in line
    )
    log_path.write_bytes(kept)
    lose_lines_after(journal, 0)

    problems = replay(tmp_path, tmp_path / SESSIONS)
    assert len(problems) == 1 and "skips from seq -1 to 2" in problems[0]
    assert logs(tmp_path) == [log_path]


def test_a_full_generation_is_checkpointed_then_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[int] = []
    real = os.fdatasync

    def fdatasync(fd: int) -> None:
        synced.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    asyncio.run(run_session(tmp_path, {"cs_a": grow(6), "cs_b": grow(6)}, limit_bytes=40_000))
    assert generations(tmp_path / WAL)[0] > 1  # rotated, and the old generations are gone
    assert len(logs(tmp_path)) == 1
    for name in ("cs_a", "cs_b"):  # what the deleted logs held is in the journals
        assert [r.seq for r in read_records(tmp_path / SESSIONS / name / CALLS)] == list(range(6))
    journal_syncs = len(synced) - 12  # one sync of the log per line
    assert journal_syncs >= 2


def test_a_failed_checkpoint_keeps_the_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def fail(self: Journal) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(Journal, "flush", fail)
    asyncio.run(run_session(tmp_path, {"cs_a": grow(4)}, limit_bytes=20_000))
    assert generations(tmp_path / WAL)[0] == 1  # nothing was deleted
    assert sum(map(len, pending_lines(tmp_path)["cs_a"].values())) > 0


def test_offline_export_reads_what_only_the_log_holds(tmp_path: Path) -> None:
    asyncio.run(run_session(tmp_path, {"cs_a": grow(4)}))
    session = tmp_path / SESSIONS / "cs_a"
    whole = trace_from_journal(session)
    lose_lines_after(session / CALLS, 1)
    assert trace_from_journal(session) == whole
    assert len(list(read_records(session / CALLS))) == 1  # and nothing was written


def test_the_proxy_state_replays_at_start(tmp_path: Path) -> None:
    from capture_proxy.config import ProxyConfig
    from capture_proxy.state import ProxyState

    asyncio.run(run_session(tmp_path, {"cs_a": grow(3)}))
    (tmp_path / SESSIONS / "cs_a" / "session.json").write_bytes(
        b'{"v":1,"session_id":"cs_a","created_at":1.0,"sampling":{"temperature":1.0},"max_model_calls":null}'
    )
    lose_lines_after(tmp_path / SESSIONS / "cs_a" / CALLS, 0)

    async def start_and_stop() -> int:
        state = ProxyState(ProxyConfig(upstream="http://127.0.0.1:9", data_dir=tmp_path, admin_key="k" * 32))
        await state.start()
        try:
            assert state.load_problems == []
            return state.store.sessions["cs_a"].journal.next_seq
        finally:
            await state.stop()

    assert asyncio.run(start_and_stop()) == 3
    assert logs(tmp_path) == []  # replayed, then its own generation deleted on the clean stop
    assert wal_module.pending_lines(tmp_path) == {}


@pytest.mark.parametrize("with_log", [True, False])
def test_work_meanwhile_runs_after_the_lines_are_written_and_before_the_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, with_log: bool
) -> None:
    events: list[str] = []
    real_fdatasync = os.fdatasync

    def fdatasync(fd: int) -> None:
        events.append("sync")
        real_fdatasync(fd)

    async def main() -> None:
        log = SharedLog(tmp_path, reserve_bytes=4096) if with_log else None
        if log is not None:
            log.open()
        journal = Journal(tmp_path / SESSIONS / "cs_a", wal=log)
        journal.open()
        monkeypatch.setattr(os, "fdatasync", fdatasync)

        def meanwhile() -> None:
            calls = (tmp_path / SESSIONS / "cs_a" / CALLS).read_bytes()
            assert calls.split(b"\0")[0].count(b"\n") == 1
            if log is not None:
                assert list(pending_lines(tmp_path)["cs_a"]) == [0]
            events.append("meanwhile")

        await journal.append(grow(1)[0], meanwhile=meanwhile)
        assert events == ["meanwhile", "sync"]
        journal.close()
        if log is not None:
            log.close()

    asyncio.run(main())
