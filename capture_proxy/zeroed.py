"""A file written over a zeroed reserve: its fdatasyncs flush data without changing the file's size.

On ext4 (and xfs) an ``fdatasync`` after an append also commits the file system's own journal, because
the file's size changed; after an overwrite in place it only flushes the data (measured here: 0.20 →
0.09 ms per sync of a 10 KB line). So the file keeps NUL bytes past its last write, and each write lands
on them; a write that outgrows the reserve carries the next one with it. Readers of such a file stop at
the first NUL, which no JSON line contains. Both the session journals and the shared write-ahead log are
written this way.
"""

from __future__ import annotations

import os


class ZeroedFile:
    """An open file descriptor whose writes go over a reserve of ``len(zeros)`` NUL bytes."""

    def __init__(self, fd: int, zeros: bytes) -> None:
        self.fd = fd
        self.zeros = zeros
        self.end = self.reserved = os.fstat(fd).st_size  # next write at ``end``; zeros up to ``reserved``

    def reserve(self) -> None:
        """Write a reserve past the end now (blocking), unless one is there."""
        if self.reserved == self.end:
            pwrite_all(self.fd, self.zeros, self.end)
            self.reserved = self.end + len(self.zeros)

    def write(self, data: bytes) -> None:
        """Write ``data`` at the end, over the zeros; a write that does not fit brings a new reserve."""
        offset = self.end
        self.end += len(data)
        if self.end > self.reserved:
            data += self.zeros  # a copy once per reserve, not per write
            self.reserved = offset + len(data)
        pwrite_all(self.fd, data, offset)

    def cut(self) -> None:
        """Cut the reserve off (the file then ends with its last write)."""
        if self.reserved > self.end:
            os.ftruncate(self.fd, self.end)
            self.reserved = self.end


def pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """``os.pwrite`` until all of ``data`` is written."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
