"""Shared fixtures: one warm-start cache for every engine test of a session (each warm start is made once)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def engine_cache(tmp_path_factory) -> Path:
    """A fresh cache per session (CI); MUTUAL_RL_TEST_CACHE=DIR keeps one across sessions while developing."""
    kept = os.environ.get("MUTUAL_RL_TEST_CACHE")
    if kept:
        Path(kept).mkdir(parents=True, exist_ok=True)
        return Path(kept)
    return tmp_path_factory.mktemp("mutual_rl_cache")
