"""Compressed input streams for collect: `.gz` and `.zst` decompressed as they are read, and what a break in one
raises (`STREAM_ERRORS`: the reader keeps what it read before the break and rejects the rest as truncated)."""

from __future__ import annotations

import gzip
import io
import zlib

import zstandard

from lifecycle.core import fs

STREAM_ERRORS = (EOFError, gzip.BadGzipFile, zlib.error, zstandard.ZstdError, OSError)
COMPRESSED = (".gz", ".zst")


class ZstdRaw(io.RawIOBase):
    """A `.zst` stream that raises EOFError when it ends inside a frame (zstandard's reader ends silently)."""

    def __init__(self, f):
        self.f, self.obj, self.buf, self.in_frame = f, zstandard.ZstdDecompressor().decompressobj(), b"", False

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self.buf:
            chunk = self.f.read(1 << 16)
            if not chunk:
                if self.in_frame:
                    raise EOFError("zstd stream ends inside a frame")
                return 0
            while chunk:
                self.in_frame = True
                self.buf += self.obj.decompress(chunk)
                chunk = b""
                if self.obj.eof:  # frame done: a following frame starts a new decompressor
                    chunk, self.in_frame = self.obj.unused_data, False
                    self.obj = zstandard.ZstdDecompressor().decompressobj()
        n = min(len(b), len(self.buf))
        b[:n], self.buf = self.buf[:n], self.buf[n:]
        return n

    def close(self) -> None:
        self.f.close()
        super().close()


def open_stream(path: str):
    """`path` opened for reading bytes, decompressed when it ends in .gz or .zst."""
    p = path.lower()
    if p.endswith(".gz"):
        return gzip.open(fs.open_bytes(path), "rb")
    if p.endswith(".zst"):
        return io.BufferedReader(ZstdRaw(fs.open_bytes(path)), 1 << 16)
    return fs.open_bytes(path)


def truncated_reason(path: str) -> str:
    """The reason code of a compressed stream that breaks."""
    return "truncated_zstd" if path.lower().endswith(".zst") else "truncated_gzip"
