"""The journal: delta-encoded lines that expand back exactly, torn tails, and reload after a restart."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from capture_proxy.journal import RESERVE_BYTES, Journal, read_records
from capture_proxy.records import MODEL, CallRecord
from harness_trainer.trace import TrainingTrace
from tests.proxy.conftest import Stack


def record(seq: int, prompt: list[int], completion: list[int], messages: list[Any]) -> CallRecord:
    return CallRecord(
        seq=seq,
        call_id=f"call-{seq:05d}",
        kind=MODEL,
        dialect="chat",
        has_tools=True,
        started_at=1.0,
        finished_at=2.0,
        upstream_request={"messages": messages, "temperature": 1.0},
        agent_params={},
        sampling={"temperature": 1.0},
        response={"id": str(seq)},
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        logprobs=[-0.5] * len(completion),
    )


def grow(turns: int, width: int = 400) -> list[CallRecord]:
    """An append-only conversation: each prompt extends the previous prompt + completion."""
    records, prompt, messages = [], list(range(1, 2000)), [{"role": "system", "content": "s" * 8000}]
    for seq in range(turns):
        completion = [seq % 50 + 7] * 200
        records.append(record(seq, list(prompt), completion, list(messages)))
        prompt += completion + list(range(width))
        messages += [{"role": "assistant", "content": f"a{seq}"}, {"role": "tool", "content": "x" * width}]
    return records


def write(directory: Path, records: list[CallRecord], reserve: bool = False) -> Journal:
    journal = Journal(directory)
    journal.open()
    if reserve:
        journal.reserve()

    async def append_all() -> None:
        for r in records:
            await journal.append(r)

    asyncio.run(append_all())
    return journal


def test_append_only_history_is_written_as_deltas_and_expands_back_exactly(tmp_path: Path) -> None:
    records = grow(20)
    journal = write(tmp_path, records)
    journal.close()
    back = list(read_records(journal.path))
    assert [r.prompt_token_ids for r in back] == [r.prompt_token_ids for r in records]
    assert [r.upstream_request for r in back] == [r.upstream_request for r in records]
    assert [r.logprobs for r in back] == [r.logprobs for r in records]
    full = sum(len(r.prompt_token_ids or []) for r in records)
    written = journal.path.stat().st_size
    # Each line holds only the new ids and messages: far less than every full prompt spelled out.
    assert written < full * 2, (written, full)


def test_dispatch_and_weight_versions_round_trip_and_an_older_journal_reads_without_dispatch(
    tmp_path: Path,
) -> None:
    import json

    first, second = grow(2)
    first.dispatch_version, first.weight_version = 3, 4
    journal = write(tmp_path, [first, second])
    journal.close()
    back = list(read_records(journal.path))
    assert [(r.dispatch_version, r.weight_version) for r in back] == [(3, 4), (None, None)]

    lines = journal.path.read_text().splitlines()
    older = [json.loads(line) for line in lines]
    for line in older:
        del line["dispatch_version"]  # as written before the field existed
    journal.path.write_text("".join(json.dumps(line) + "\n" for line in older))
    versions = [(r.dispatch_version, r.weight_version) for r in read_records(journal.path)]
    assert versions == [(None, 4), (None, None)]


def test_journal_size_grows_linearly_with_calls(tmp_path: Path) -> None:
    small = write(tmp_path / "a", grow(50))
    large = write(tmp_path / "b", grow(200))
    small.close()
    large.close()
    per_call_small = small.path.stat().st_size / 50
    per_call_large = large.path.stat().st_size / 200
    assert per_call_large < per_call_small * 1.5


def test_a_rewritten_history_is_written_in_full(tmp_path: Path) -> None:
    records = grow(3)
    records.append(record(3, [9, 9, 9], [1], [{"role": "user", "content": "new"}]))
    journal = write(tmp_path, records)
    back = list(read_records(journal.path))
    assert (
        back[3].prompt_token_ids == [9, 9, 9] and back[3].upstream_request["messages"][0]["content"] == "new"
    )


def test_a_torn_last_line_is_ignored_and_cut_before_the_next_append(tmp_path: Path) -> None:
    journal = write(tmp_path, grow(3))
    journal.close()
    with open(journal.path, "ab") as handle:
        handle.write(b'{"v": 1, "seq": 3, "call_id": "call-0')
    assert len(list(read_records(journal.path))) == 3
    reopened = Journal(tmp_path)
    reopened.open()
    assert reopened.next_seq == 3
    asyncio.run(reopened.append(record(3, [1, 2], [3], [])))
    assert [r.seq for r in read_records(journal.path)] == [0, 1, 2, 3]


def test_a_reopened_journal_keeps_delta_encoding_from_its_last_record(tmp_path: Path) -> None:
    records = grow(4)
    journal = write(tmp_path, records[:2])
    journal.close()
    reopened = write(tmp_path, [])
    asyncio.run(reopened.append(records[2]))
    asyncio.run(reopened.append(records[3]))
    back = list(read_records(journal.path))
    assert [r.prompt_token_ids for r in back] == [r.prompt_token_ids for r in records]


def test_lines_overwrite_the_zeroed_reserve_and_closing_cuts_it_off(tmp_path: Path) -> None:
    records = grow(3)
    journal = write(tmp_path, [], reserve=True)
    assert journal.path.read_bytes() == bytes(RESERVE_BYTES)
    asyncio.run(journal.append(records[0]))
    asyncio.run(journal.append(records[1]))
    # The lines went over the zeros: the file kept its size, so a sync had no size to commit.
    assert journal.path.stat().st_size == RESERVE_BYTES
    assert [r.seq for r in read_records(journal.path)] == [0, 1]  # readable while open
    asyncio.run(journal.append(records[2]))
    journal.close()
    data = journal.path.read_bytes()
    assert b"\0" not in data and data.endswith(b"\n") and data.count(b"\n") == 3
    assert [r.prompt_token_ids for r in read_records(journal.path)] == [r.prompt_token_ids for r in records]


def test_a_line_that_outgrows_the_reserve_brings_the_next_one(tmp_path: Path) -> None:
    records = grow(60, width=2000)
    journal = write(tmp_path, records, reserve=True)
    lines = journal.bytes_written
    assert lines > 2 * RESERVE_BYTES
    assert lines < journal.path.stat().st_size <= lines + RESERVE_BYTES
    assert [r.prompt_token_ids for r in read_records(journal.path)] == [r.prompt_token_ids for r in records]
    journal.close()
    assert journal.path.stat().st_size == lines


def test_a_crash_inside_the_reserve_loses_only_the_torn_line(tmp_path: Path) -> None:
    journal = write(tmp_path, grow(3), reserve=True)
    end = journal.bytes_written
    # A crash mid-line, with part of the line persisted past a block still zero: torn, then stray bytes.
    with open(journal.path, "r+b") as handle:
        handle.seek(end)
        handle.write(b'{"v": 1, "seq": 3, "call_id": "call-0')
        handle.seek(end + 8192)
        handle.write(b'_id": "call-00003"}\n')
    assert [r.seq for r in read_records(journal.path)] == [0, 1, 2]
    reopened = Journal(tmp_path)
    reopened.open()
    assert reopened.next_seq == 3 and journal.path.stat().st_size == end
    asyncio.run(reopened.append(record(3, [1, 2], [3], [])))
    reopened.close()
    assert [r.seq for r in read_records(journal.path)] == [0, 1, 2, 3]
    assert b"\0" not in journal.path.read_bytes()


def test_sessions_and_their_traces_survive_a_proxy_restart(stack: Stack) -> None:
    session = stack.new_session(sampling={"temperature": 0.5}, max_model_calls=3, metadata={"task": "t1"})
    headers = {"Authorization": f"Bearer {session['session_id']}"}
    messages = [{"role": "user", "content": "SAY:one"}]
    reply = httpx.post(
        session["base_url"] + "/chat/completions", headers=headers, json={"messages": messages}
    )
    before = stack.trace(session["session_id"])
    stack.stop_proxy()
    stack.start_proxy()
    assert stack.trace(session["session_id"]) == before
    summary = stack.admin.get(f"/sessions/{session['session_id']}").json()
    assert summary["metadata"] == {"task": "t1"} and summary["model_calls"] == 1
    messages += [reply.json()["choices"][0]["message"], {"role": "user", "content": "SAY:two"}]
    again = httpx.post(stack.url + "/v1/chat/completions", headers=headers, json={"messages": messages})
    assert again.status_code == 200
    trace = TrainingTrace.model_validate(stack.trace(session["session_id"]))
    assert [t.metadata["parent"] for t in trace.turns] == [None, "call-00000"]
    assert stack.engine.requests[-1]["temperature"] == 0.5
