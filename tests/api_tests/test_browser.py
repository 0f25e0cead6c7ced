"""The web pages in a real browser: Playwright drives Debian's headless Chromium against a real
uvicorn server on loopback (SQLite file) holding stored runs. The list filters, a run page shows
its recommendation and both plots, a copy button fills the clipboard, an unfinished run's page
follows a worker's reports without reloading, a bad token is told so, a phone-sized screen
scrolls only the tables, not the page, and axe-core finds no accessibility violation.

Chromium comes from Debian (`make test` installs the `chromium` package when it is missing);
AUTOTUNE_TEST_CHROMIUM names another binary. Without one these tests fail: they do not skip.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from axe_playwright_python.sync_playwright import Axe
from playwright.sync_api import Browser, BrowserContext, Page, expect, sync_playwright

from api.web.pages import TOKEN_COOKIE
from autotune.core.exports import render_exports
from autotune.remote.client import ServerClient
from autotune.remote.protocol import RunStatus
from tests.api_tests.factories import (
    attempt,
    emulated,
    emulated_device,
    tiny_spec,
    trial,
    tune_result,
)
from tests.browser import CHROMIUM_ARGS, chromium_path
from tests.conftest import CLIENT_TOKEN, WORKER_TOKEN, LiveServer, start_server, stop_server

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("browser")]

TIMEOUT_MS = 20_000


def _chromium() -> str:
    path = chromium_path()
    if not path:
        pytest.fail("no Chromium: `make test` installs Debian's chromium package", pytrace=False)
    return path


@dataclass
class Site:
    server: LiveServer
    user: ServerClient
    worker: ServerClient
    finished_id: int
    cancelled_id: int

    @property
    def url(self) -> str:
        return self.server.url


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    directory = tmp_path_factory.mktemp("browser")
    server = start_server(f"sqlite:///{directory / 'autotune.db'}", directory / "server.log")
    user = ServerClient(server.url, token=CLIENT_TOKEN, retries=0)
    worker = ServerClient(server.url, token=WORKER_TOKEN, retries=0)
    spec = tiny_spec()
    finished_id = user.submit_run(spec, emulated()).id
    claim = worker.claim("w1", [emulated_device()])
    assert claim is not None and claim.run_id == finished_id
    worker.submit_result(finished_id, claim.lease_id, tune_result(spec, emulated_device()))
    cancelled_id = user.submit_run(tiny_spec(65), emulated()).id
    user.cancel_run(cancelled_id)
    yield Site(server, user, worker, finished_id, cancelled_id)
    user.close()
    worker.close()
    stop_server(server)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=_chromium(), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def context(browser: Browser, site: Site) -> Iterator[BrowserContext]:
    """A fresh browser profile holding the client token's cookie."""
    profile = browser.new_context(viewport={"width": 1280, "height": 900})
    profile.set_default_timeout(TIMEOUT_MS)
    profile.add_cookies([{"name": TOKEN_COOKIE, "value": CLIENT_TOKEN, "url": site.url}])
    yield profile
    profile.close()


@pytest.fixture
def page(context: BrowserContext) -> Page:
    return context.new_page()


def test_the_list_shows_the_stored_runs_and_filters_them(page: Page, site: Site) -> None:
    # Other tests of this module add runs in any order: the API says what the list must show.
    page.goto(site.url)
    rows = page.locator("table.runs tbody tr")
    newest_first = [str(run.id) for run in site.user.list_runs().items]
    expect(rows).to_have_count(len(newest_first))
    assert [rows.nth(i).get_attribute("data-run-id") for i in range(rows.count())] == newest_first
    expect(page.locator(f'tr[data-run-id="{site.cancelled_id}"]')).to_contain_text("cancelled")
    expect(page.locator(f'tr[data-run-id="{site.finished_id}"]')).to_contain_text(
        "micro-batch 8 × 4 steps"
    )
    page.get_by_label("Status").select_option("cancelled")
    page.get_by_role("button", name="Filter").click()
    cancelled = [str(run.id) for run in site.user.list_runs(status=RunStatus.CANCELLED).items]
    expect(rows).to_have_count(len(cancelled))
    assert str(site.cancelled_id) in cancelled and str(site.finished_id) not in cancelled
    page.get_by_label("Status").select_option("succeeded")
    page.get_by_role("button", name="Filter").click()
    expect(page.locator(f'tr[data-run-id="{site.finished_id}"]')).to_have_count(1)
    expect(page.locator(f'tr[data-run-id="{site.cancelled_id}"]')).to_have_count(0)
    page.get_by_role("link", name=f"#{site.finished_id}").click()
    expect(page.locator("h1")).to_contain_text(f"Run #{site.finished_id}")


def test_a_run_page_shows_the_recommendation_and_both_plots(page: Page, site: Site) -> None:
    page.goto(f"{site.url}/runs/{site.finished_id}")
    expect(page.locator("#rec-micro-batch")).to_have_text("8")
    expect(page.locator("#rec-accumulation")).to_have_text("4")
    memory = page.locator("#memory-plot svg")
    expect(memory).to_be_visible()
    # The stored result's six attempts: three fit, three ran out of memory; and the two points
    # its checkpointed mode's trace predicted.
    expect(memory.locator(".point:not(.square)")).to_have_count(6)
    expect(memory.locator(".point.cross")).to_have_count(3)
    expect(memory.locator(".point.square")).to_have_count(2)
    expect(memory.locator("polyline.fit-line")).to_have_count(2)
    expect(memory.locator(".rule.capacity")).to_have_count(1)
    expect(memory.locator(".rule.headroom")).to_have_count(1)
    throughput = page.locator("#throughput-plot svg")
    expect(throughput.locator(".point")).to_have_count(2)
    expect(throughput.locator('.point[data-chosen="true"]')).to_have_count(1)
    expect(page.locator("#attempts tbody tr")).to_have_count(6)
    expect(page.locator("#trials tbody tr")).to_have_count(2)


