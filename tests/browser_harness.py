"""A real browser for the dashboard's tests: Debian's headless Chromium and its matching chromedriver
(packages chromium and chromium-driver, which `.ci/run` installs like graphviz), driven by Selenium.

Nothing is downloaded: the driver and the browser are named, so Selenium Manager never runs.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
# Without the background-networking flags Chromium calls Google's hosts at every start (a closed network).
FLAGS = (
    "--headless=new",
    "--no-sandbox",  # CI runs as root
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1500,1300",
)
SCREENSHOTS = Path(__file__).resolve().parent.parent / "docs"
WRITE_SCREENSHOTS = bool(os.environ.get("EXOD_WRITE_SCREENSHOTS"))  # `make screenshots`


def missing() -> str | None:
    for path in (CHROMIUM, CHROMEDRIVER):
        if not Path(path).exists():
            return f"{path} not found: `apt-get install chromium chromium-driver` (.ci/run does)"
    return None


@pytest.fixture(scope="module")
def browser(tmp_path_factory) -> Iterator[Any]:
    """One headless Chromium per module; CI must have it, a developer's machine may not."""
    if (why := missing()) is not None:
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium')}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def until(read: Callable[[], Any], timeout: float = 60.0, what: str = "") -> Any:
    """``read()`` until it returns something truthy; its last exception or value is in the failure."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            if value := read():
                return value
            last = value
        except Exception as exc:  # the page is re-rendered under us: read again
            last = exc
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what or read}; last: {last!r}")


def click(find: Callable[[], Any], what: str = "") -> None:
    """Click what ``find()`` returns, found again if the page redrew it in between."""

    def clicked() -> bool:
        find().click()
        return True

    until(clicked, timeout=10, what=what or "a click")


def open_page(driver: Any, url: str) -> None:
    """Load ``url`` with the console's earlier entries read away, so that `console_errors` is this page's."""
    driver.get_log("browser")
    driver.get(url)


def console_errors(driver: Any) -> list[dict[str, Any]]:
    """The console's errors since the page was opened (or since the last call)."""
    return [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def screenshot(driver: Any, name: str) -> None:
    """`make screenshots` keeps the main views in docs/ (shown in the README)."""
    if WRITE_SCREENSHOTS:
        SCREENSHOTS.mkdir(exist_ok=True)
        driver.save_screenshot(str(SCREENSHOTS / f"{name}.png"))
