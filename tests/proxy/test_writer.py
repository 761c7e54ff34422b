"""The journal writer and its fdatasync helper process: lines land, are synced before the writer returns,
and nothing waits forever or is left running, whatever happens to the helper."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from capture_proxy import syncer
from capture_proxy.writer import JournalWriter, start_writeback

ROOT = Path(__file__).resolve().parents[2]


def open_files(tmp_path: Path, count: int) -> list[int]:
    return [os.open(tmp_path / f"f{i}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600) for i in range(count)]


async def append(writer: JournalWriter, fd: int, data: bytes, inline: bool = False) -> None:
    """What the journal does: write the line, then have it synced."""
    os.write(fd, data)
    await writer.sync(fd, inline=inline)


def helper_files(pid: int) -> set[str]:
    """The paths of the regular files the helper holds open."""
    found = set()
    for entry in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(entry)
        except OSError:
            continue
        if target.startswith("/"):
            found.add(target)
    return found


def gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.02)
    return False


def test_concurrent_lines_land_in_order_and_the_helper_holds_only_open_files(tmp_path: Path) -> None:
    async def main() -> None:
        writer = JournalWriter()
        fds = open_files(tmp_path, 4)
        try:
            await asyncio.gather(*(append(writer, fd, b"line %d\n" % i) for i in range(5) for fd in fds))
            pid = writer.helper_pid
            assert pid is not None
            held = helper_files(pid)
            assert {str(tmp_path / f"f{i}") for i in range(4)} <= held
            writer.forget(fds[0])
            os.close(fds[0])
            # A new file may get the closed descriptor's number: the helper must sync the new file.
            reused = os.open(tmp_path / "g", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            fds[0] = reused
            await asyncio.gather(*(append(writer, fd, b"more\n") for fd in fds))
            # The close goes to the helper after the syncs of that flush, so it may land just after their
            # answers: give it a moment rather than read /proc at once.
            deadline = time.monotonic() + 10
            while str(tmp_path / "f0") in (held := helper_files(pid)) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert str(tmp_path / "f0") not in held and str(tmp_path / "g") in held
        finally:
            writer.close()
            for fd in fds:
                os.close(fd)
        assert gone(pid)

    asyncio.run(main())
    expected = "".join(f"line {i}\n" for i in range(5))
    assert (tmp_path / "f0").read_text() == expected
    assert (tmp_path / "f1").read_text() == expected + "more\n"
    assert (tmp_path / "g").read_text() == "more\n"


def test_a_lone_write_is_synced_on_the_loop_without_starting_a_helper(tmp_path: Path) -> None:
    async def main() -> int | None:
        writer = JournalWriter()
        (fd,) = open_files(tmp_path, 1)
        try:
            await append(writer, fd, b"alone\n", inline=True)
            return writer.helper_pid
        finally:
            writer.close()
            os.close(fd)

    assert asyncio.run(main()) is None
    assert (tmp_path / "f0").read_text() == "alone\n"


def test_a_killed_helper_leaves_nothing_waiting_and_is_replaced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("capture_proxy.writer.RESPAWN_DELAY_S", 0.2)

    async def main() -> tuple[int, int]:
        writer = JournalWriter()
        fds = open_files(tmp_path, 2)
        try:
            await asyncio.gather(*(append(writer, fd, b"a\n") for fd in fds))
            first = writer.helper_pid
            assert first is not None
            os.kill(first, signal.SIGSTOP)  # it takes requests but cannot answer them
            pending = [asyncio.ensure_future(append(writer, fd, b"b\n")) for fd in fds]
            await asyncio.sleep(0.1)
            assert not any(task.done() for task in pending)
            os.kill(first, signal.SIGKILL)
            await asyncio.wait_for(asyncio.gather(*pending), 10)  # synced on the loop instead
            assert gone(first)
            await asyncio.gather(*(append(writer, fd, b"c\n") for fd in fds))  # on the loop, for now
            await asyncio.sleep(0.3)
            await asyncio.gather(*(append(writer, fd, b"d\n") for fd in fds))
            second = writer.helper_pid
            assert second is not None and second != first
            return first, second
        finally:
            writer.close()
            for fd in fds:
                os.close(fd)

    with caplog.at_level("WARNING", logger="capture_proxy.writer"):
        _, second = asyncio.run(main())
    assert "journal sync helper lost" in caplog.text
    assert gone(second)
    assert (tmp_path / "f1").read_text() == "a\nb\nc\nd\n"


def test_a_full_helper_socket_falls_back_to_syncing_on_the_loop(tmp_path: Path) -> None:
    async def main() -> None:
        writer = JournalWriter()
        fds = open_files(tmp_path, 2)
        try:
            await asyncio.gather(*(append(writer, fd, b"a\n") for fd in fds))
            helper = writer._helper
            assert helper is not None

            class Full:
                def __init__(self, sock: socket.socket) -> None:
                    self.sock = sock

                def send(self, data: bytes) -> int:
                    raise BlockingIOError

                def __getattr__(self, name: str) -> object:
                    return getattr(self.sock, name)

            real = helper.sock
            helper.sock = Full(real)  # type: ignore[assignment]
            await asyncio.wait_for(asyncio.gather(*(append(writer, fd, b"b\n") for fd in fds)), 10)
            helper.sock = real
        finally:
            writer.close()
            for fd in fds:
                os.close(fd)

    asyncio.run(main())
    assert (tmp_path / "f0").read_text() == "a\nb\n"


def test_the_helper_answers_only_after_fdatasync_and_reports_its_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The helper's protocol, run in a thread of this process so its fdatasync can be watched."""
    synced: list[int] = []
    real = os.fdatasync

    def fdatasync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith("bad"):
            raise OSError(5, "Input/output error")
        real(fd)
        synced.append(fd)

    monkeypatch.setattr(syncer.os, "fdatasync", fdatasync)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(syncer.main([str(theirs.detach())])))
    monkeypatch.setattr(syncer.signal, "signal", lambda *args: None)  # signals are the main thread's
    thread.start()
    good, bad = (os.open(tmp_path / name, os.O_WRONLY | os.O_CREAT, 0o600) for name in ("good", "bad"))
    try:
        socket.send_fds(ours, [b"o" + struct.pack("<Q", 1)], [good])
        socket.send_fds(ours, [b"o" + struct.pack("<Q", 2)], [bad])
        ours.send(b"s" + struct.pack("<QQQQQQ", 1, 10, 2, 20, 1, 11))
        answers: dict[int, bytes] = {}
        ours.settimeout(10)
        while len(answers) < 3:
            data = ours.recv(1 << 16)
            if data[:1] == b"a":
                answers.update((token, b"ok") for (token,) in struct.iter_unpack("<Q", data[1:]))
            else:
                answers[struct.unpack_from("<Q", data, 1)[0]] = data[9:]
        assert answers[10] == answers[11] == b"ok"
        assert b"Input/output error" in answers[20]
        assert len(synced) == 1  # one fdatasync for the two lines of the same file
        ours.send(b"c" + struct.pack("<Q", 1))
    finally:
        ours.close()
        thread.join(10)
        os.close(good)
        os.close(bad)
    assert result == [0]


def test_the_helper_exits_when_the_proxy_is_killed(tmp_path: Path) -> None:
    script = f"""
import asyncio, os, sys
from capture_proxy.writer import JournalWriter
async def main():
    writer = JournalWriter()
    paths = [os.path.join({str(tmp_path)!r}, f"f{{i}}") for i in range(3)]
    fds = [os.open(path, os.O_WRONLY | os.O_CREAT, 0o600) for path in paths]
    for fd in fds:
        os.write(fd, b"x")
    await asyncio.gather(*(writer.sync(fd) for fd in fds))
    print(writer.helper_pid, flush=True)
    await asyncio.sleep(60)
asyncio.run(main())
"""
    process = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        helper = int(process.stdout.readline())
        assert not gone(helper, timeout=0.2)
        process.kill()
        process.wait()
        assert gone(helper)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_starting_the_write_out_keeps_the_data_and_ignores_what_it_cannot_do(tmp_path: Path) -> None:
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, b"x" * 10_000, 0)
        start_writeback(fd, 4096, 5904)
        start_writeback(fd, 0, 0)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    start_writeback(fd, 0, 10_000)  # closed: a hint only, the sync reports errors
    assert path.read_bytes() == b"x" * 10_000
