"""Shared fixtures: one warm-start cache for every engine test of a session (each warm start is made once)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# The smoke warm starts take minutes on a fresh cache (~7 on a quiet 2-core box, three times that on a
# slow one); past this the session stops with one line instead of hanging CI.
WARM_START_LIMIT_S = 2400.0
_WARM_CACHE = pytest.StashKey[Path]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> None:
    """The smoke warm starts are made here, once, before the first test, if any selected test needs them.

    Made inside a test's set-up they would count against that test's --timeout (pytest-timeout times
    set-up too): on a slow machine the first engine test then fails for time it never spent."""
    if session.config.option.collectonly or not any("engine_cache" in getattr(item, "fixturenames", ())
                                                   for item in session.items):
        return
    capture = session.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():  # the warm start's progress lines show as it goes
        try:
            _warm_cache(session.config)
        except Exception as exc:  # noqa: BLE001 (one line, not a traceback per engine test)
            pytest.exit(f"the smoke warm starts failed, so no engine test can run: {exc}", returncode=1)


def pytest_sessionfinish(session: pytest.Session) -> None:
    cache = session.config.stash.get(_WARM_CACHE, None)
    if cache is not None and not os.environ.get("MUTUAL_RL_TEST_CACHE"):
        shutil.rmtree(cache, ignore_errors=True)


@pytest.fixture(scope="session")
def engine_cache(request: pytest.FixtureRequest) -> Path:
    """The cache holding the smoke config's warm starts (made before the first test, see above): a fresh
    one per session (CI); MUTUAL_RL_TEST_CACHE=DIR keeps one across sessions while developing."""
    return _warm_cache(request.config)


def _warm_cache(config: pytest.Config) -> Path:
    """The session's warm-start cache, made on the first call (later calls return it)."""
    cache = config.stash.get(_WARM_CACHE, None)
    if cache is None:
        kept = os.environ.get("MUTUAL_RL_TEST_CACHE")
        cache = Path(kept) if kept else Path(tempfile.mkdtemp(prefix="mutual_rl_cache-"))
        cache.mkdir(parents=True, exist_ok=True)
        config.stash[_WARM_CACHE] = cache
        _warm_starts(cache)
    return cache


def _warm_starts(cache: Path) -> None:
    from engine.config import load_run_config
    from engine.prep.prepare import prepare_all

    root = Path(__file__).resolve().parents[1]
    cfg = load_run_config(str(root / "configs/smoke.toml"), [f"run.cache_dir='{cache}'"])
    scratch = Path(tempfile.mkdtemp(prefix="mutual_rl_warm_starts-"))
    running: list = []

    async def bounded() -> None:
        try:
            await asyncio.wait_for(prepare_all(cfg, scratch, running), WARM_START_LIMIT_S)
        except TimeoutError:
            raise TimeoutError(f"not done in {WARM_START_LIMIT_S:.0f} s") from None
        finally:
            for actor in running:  # on a timeout or an error, no warm start is left running
                actor.process.kill()
                actor.process.join(10)

    try:
        asyncio.run(bounded())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


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
