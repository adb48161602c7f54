"""The status page, the QA playground and /docs + /redoc in a real headless Chromium, offline.

A real server (the shipped ``default`` QA model, one gang of pp=2 worker processes) runs under
uvicorn on 127.0.0.1; Playwright drives Debian's ``chromium`` (``apt-get install chromium``; no
``playwright install``). Every request the browser makes is intercepted: one that leaves the
server's own origin is aborted and fails the test. Screenshots go to the test's tmp folder;
``SHARDSERVE_UPDATE_SCREENSHOTS=1`` also refreshes ``docs/images/status-page.png``.

Run: python -m pytest tests/serving/frontend/status/test_ui_browser.py -q      (~40 s on 2 cores; skips without chromium)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from shardserve.partitioner.runtime.fake_gang import FakeFactory
from shardserve.serving.frontend.app import build_app
from shardserve.serving.frontend.settings import ServeSettings
from tests.serving.live import live_server

CHROMIUM = os.environ.get("SHARDSERVE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    pytest.skip(
        f"Chromium is not installed ({CHROMIUM} missing): apt-get install chromium", allow_module_level=True
    )
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (pip install -e .[test])"
)

REPO = Path(__file__).resolve().parents[3]
# the README's example (its curl command)
QUESTION = "Who won Super Bowl 50?"
CONTEXT = "The Denver Broncos defeated the Carolina Panthers 24-10 to win Super Bowl 50."
API_KEY = "page-key-123"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _live(settings: ServeSettings, **build: Any) -> Iterator[str]:
    """The app on a real socket; yields the base URL once /readyz is 200 (a gang may take a while)."""
    with live_server(build_app(settings, **build), ready_timeout_s=180, join_timeout_s=60) as base:
        yield base


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """The default QA model in one gang of two pipeline stages (real worker processes)."""
    settings = ServeSettings(
        model="default", pp=2, replicas=1, cpu_slots=2, threads_per_rank=1, max_queue_delay_ms=1.0
    )
    with _live(settings) as base:
        yield base


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            yield b
        finally:
            b.close()


class Offline:
    """A browser page whose requests may only go to ``base``; anything else is aborted and noted."""

    def __init__(self, browser: Any, base: str) -> None:
        self.base = base
        self.seen: list[str] = []
        self.external: list[str] = []
        self.context = browser.new_context(viewport={"width": 1400, "height": 1000})
        self.context.route("**/*", self._route)
        self.page = self.context.new_page()
        self.console_errors: list[str] = []
        self.page.on("console", lambda m: self.console_errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.console_errors.append(str(e)))

    def _route(self, route: Any) -> None:
        url = route.request.url
        self.seen.append(url)
        if url == self.base or url.startswith(self.base + "/"):
            route.continue_()
        else:
            self.external.append(url)
            route.abort()

    def check(self, *, refused_by_csp: tuple[str, ...] = ()) -> None:
        """No request left the origin, no error in the page but the CSP refusing ``refused_by_csp``
        (URLs the browser did not fetch because the page's Content-Security-Policy forbids them)."""
        assert self.seen, "the browser made no request at all"
        assert not self.external, f"requests left the server's origin: {self.external}"
        errors = [
            e
            for e in self.console_errors
            if not ("Content Security Policy" in e and any(url in e for url in refused_by_csp))
        ]
        assert not errors, f"errors in the page: {errors}"

    def close(self) -> None:
        self.context.close()

    def __enter__(self) -> Offline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture
def offline(browser: Any, server: str) -> Iterator[Offline]:
    with Offline(browser, server) as o:
        yield o


def _cell(page: Any, table: str, row: int, col: int) -> str:
    return page.locator(f"#{table} tbody tr").nth(row).locator("td").nth(col).inner_text()


def test_status_page_shows_a_ready_gang_and_moves_with_traffic(
    offline: Offline, server: str, tmp_path: Path
) -> None:
    page = offline.page
    page.goto(f"{server}/")
    page.wait_for_selector("#state[data-state='ready']", timeout=15000)
    page.wait_for_selector("#replicas tbody .badge[data-state='ready']", timeout=15000)
    assert page.locator("#plan tbody tr").count() == 2  # pp=2: two stages, layers split between them
    assert "pp=2" in page.locator("#model").inner_text()
    assert "default" in page.locator("#model-name").inner_text()
    assert _cell(page, "replicas", 0, 1) == "default"  # the model the gang serves
    assert _cell(page, "models", 0, 0) == "default" and _cell(page, "models", 0, 1) == "READY"
    ranks = _cell(page, "replicas", 0, 4)
    assert "0 (0/0): pid " in ranks and "1 (1/0): pid " in ranks, ranks  # pids as the ranks report them
    assert _cell(page, "replicas", 0, 3) == socket.gethostname()  # where the ranks say they run
    assert _cell(page, "replicas", 0, 5) == "0"  # this gang's own restarts
    page.screenshot(path=str(tmp_path / "status-before.png"), full_page=True)
    before = int(_cell(page, "windows", 0, 1))
    assert "—" in _cell(page, "windows", 0, 4)  # no request yet: percentiles shown as not measured

    with httpx.Client(base_url=server, timeout=30) as client:
        for i in range(12):
            r = client.post("/v1/qa", json={"question": QUESTION, "context": CONTEXT + " " * i, "top_k": 2})
            assert r.status_code == 200, r.text
    page.wait_for_function(
        "n => Number(document.querySelector('#windows tbody tr td:nth-child(2)').textContent) >= n",
        arg=before + 12,
        timeout=15000,
    )
    latency = _cell(page, "windows", 0, 4)
    assert latency.endswith(" ms") and "—" not in latency, latency  # p50/p95/p99 now measured
    assert float(_cell(page, "windows", 0, 2)) > 0  # answers / s over the last minute
    page.wait_for_function(
        "() => [...document.querySelectorAll('#stages tbody tr td:nth-child(3)')].some(td => Number(td.textContent) > 0)",
        timeout=15000,
    )  # stage busy time sampled from the gang's ranks
    page.screenshot(path=str(tmp_path / "status-after.png"), full_page=True)
    offline.check()


def test_playground_answers_the_readme_question_with_the_span_highlighted(
    offline: Offline, server: str, tmp_path: Path
) -> None:
    page = offline.page
    page.goto(f"{server}/")
    page.wait_for_selector("#state[data-state='ready']", timeout=15000)
    assert page.locator("#api-key-row").is_hidden()  # this server has no --api-key
    page.fill("#question", QUESTION)
    page.fill("#context", CONTEXT)
    page.fill("#top-k", "3")
    page.click("#ask")
    best = page.wait_for_selector("#highlighted mark.rank-1", timeout=15000)
    assert best.inner_text() == "Denver Broncos"
    assert page.locator("#highlighted").inner_text() == CONTEXT  # the marks wrap the context, unchanged
    assert page.locator("#answers tbody tr").count() == 3
    assert _cell(page, "answers", 0, 1) == "Denver Broncos"
    assert 0 < float(_cell(page, "answers", 0, 2)) <= 1
    meta = page.locator("#qa-meta").inner_text()
    assert "1 window(s)" in meta and "ms on the server" in meta, meta
    # offsets count code points: emoji (two UTF-16 units each in the page) must not shift the mark
    page.fill("#context", "\U0001f600\U0001f3c8 " + CONTEXT)
    page.click("#ask")
    page.wait_for_function("() => document.querySelector('#qa-meta').textContent.includes('window')")
    page.wait_for_function(
        "() => document.querySelector('#highlighted').textContent.startsWith('\\u{1f600}')", timeout=15000
    )
    assert page.locator("#highlighted mark.rank-1").inner_text() == "Denver Broncos"
    page.fill("#context", CONTEXT)
    page.click("#ask")
    page.wait_for_function(
        "() => document.querySelector('#highlighted').textContent.startsWith('The')", timeout=15000
    )
    page.wait_for_timeout(2500)  # one more poll: the status sections show this request too
    shot = tmp_path / "status-page.png"
    page.screenshot(path=str(shot), full_page=True)
    if os.environ.get("SHARDSERVE_UPDATE_SCREENSHOTS") == "1":
        shutil.copyfile(shot, REPO / "docs" / "images" / "status-page.png")
    offline.check()


def test_docs_and_redoc_render_offline(offline: Offline, server: str, tmp_path: Path) -> None:
    page = offline.page
    page.goto(f"{server}/docs")
    page.wait_for_selector(".swagger-ui .information-container .title", timeout=20000)
    assert "shardserve" in page.locator(".swagger-ui .information-container .title").inner_text()
    page.wait_for_selector(".opblock-summary-path[data-path='/v1/qa']", timeout=20000)
    page.screenshot(path=str(tmp_path / "docs.png"))
    page.goto(f"{server}/redoc")
    page.wait_for_selector("h1:has-text('shardserve')", timeout=20000)
    page.wait_for_selector("[data-section-id^='tag/'], [data-section-id^='operation/']", timeout=20000)
    page.screenshot(path=str(tmp_path / "redoc.png"))
    # ReDoc 2.x always adds a Redocly logo from its CDN: the page's CSP refuses it (never fetched)
    offline.check(refused_by_csp=("https://cdn.redoc.ly/",))


def test_playground_sends_the_api_key_the_server_asks_for(browser: Any, tmp_path: Path) -> None:
    """With --api-key the page shows the key field; without the key the answer is the 401's message,
    with it the playground answers (fake in-process gang: the span is real, the model random)."""
    settings = ServeSettings(model="tiny-bert", replicas=1, api_key=API_KEY, max_queue_delay_ms=1.0)
    factory = FakeFactory()
    factory.gate.set()
    with _live(settings, backend_factory=factory) as base:
        with Offline(browser, base) as o:
            page = o.page
            page.goto(f"{base}/")
            page.wait_for_selector("#state[data-state='ready']", timeout=15000)
            assert page.locator("#api-key-row").is_visible()
            page.click("#ask")
            page.wait_for_selector("#qa-error:not([hidden])", timeout=15000)
            assert "401" in page.locator("#qa-error").inner_text()
            page.fill("#api-key", API_KEY)
            page.click("#ask")
            page.wait_for_selector("#highlighted mark.rank-1", timeout=15000)
            assert page.locator("#qa-error").is_hidden()
            assert page.locator("#highlighted mark.rank-1").inner_text() == _cell(page, "answers", 0, 1)
            page.screenshot(path=str(tmp_path / "playground-api-key.png"), full_page=True)
            o.console_errors = [e for e in o.console_errors if "401" not in e]  # the refused request
            o.check()


def test_status_page_shows_the_placement_of_models_sharing_devices(browser: Any, tmp_path: Path) -> None:
    """With --placement the page shows the device groups, each one's split and models, and the
    simulated attainment it was chosen by (fake in-process gangs)."""
    settings = ServeSettings(
        model=["a=tiny-bert", "b=tiny-bert"], placement="multiplexed", devices=2, threads_per_rank=1
    )
    with _live(settings, backend_factory=FakeFactory()) as base:
        with Offline(browser, base) as o:
            page = o.page
            page.goto(f"{base}/")
            page.wait_for_selector("#placement tbody tr", timeout=15000)
            assert page.locator("#placement-section").is_visible()
            assert [_cell(page, "placement", 0, c) for c in (1, 2, 3)] == ["0, 1", "2 × 1", "a, b"]
            assert "(running)" in _cell(page, "placement", 0, 4)
            assert "multiplexed over 2 devices" in page.locator("#placement-summary").inner_text()
            assert "predicted SLO attainment" in page.locator("#placement-summary").inner_text()
            page.screenshot(path=str(tmp_path / "placement.png"), full_page=True)
            o.check()
