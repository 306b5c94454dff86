"""metrics.jsonl: one JSON object a line, appended by every learner, worker and the coordinator.

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
