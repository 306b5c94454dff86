"""The monitor page in a real browser: Debian's headless Chromium driven by selenium through
/usr/bin/chromedriver (nothing downloaded at test time). It replays a finished run and checks
that the charts receive data, the exchange graph has an edge per ordered pair of models, and a
prompt's story shows samples of every model. Skips, saying why, where Chromium is absent."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.enginerun import ROOT
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


def wait(driver, what: str, check, timeout: float = 60):
    deadline = time.time() + timeout
    while not check(driver):
        assert time.time() < deadline, f"the page never showed {what}"
        time.sleep(0.2)


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