def test_a_copy_button_puts_the_export_on_the_clipboard(
    context: BrowserContext, page: Page, site: Site
) -> None:
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=site.url)
    run = site.user.get_run(site.finished_id)
    assert run.exports is not None
    expected = render_exports(run.exports)["deepspeed"]
    page.goto(f"{site.url}/runs/{site.finished_id}")
    page.get_by_text("DeepSpeed", exact=True).click()  # open its section
    button = page.get_by_role("button", name="Copy the DeepSpeed settings")
    button.focus()
    page.keyboard.press("Enter")  # by keyboard, as anyone without a mouse would
    expect(button.locator("xpath=..").locator(".copied")).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == expected


def test_an_unfinished_runs_page_follows_the_worker_without_reloading(
    page: Page, site: Site
) -> None:
    spec = tiny_spec(66)
    run_id = site.user.submit_run(spec, emulated()).id
    page.goto(f"{site.url}/runs/{run_id}")
    expect(page.locator("#run-status")).to_have_text("queued")
    page.evaluate("window.sameDocument = true")
    claim = site.worker.claim("w2", [emulated_device()])
    assert claim is not None and claim.run_id == run_id
    expect(page.locator("#run-status")).to_have_text("running")
    site.worker.post_attempt(
        run_id, claim.lease_id, sequence=0, checkpointing=False, attempt=attempt(1, True)
    )
    expect(page.locator("#attempts tbody tr")).to_have_count(1)
    expect(page.locator("#memory-plot .point")).to_have_count(1)
    site.worker.post_trial(run_id, claim.lease_id, trial(0))
    expect(page.locator("#trials tbody tr")).to_have_count(1)
    site.worker.submit_result(run_id, claim.lease_id, tune_result(spec, emulated_device()))
    expect(page.locator("#run-status")).to_have_text("succeeded")
    expect(page.locator("#rec-micro-batch")).to_have_text("8")
    assert page.evaluate("window.sameDocument") is True


def test_a_bad_token_is_told_so_and_a_good_one_opens_the_runs(
    browser: Browser, site: Site
) -> None:
    profile = browser.new_context()
    profile.set_default_timeout(TIMEOUT_MS)
    try:
        page = profile.new_page()
        page.goto(f"{site.url}/runs/{site.finished_id}")
        expect(page.get_by_role("alert")).to_contain_text("Enter a client token")
        page.get_by_label("Token").fill("a-token-this-server-never-issued")
        page.get_by_role("button", name="Save token").click()
        expect(page.get_by_role("alert")).to_have_text(
            "That token is not known to this server. Check it and try again."
        )
        page.get_by_label("Token").fill(CLIENT_TOKEN)
        page.get_by_role("button", name="Save token").click()
        expect(page.locator("h1")).to_contain_text(f"Run #{site.finished_id}")
        assert CLIENT_TOKEN not in page.content()
        assert page.evaluate("document.cookie") == ""  # HttpOnly: no script reads it
    finally:
        profile.close()


@pytest.mark.e2e
def test_a_phone_screen_scrolls_the_tables_not_the_page(browser: Browser, site: Site) -> None:
    phone = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True)
    phone.add_cookies([{"name": TOKEN_COOKIE, "value": CLIENT_TOKEN, "url": site.url}])
    try:
        page = phone.new_page()
        for path in ("/", f"/runs/{site.finished_id}", "/submit"):
            page.goto(f"{site.url}{path}")
            overflow = page.evaluate(
                "document.documentElement.scrollWidth - document.documentElement.clientWidth"
            )
            assert overflow <= 0, f"{path} scrolls sideways by {overflow}px"
        width = page.evaluate("document.querySelector('textarea').getBoundingClientRect().width")
        assert 300 < width <= 390
    finally:
        phone.close()


def test_submitting_a_spec_opens_its_run_page(page: Page, site: Site) -> None:
    page.goto(f"{site.url}/submit")
    spec = "model:\n  preset: gpt2-tiny\ntraining:\n  seq_len: 67\n  target_global_batch: 32\n"
    page.get_by_label("Spec").fill(spec.replace("67", "0"))
    page.get_by_role("button", name="Submit").click()
    expect(page.get_by_role("alert")).to_contain_text("spec.training.seq_len")
    page.get_by_label("Spec").fill(spec)
    page.get_by_role("button", name="Submit").click()
    expect(page.locator("#run-status")).to_have_text("queued")
    run_id = int(re.findall(r"/runs/(\d+)$", page.url)[0])
    assert site.user.get_run(run_id).spec.training.seq_len == 67
    site.user.cancel_run(run_id)  # the other tests' worker claims only their own runs


def test_every_page_passes_axe(context: BrowserContext, page: Page, site: Site) -> None:
    """axe-core's accessibility rules (WCAG 2.x A and AA: names, labels, contrast, landmarks,
    table headers...) on every kind of page, in light and dark colours."""
    axe = Axe()
    paths = ["/", f"/runs/{site.finished_id}", "/submit", "/token", "/runs/999999"]
    for scheme in ("light", "dark"):
        page.emulate_media(color_scheme=scheme)
        for path in paths:
            page.goto(f"{site.url}{path}")
            results = axe.run(page)
            assert results.violations_count == 0, f"{scheme} {path}:\n{results.generate_report()}"


def test_screenshot_paths_exist_in_the_docs() -> None:
    """The README shows the two screenshots tests/screenshots.py takes with these pages."""
    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    for name in ("runs-list.png", "run-page.png"):
        assert (root / "docs" / "images" / name).stat().st_size > 10_000
        assert f"docs/images/{name}" in readme
