"""A real Chromium (Debian's) driven by Playwright against a live Sluice server."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

SCREENSHOTS = Path(__file__).resolve().parents[2] / "test-output" / "screenshots"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-quic", "--no-first-run", "--disable-sync"]


@pytest.fixture(scope="session")
def browser():
    executable = shutil.which("chromium")
    if executable is None:
        pytest.fail("Debian's chromium is not installed: run `make browser` (make test does it).")
    from playwright.sync_api import sync_playwright

    os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API runs an event loop
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(15_000)
    yield page
    context.close()


def screenshot(page, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def screenshots(page, name: str) -> None:
    """The page at a laptop's width (1280 px) and a phone's (390 px), then back."""
    size = page.viewport_size
    for width, height in ((1280, 900), (390, 844)):
        page.set_viewport_size({"width": width, "height": height})
        screenshot(page, f"{name}-{width}")
    page.set_viewport_size(size)


@pytest.fixture
def login(page, live_server):
    def as_user(username: str, password: str, *, console: bool = True):
        url = f"{live_server.url}/console/login/" if console else f"{live_server.url}/login/"
        page.goto(url)
        page.fill("input[name=username]", username)
        page.fill("input[name=password]", password)
        page.click("input[type=submit], button[type=submit]")
        page.wait_for_load_state()
        return page

    return as_user
