"""The monitor page in a real browser: Debian's headless Chromium driven by selenium through
/usr/bin/chromedriver (nothing downloaded at test time). It replays a finished run, and follows a
live one (a real short training run), and checks that the charts receive data, the exchange graph
has an edge per ordered pair of models, and a prompt's story shows samples of every model. Skips,
saying why, where Chromium is absent.

MONITOR_SCREENSHOT=FILE.png keeps the replay's screenshot there and the live run's as FILE-live.png."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

import pytest

from tests.enginerun import ROOT, Run
from tests.monitorrun import write_run

CHROMEDRIVER = Path("/usr/bin/chromedriver")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
pytestmark = pytest.mark.skipif(not CHROMEDRIVER.exists() or not Path(CHROMIUM).exists(),
                                reason="needs Debian's chromium and chromium-driver (apt-get install -y chromium "
                                       "chromium-driver; .ci/run installs them)")


def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the [test] extra")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1300,2200"):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=opts)


def serve(run_dir: Path, *args: str) -> tuple[subprocess.Popen, str]:
    """``launch.py monitor RUN_DIR`` serving on a free port; the URL from its first line."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "launch.py"), "monitor", str(run_dir), "--port", "0",
                             "--no-browser", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    deadline = time.time() + 120
    while not any("http://" in line for line in lines):
        assert proc.poll() is None and time.time() < deadline, f"the monitor did not start: {''.join(lines)}"
        time.sleep(0.1)
    url = next(line for line in lines if "http://" in line).split()[1]
    return proc, url


def wait(driver, what: str, check, timeout: float = 180):  # a bound on a hang; a busy machine takes its time
    from selenium.common.exceptions import StaleElementReferenceException

    deadline = time.time() + timeout
    while True:
        try:
            if check(driver):
                return
        except StaleElementReferenceException:
            pass  # the page redrew that part between finding an element and reading it: look again
        assert time.time() < deadline, f"the page never showed {what}"
        time.sleep(0.2)


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
def test_page_shows_charts_exchange_and_story(tmp_path):
    run_dir = write_run(tmp_path / "run", prompts=12, steps=4)
    proc, url = serve(run_dir, "--speed", "4")
    driver = browser()
    try:
        driver.get(url)
        canvases = ("chart-reward", "chart-accuracy", "chart-length", "chart-staleness")
        wait(driver, "data in every chart",
             lambda d: all(int(d.find_element("id", c).get_attribute("data-points") or 0) > 0 for c in canvases))
        wait(driver, "an edge per ordered pair of models",
             lambda d: sorted((e.get_attribute("data-src"), e.get_attribute("data-dst"))
                              for e in d.find_elements("css selector", "#exchange g.edge"))
             == [("gpt2", "llama"), ("llama", "gpt2")])
        wait(driver, "a story with samples of every model",
             lambda d: {m.get_attribute("data-model"): len(m.find_elements("css selector", ".sample"))
                        for m in d.find_elements("css selector", ".story-model")} == {"gpt2": 4, "llama": 4})
        assert "residual of 1.0 is normal on digits" in driver.find_element("id", "residual-note").text
        assert driver.find_elements("css selector", "#story .bridged")  # peer samples in the receiver's tokens
        driver.save_screenshot(str(os.environ.get("MONITOR_SCREENSHOT", tmp_path / "monitor.png")))
    finally:
        driver.quit()
        proc.terminate()
        proc.wait(20)


CANVASES = ("chart-reward", "chart-accuracy", "chart-length", "chart-staleness")


# A live page redraws its exchange graph every half second and its story every few: each view below is read
# by one script, in one go, so it never mixes two drawings (nor holds an element the page has since replaced).

def _points(driver) -> dict[str, int]:
    return driver.execute_script("return Object.fromEntries(arguments[0].map((c) => "
                                 "[c, Number(document.getElementById(c).dataset.points || 0)]))", list(CANVASES))


def _edges(driver) -> list[tuple[str, str]]:
    return sorted(map(tuple, driver.execute_script(
        "return [...document.querySelectorAll('#exchange g.edge')].map((e) => [e.dataset.src, e.dataset.dst])")))


def _story(driver) -> tuple[int, dict[str, int]]:
    """(the prompt shown, -1 if none yet; samples shown per model)."""
    prompt, per_model = driver.execute_script(
        "const b = document.querySelector('#story > p > b');"
        "return [b ? Number(b.textContent) : -1, Object.fromEntries([...document.querySelectorAll('.story-model')]"
        ".map((m) => [m.dataset.model, m.querySelectorAll('.sample').length]))]")
    return prompt, per_model


@pytest.mark.slow  # a whole run
def test_page_follows_a_live_run(tmp_path, engine_cache):
    """A real run (configs/smoke.toml, made long enough to watch, stopped with Ctrl-C once seen): the monitor
    attaches to its exchange as a lossy subscriber and the page draws what the run is doing, as it does it."""
    run = Run(tmp_path / "run", engine_cache, "train.steps=1000", "run.max_minutes=5")
    proc = driver = None
    try:
        run.wait_for(lambda: (run.run_dir / "endpoints.json").is_file(), "endpoints.json")
        run.wait_steps(1)  # the RL phase: warm starts done, learners training, generators publishing
        cfg = tomllib.loads((run.run_dir / "config.toml").read_text())
        models, group = sorted(m["name"] for m in cfg["models"]), cfg["train"]["group_size"]
        assert models == ["gpt2", "llama"] and group == 8
        proc, url = serve(run.run_dir)
        driver = browser()
        driver.get(url)
        wait(driver, "data in every chart", lambda d: all(n > 0 for n in _points(d).values()))
        wait(driver, "an edge per ordered pair of models", lambda d: _edges(d) == [("gpt2", "llama"), ("llama", "gpt2")])
        # a story of a prompt every model sampled, G samples each (the monitor is lossy: a dropped sample
        # would show as fewer, and as "missed" in the status line)
        full = {m: group for m in models}
        wait(driver, "a story with the G samples of every model", lambda d: _story(d)[1] == full)
        # live, not a replay: the title says so, and the status counts what the run's broker accepted (its Stats)
        assert driver.find_element("id", "run").text == "run (live)"
        wait(driver, "the broker's counts", lambda d: "broker accepted" in d.find_element("id", "status").text)
        # it follows the run: newer learner steps reach the reward chart, and the story moves on to newer prompts
        before, first = _points(driver)["chart-reward"], _story(driver)[0]
        run.wait_steps(len(run.steps()) + 2)
        wait(driver, "the run's newer steps", lambda d: _points(d)["chart-reward"] > before)
        def newer_story(d) -> bool:
            shown, samples = _story(d)
            return shown > first and samples == full

        wait(driver, "a newer prompt's story", newer_story)
        kept = os.environ.get("MONITOR_SCREENSHOT")
        shot = Path(kept).with_stem(Path(kept).stem + "-live") if kept else tmp_path / "monitor-live.png"
        driver.save_screenshot(str(shot))
        run.signal(signal.SIGINT)  # Ctrl-C: the run stops, its broker says Closing, the page says it ended
        code = run.finish(timeout=120)
        assert code == 130, f"exit {code} after Ctrl-C, not 130:\n{run.out[-3000:]}"
        wait(driver, "the end of the run", lambda d: d.find_element("id", "run").text == "run (live, ended)")
    finally:
        if driver is not None:
            driver.quit()
        if proc is not None:
            proc.terminate()
            proc.wait(20)
        if run.proc.poll() is None:
            run.signal(signal.SIGKILL)
            run.finish(timeout=60)
    assert run.leftover() == []
