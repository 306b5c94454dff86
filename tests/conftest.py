"""Shared fixtures: one warm-start cache for every engine test of a session, made once and shared by the session's
parallel workers (pytest-xdist, ``-n`` in pyproject.toml)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The configs whose warm starts the engine tests load. Each takes well under a minute on a quiet 2-core box;
# past this bound (a machine many times slower, or a hang) the session stops with one line instead of hanging CI.
WARM_CONFIGS = ("configs/smoke.toml", "configs/pool.toml")
WARM_START_LIMIT_S = 1200.0
# The session's scratch folder, made by the process pytest was started as and inherited by its xdist workers
# (their environment is a copy of its, taken after pytest_configure): the warm-start cache and the locks live there.
SESSION_DIR = "MUTUAL_RL_TEST_SESSION_DIR"
_WARM_CACHE = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the main process: the session's folder, for every worker
        os.environ[SESSION_DIR] = tempfile.mkdtemp(prefix="mutual_rl_tests-")


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ.pop(SESSION_DIR, ""), ignore_errors=True)


def _session_dir() -> Path:
    return Path(os.environ[SESSION_DIR])


@contextlib.contextmanager
def _flock(path: Path, mode: int) -> Iterator[bool]:
    """Hold an flock on ``path``; with LOCK_NB in ``mode``, yields whether it was taken."""
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, mode)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the xdist_group marks set here
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The long tests (marked slow: whole runs) first, each file's in its own order: the session's parallel workers
    (``--dist loadgroup``: one test at a time to whichever worker is free) then share them out from the start,
    and the quick ones fill the gaps at the end instead of one long run alone. Of the long ones, those that need
    no warm start (sweeps, process groups) go first: they keep the other workers busy while one makes the warm
    starts, where an engine test would wait for them in its set-up with a core idle. The tests that read one
    shared run (``smoke_run``) form one group, so one worker makes that run, once."""
    def order(item: pytest.Item) -> tuple[bool, bool]:
        slow = item.get_closest_marker("slow") is not None
        return not slow, slow and "engine_cache" in getattr(item, "fixturenames", ())

    items.sort(key=order)
    for item in items:
        if "smoke_run" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("smoke_run"))


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> None:
    """The warm starts are made here, once, before the first test, if any selected test needs them.

    Made inside a test's set-up they would count against that test's --timeout (pytest-timeout times
    set-up too). Under xdist every worker comes here: the first makes them while the others go on with their
    tests, and an engine test of theirs waits for the warm starts in its set-up (a minute at most here)."""
    if session.config.option.collectonly or not any("engine_cache" in getattr(item, "fixturenames", ())
                                                   for item in session.items):
        return
    capture = session.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():  # the warm start's progress lines show as it goes
        try:
            _warm_cache(session.config, wait=False)
        except Exception as exc:  # noqa: BLE001 (one line, not a traceback per engine test)
            pytest.exit(f"the warm starts failed, so no engine test can run: {exc}", returncode=1)


@pytest.fixture(scope="session")
def engine_cache(request: pytest.FixtureRequest) -> Path:
    """The cache holding the warm starts of WARM_CONFIGS (made before the first test, see above): a fresh one
    per session (CI); MUTUAL_RL_TEST_CACHE=DIR keeps one across sessions while developing."""
    return _warm_cache(request.config)


def _warm_cache(config: pytest.Config, wait: bool = True) -> Path | None:
    """The session's warm-start cache, made by the first process to get here; None if another process is making
    it and ``wait`` is False."""
    cache = config.stash.get(_WARM_CACHE, None)
    if cache is None:
        kept = os.environ.get("MUTUAL_RL_TEST_CACHE")
        cache = Path(kept) if kept else _session_dir() / "cache"
        made = _session_dir() / "warm-starts.made"
        with _flock(_session_dir() / "warm-starts.lock", fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB)) as mine:
            if not mine:
                return None
            if not made.exists():
                cache.mkdir(parents=True, exist_ok=True)
                _warm_starts(cache)
                made.touch()
        config.stash[_WARM_CACHE] = cache
    return cache


def _warm_starts(cache: Path) -> None:
    from engine.config import load_run_config
    from engine.prep.prepare import prepare_all

    scratch = Path(tempfile.mkdtemp(prefix="mutual_rl_warm_starts-"))
    running: list = []

    async def bounded() -> None:
        try:
            for name in WARM_CONFIGS:
                cfg = load_run_config(str(ROOT / name), [f"run.cache_dir='{cache}'"])
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
