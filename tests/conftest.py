"""Shared fixtures: one warm-start cache for every engine test of a session (each warm start is made once)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def engine_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mutual_rl_cache")
