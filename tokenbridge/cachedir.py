"""Where this machine's cache of converted tokenizers (and the engine's warm starts) lives, when a run does
not say: the one place that decides it, read by the THL, the engine, the monitor and `launch.py cache`.
"""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_root() -> Path:
    """``$MUTUAL_RL_CACHE``, else ``$XDG_CACHE_HOME/mutual_rl`` (``~/.cache/mutual_rl`` when XDG_CACHE_HOME is unset)."""
    if os.environ.get("MUTUAL_RL_CACHE"):
        return Path(os.environ["MUTUAL_RL_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "mutual_rl"
