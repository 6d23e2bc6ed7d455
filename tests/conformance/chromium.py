"""A headless Chromium for the page tests: Debian's `chromium` and `chromium-driver`, driven by Selenium.

Nothing here downloads a browser or a driver: both must be on the machine
(scripts/test.sh installs Debian's packages where it can), and Selenium is
pointed at them by path, with its own driver manager kept offline. Where
either is missing the tests that need a browser skip, naming what is
missing and how to install it.

`Browser` keeps one Chromium session for a whole test module and records,
for every page it opens, the network requests the page made (from the
DevTools performance log) and what the page logged to the console.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

INSTALL_HINT = "apt-get install chromium chromium-driver (scripts/test.sh does it when run as root)"

_BINARIES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# The page's viewport (set exactly, whatever the headless window's frame takes).
VIEWPORT = (1280, 900)


def find_chromium() -> tuple[str, str] | str:
    """(browser binary, chromedriver) on this machine, or why there is none."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]' installs it)"
    driver = shutil.which("chromedriver")
    binary = next((p for p in map(shutil.which, _BINARIES) if p), None)
    if binary is None or driver is None:
        missing = " and ".join(n for n, p in (("chromium", binary), ("chromedriver", driver)) if p is None)
        return f"no {missing} on PATH: {INSTALL_HINT}"
    return binary, driver


class Browser:
    """One headless Chromium session; each `open` starts a fresh record of requests and console messages."""

    def __init__(self, driver: Any, shots: Path) -> None:
        self.driver = driver  # the Selenium WebDriver
        self.shots = shots  # where screenshots are saved
        self.requests: list[str] = []  # URLs the current page asked for
        self.console: list[dict[str, Any]] = []  # what the current page logged

    def _drain(self) -> None:
        for entry in self.driver.get_log("performance"):
            message = json.loads(entry["message"])["message"]
            if message.get("method") == "Network.requestWillBeSent":
                self.requests.append(message["params"]["request"]["url"])
        self.console += self.driver.get_log("browser")

    def open(self, url: str) -> None:
        """Load `url` as a new page (a fresh load, also when only the fragment differs)."""
        self.driver.get("about:blank")
        self._drain()
        self.requests, self.console = [], []
        self.driver.get(url)

    def js(self, script: str, *args: Any) -> Any:
        """Run `script` in the page; its return value."""
        return self.driver.execute_script(script, *args)

    def step(self) -> int:
        """The step the page shows."""
        return int(self.js("return document.body.dataset.step"))

    def click(self, css: str) -> None:
        """Click the element `css` selects, as a person would."""
        from selenium.webdriver.common.by import By

        self.driver.find_element(By.CSS_SELECTOR, css).click()

    def press(self, *keys: str) -> None:
        """Press keys on the page (selenium Keys values)."""
        from selenium.webdriver.common.action_chains import ActionChains

        ActionChains(self.driver).send_keys(*keys).perform()

    def wait_until(self, condition: Any, timeout_s: float = 5.0) -> Any:
        """Poll `condition(self)` until it is true (no fixed sleeps)."""
        from selenium.webdriver.support.ui import WebDriverWait

        return WebDriverWait(self.driver, timeout_s, poll_frequency=0.02).until(lambda _: condition(self))

    def assert_clean(self, allowed_prefixes: tuple[str, ...]) -> None:
        """The page asked only for itself and logged no error."""
        self._drain()
        foreign = [u for u in self.requests if not u.startswith(allowed_prefixes)]
        assert not foreign, f"the page made network requests: {foreign}"
        errors = [m for m in self.console if m.get("level") == "SEVERE"]
        assert not errors, f"the page logged errors: {errors}"

    def _viewport(self, height: int) -> None:
        self.driver.execute_cdp_cmd(
            "Emulation.setDeviceMetricsOverride",
            {"width": VIEWPORT[0], "height": height, "deviceScaleFactor": 1, "mobile": False},
        )

    def screenshot(self, name: str) -> Path:
        """A screenshot of the whole page, saved as `name`.png; returns its path."""
        height = int(self.js("return Math.ceil(document.documentElement.scrollHeight)"))
        self._viewport(min(max(height, VIEWPORT[1]), 4000))
        path = self.shots / f"{name}.png"
        try:
            self.driver.save_screenshot(str(path))
        finally:
            self._viewport(VIEWPORT[1])
        return path


@contextmanager
def chromium_session(shots: Path) -> Iterator[Browser | str]:
    """A `Browser`, or the reason none could start (the caller skips with it)."""
    found = find_chromium()
    if isinstance(found, str):
        yield found
        return
    binary, driver_path = found
    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium's driver manager must never fetch anything
    from selenium import webdriver
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        f"--window-size={VIEWPORT[0]},{VIEWPORT[1]}",
        "--no-first-run",
        "--disable-extensions",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    try:
        driver = webdriver.Chrome(service=Service(driver_path), options=options)
    except WebDriverException as e:
        yield f"{binary} with {driver_path} did not start: {e.msg or e}"
        return
    try:
        shots.mkdir(parents=True, exist_ok=True)
        browser = Browser(driver, shots)
        browser._viewport(VIEWPORT[1])
        yield browser
    finally:
        driver.quit()
