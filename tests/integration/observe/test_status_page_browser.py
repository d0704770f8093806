"""The live status page as a person sees it: Debian's chromium, headless, driven by selenium
through Debian's chromedriver, opened during a real 2-rank job while a hot reset waits for the
chip and again after the recovery; a screenshot of each is kept in test-artifacts/status-page/
at the repository's root (ignored by git: the artifacts of the last run)."""
from __future__ import annotations

import shutil
import time
from typing import Callable

import pytest

from harness import ROOT, free_port
from mindft.device.simulator import fault_state
from mindft.device.resetfile import write_reset_file
from launching import Job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@pytest.fixture
def browser():
    # .ci/run installs Debian's chromium and chromium-driver; a machine without them fails here, loudly.
    assert shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER), \
        "Debian's chromium and chromium-driver are needed: apt-get install chromium chromium-driver"
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1200,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def _shows(driver, element: str, text: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    seen = ""
    while time.monotonic() < deadline:
        seen = driver.find_element("id", element).text
        if text in seen:
            return seen
        time.sleep(0.2)
    pytest.fail(f"the page's #{element} never showed {text!r}; it shows {seen!r}")


def test_the_status_page_during_and_after_a_hot_reset(launch: Callable[..., Job], browser) -> None:  # noqa: F811
    artifacts = ROOT / "test-artifacts" / "status-page"
    artifacts.mkdir(parents=True, exist_ok=True)
    port = free_port()
    job = launch(nproc=2, steps=300, step_time=0.03, args=("--no-scheduler", "--metrics-addr", "127.0.0.1"),
                 MINDFT_METRICS_PORT=str(port))
    job.wait_until(lambda: job.committed() >= 5, "step 5")
    browser.get(f"http://127.0.0.1:{port}/")
    _shows(browser, "state", "NORMAL")
    assert browser.find_element("id", "rank-1").text.split()[:2] == ["1", "running"]

    write_reset_file(job.reset_file, fault_state([1], policy="reset"))  # the chip is reset until "recovered"
    _shows(browser, "state", "REPAIRING")
    waiting = _shows(browser, "recovery", "waiting for rank 1 (its chip is being reset)")
    assert "s to its deadline" in waiting
    browser.save_screenshot(str(artifacts / "status-during-recovery.png"))

    write_reset_file(job.reset_file, fault_state([1], "recovered", policy="reset"))
    _shows(browser, "state", "NORMAL")
    past = _shows(browser, "timelines", "recovery 1: device_reset on rank 1")
    assert "every rank restored the rollback step" in past and "phases:" in past
    assert "1 recovery" in browser.find_element("id", "job").text
    browser.save_screenshot(str(artifacts / "status-after-recovery.png"))
    assert all((artifacts / f"status-{when}-recovery.png").stat().st_size > 1000 for when in ("during", "after"))
    assert job.wait() == 0, job.text()
    job.assert_bit_identical()
