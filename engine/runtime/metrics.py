"""metrics.jsonl: one JSON object a line, appended by every learner and the supervisor.

Each line is written with a single ``write`` on a file opened in append mode, so
lines from several processes never interleave (they are far below PIPE_BUF).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN; null says "not measured"
    return value


class MetricsWriter:
    def __init__(self, run_dir: str | os.PathLike, model: str):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.model = model
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, **record) -> None:
        line = {"time": round(time.time(), 3), "model": self.model}
        line.update({k: _clean(v) for k, v in record.items()})
        os.write(self._fd, (json.dumps(line) + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)


class MetricsTail:
    """Reads new complete lines of a metrics.jsonl as they appear (for the live display)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._offset = 0
        self._partial = b""

    def read_new(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        self._offset += len(chunk)
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()
        return [json.loads(line) for line in lines if line.strip()]
