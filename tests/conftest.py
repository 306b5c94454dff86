"""Shared fixtures: one warm-start cache for every engine test of a session (each warm start is made once)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def engine_cache(tmp_path_factory) -> Path:
    """A fresh cache per session (CI); MUTUAL_RL_TEST_CACHE=DIR keeps one across sessions while developing.

    The smoke config's warm starts are made here, once (minutes on a fresh cache, a second on a kept
    one), so they show as this fixture's set-up and never inside the time of the test that comes first."""
    kept = os.environ.get("MUTUAL_RL_TEST_CACHE")
    cache = Path(kept) if kept else tmp_path_factory.mktemp("mutual_rl_cache")
    cache.mkdir(parents=True, exist_ok=True)
    _warm_starts(cache, tmp_path_factory.mktemp("warm_starts"))
    return cache


def _warm_starts(cache: Path, scratch: Path) -> None:
    from engine.config import load_run_config
    from engine.prep.prepare import prepare_all

    root = Path(__file__).resolve().parents[1]
    cfg = load_run_config(str(root / "configs/smoke.toml"), [f"run.cache_dir='{cache}'"])
    asyncio.run(prepare_all(cfg, scratch, []))


@pytest.fixture(autouse=True)
def no_process_left_behind():
    """A test that leaves a non-daemon multiprocessing child running fails, and the child is killed: at
    exit multiprocessing joins every such child, so one left alive would hang pytest (and CI) for good.
    (Daemon children, e.g. the math-verify server kept for reuse, are terminated at exit instead.)"""
    before = set(multiprocessing.active_children())
    yield
    left = [p for p in multiprocessing.active_children() if p not in before and not p.daemon]
    for proc in left:
        proc.kill()
        proc.join(10)
    assert not left, f"the test left processes running: {[p.name for p in left]}"


@pytest.fixture(scope="session", autouse=True)
def no_process_at_exit():
    """Whatever a module fixture left running is killed before pytest exits (see above)."""
    yield
    for proc in (p for p in multiprocessing.active_children() if not p.daemon):
        print(f"killing {proc.name} (pid {proc.pid}), left running by the tests")
        proc.kill()
        proc.join(10)
