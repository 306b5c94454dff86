"""TensorBoard event files of a learner's metrics, with no dependency: ``tensorboard --logdir RUN_DIR/tensorboard``.

An event file is a TFRecord stream (length, masked CRC-32C of it, payload, masked CRC-32C of
it) of ``Event`` protobufs; a scalar is ``Event{wall_time=1, step=2, summary=5{value=1{tag=1,
simple_value=2}}}``. Those few fields are encoded here by hand, so a run needs neither the
tensorboard package nor its protobuf stack; tests read the files back with tensorboard's
own loader. One directory per model (``tensorboard/<model>/``): TensorBoard shows each model
as a run, and the same tag of every model on one chart.
"""

from __future__ import annotations

import math
import os
import socket
import struct
import time
from pathlib import Path


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def _masked_crc(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1  # negative int64 as two's complement, as protobuf does
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:  # length-delimited (wire type 2)
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _event(step: int, body: bytes, wall_time: float) -> bytes:
    return b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step) + body


def scalar_tag(key: str) -> str:
    """Held-out accuracy under ``eval/``; the objective's own figures keep their ``obj/`` prefix."""
    return f"eval/{key}" if "accuracy" in key and "/" not in key else key


class EventWriter:
    """Appends scalar summaries to one event file; every number of a record becomes a scalar."""

    def __init__(self, logdir: str | os.PathLike):
        self.dir = Path(logdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.0"
        self._f = open(self.dir / name, "ab")
        self._write(_event(0, _field(3, b"brain.Event:2"), time.time()))

    def _write(self, data: bytes) -> None:
        header = struct.pack("<Q", len(data))
        self._f.write(header + struct.pack("<I", _masked_crc(header)) + data + struct.pack("<I", _masked_crc(data)))

    def scalars(self, step: int, record: dict, wall_time: float | None = None) -> None:
        values = b""
        for key, v in record.items():
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or key in ("time", "step"):
                continue
            values += _field(1, _field(1, scalar_tag(key).encode()) + b"\x15" + struct.pack("<f", v))
        if values:
            self._write(_event(step, _field(5, values), wall_time or time.time()))
            self._f.flush()  # TensorBoard reads a live run

    def close(self) -> None:
        self._f.close()
