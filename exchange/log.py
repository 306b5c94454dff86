"""Experience log: segmented, append-only, crash-safe record of every accepted Experience.

Layout: ``DIR/00000000.seg``, ``DIR/00000001.seg``, ... Each segment starts with the
8-byte header ``SEELOG`` + u16 format version, then frames::

    u32 LE payload length | u32 LE crc32(payload) | payload

where payload is a codec frame (msgpack array of encoded ``Experience`` messages), so
the broker logs a whole accepted batch with one write and one checksum. A new segment
starts once the current one passes ``segment_bytes``.

Crash safety: a process killed mid-write leaves at most one torn frame at the end of
the last segment. ``ExperienceLogWriter`` detects it on open (length past end of file,
or a bad checksum on the final frame) and truncates it; a bad frame *followed by good
data* is corruption, not a tear, and raises ``LogCorrupt`` naming the file and offset.
Readers stop quietly at a torn tail (the writer may still be appending).
Durability is the OS page cache: ``flush()`` hands bytes to the kernel; ``fsync_log(DIR)``
(any process: a learner calls it at each checkpoint) makes what the kernel holds durable.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from exchange.codec import Decoder, Encoder
from exchange.protocol import Experience

MAGIC = b"SEELOG" + struct.pack("<H", 1)
_HEAD = struct.Struct("<II")
DEFAULT_SEGMENT_BYTES = 64 * 1024 * 1024


class LogCorrupt(Exception):
    """The log holds a damaged frame that is not a torn tail; the message names file and offset."""


class LogPosition(NamedTuple):
    """Where a frame starts: resume a replay from here."""

    segment: int
    offset: int


def _segments(root: Path) -> list[Path]:
    return sorted(root.glob("*.seg"))


def _scan(path: Path, data: bytes) -> tuple[list[tuple[int, bytes]], int, bool]:
    """Frames of one segment as (offset, payload), the end of the last good frame, and whether a tail is torn."""
    if data[: len(MAGIC)] != MAGIC:
        if len(data) < len(MAGIC) and MAGIC.startswith(data):
            return [], 0, True  # killed while writing the header
        raise LogCorrupt(f"{path}: not an experience log segment (bad header)")
    frames, pos = [], len(MAGIC)
    while pos < len(data):
        if pos + _HEAD.size > len(data):
            return frames, pos, True
        length, crc = _HEAD.unpack_from(data, pos)
        end = pos + _HEAD.size + length
        if end > len(data):
            return frames, pos, True
        payload = data[pos + _HEAD.size : end]
        if zlib.crc32(payload) != crc:
            if end == len(data):
                return frames, pos, True  # last frame, its bytes never fully reached the disk
            raise LogCorrupt(f"{path}: checksum mismatch in the frame at byte {pos}, with data after it")
        frames.append((pos, payload))
        pos = end
    return frames, pos, False


class ExperienceLogWriter:
    """Appends frames of encoded Experience messages. One writer per directory (the broker)."""

    def __init__(self, directory: str | os.PathLike, segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> None:
        self.root = Path(directory)
        self.root.mkdir(parents=True, exist_ok=True)
        self.segment_bytes = segment_bytes
        self.truncated_bytes = 0  # how much torn tail was cut on open
        self._encoder = Encoder()
        segments = _segments(self.root)
        self._index = int(segments[-1].stem) if segments else 0
        if segments:
            self._repair(segments[-1])
        self._open_segment()

    def _repair(self, path: Path) -> None:
        data = path.read_bytes()
        _, good_end, torn = _scan(path, data)
        if torn:
            self.truncated_bytes = len(data) - good_end
            with open(path, "r+b") as f:
                f.truncate(good_end)

    def _open_segment(self) -> None:
        path = self.root / f"{self._index:08d}.seg"
        self._file = open(path, "ab", buffering=1 << 20)
        if self._file.tell() == 0:
            self._file.write(MAGIC)
        self._size = self._file.tell()

    def append_raw(self, encoded: list) -> None:
        """Logs already-encoded (and validated) Experience messages as one frame."""
        if encoded:
            self.append_frame(Encoder.frame(encoded))

    def append_frame(self, payload: bytes) -> None:
        """Logs a codec frame that holds only validated Experience messages (the broker's fast path)."""
        if self._size >= self.segment_bytes:
            self._file.close()
            self._index += 1
            self._open_segment()
        self._file.write(_HEAD.pack(len(payload), zlib.crc32(payload)))
        self._file.write(payload)
        self._size += _HEAD.size + len(payload)

    def append(self, experiences: list[Experience]) -> None:
        """Encodes, validates and logs Experience messages as one frame."""
        self.append_raw([self._encoder.encode(e) for e in experiences])

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> ExperienceLogWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def fsync_log(directory: str | os.PathLike) -> None:
    """fsync every segment and the directory: what the writer has flushed survives a power loss.

    Works from any process (fsync on a read-only descriptor flushes the file's dirty pages)."""
    root = Path(directory)
    for path in [*_segments(root), root]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class ExperienceLogReader:
    """Reads a log directory (safe while a writer appends). Iterating yields every Experience in order."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.root = Path(directory)
        if not self.root.is_dir():
            raise FileNotFoundError(f"{self.root}: no experience log directory here")
        self._decoder = Decoder(types=(Experience,))

    def records(self, start: LogPosition | None = None) -> Iterator[tuple[LogPosition, Experience]]:
        """(position of its frame, experience) from ``start`` on; resume with a position you kept."""
        segments = _segments(self.root)
        for i, path in enumerate(segments):
            index = int(path.stem)
            if start is not None and index < start.segment:
                continue
            frames, _, torn = _scan(path, path.read_bytes())
            if torn and i != len(segments) - 1:
                raise LogCorrupt(f"{path}: torn frame in a segment that is not the last one")
            for offset, payload in frames:
                if start is not None and (index, offset) < start:
                    continue
                frame = self._decoder.decode_frame(payload)
                if frame.errors:
                    raise LogCorrupt(f"{path}: frame at byte {offset} holds a bad experience ({frame.errors[0]})")
                for exp in frame.messages:
                    yield LogPosition(index, offset), exp

    def __iter__(self) -> Iterator[Experience]:
        return (exp for _, exp in self.records())

    def by_model(self, model: str) -> Iterator[Experience]:
        return (exp for exp in self if exp.model == model)

    def by_prompt(self, prompt_id: int, model: str | None = None) -> Iterator[Experience]:
        return (exp for exp in self if exp.prompt_id == prompt_id and (model is None or exp.model == model))

    def grouped_by_prompt(self, model: str | None = None) -> dict[int, list[Experience]]:
        """prompt id -> its experiences (all models, or one), in log order."""
        groups: dict[int, list[Experience]] = {}
        for exp in self if model is None else self.by_model(model):
            groups.setdefault(exp.prompt_id, []).append(exp)
        return groups


__all__ = ["ExperienceLogWriter", "ExperienceLogReader", "LogPosition", "LogCorrupt", "fsync_log"]
