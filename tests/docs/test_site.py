"""The docs site builds with ``mkdocs build --strict`` and reads in a real browser, offline, with search.

The site (mkdocs.yml, docs/) is built into a temporary folder; a broken link, a bad anchor or a page
missing from the files fails the build. Then a static file server on 127.0.0.1 serves it and
Playwright drives Debian's ``chromium`` (``apt-get install chromium``): the home page and a guide
render with their navigation, the search box finds a guide, and no request leaves the origin
(no web fonts, no CDN).

Run: python -m pytest tests/docs/test_site.py -q         (~15 s; the browser part skips without chromium)
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("SHARDSERVE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"


def _build(root: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        # not --quiet: with it, mkdocs 1.6 exits 0 although --strict aborted on a warning
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=root, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = _build(REPO, out)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    return out


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    """The build above would pass on a site that hides its warnings: a bad link must fail it."""
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    with (tmp_path / "docs" / "index.md").open("a") as page:
        page.write("\nSee [a page that is not there](guides/nowhere.md).\n")
    done = _build(tmp_path, tmp_path / "site")
    assert done.returncode != 0 and "nowhere.md" in done.stdout + done.stderr


def test_the_readme_links_into_files_that_exist() -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (REPO / "README.md").read_text())
    local = [link for link in links if "://" not in link]
    assert local, "the README links to no page of the docs"
    missing = [link for link in local if not (REPO / link).is_file()]
    assert not missing, f"README links to missing files: {missing}"


def test_every_page_of_the_docs_is_built_and_short(site: Path) -> None:
    pages = sorted(p.relative_to(REPO / "docs") for p in (REPO / "docs").rglob("*.md"))
    for page in pages:
        built = site / page.with_suffix("") / "index.html" if page.name != "index.md" else site / page.with_name("index.html")
        assert built.is_file(), f"{page} was not built"
    long = {str(p): n for p in pages if (n := len((REPO / "docs" / p).read_text().splitlines())) > 600}
    assert not long, f"docs pages over 600 lines: {long}"
    assert len((REPO / "README.md").read_text().splitlines()) <= 150


@pytest.fixture(scope="module")
def base(site: Path) -> Iterator[str]:
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def page(base: str) -> Iterator[tuple[Any, list[str], list[str]]]:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"Chromium is not installed ({CHROMIUM} missing): apt-get install chromium")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e .[test])")
    external: list[str] = []
    errors: list[str] = []

    def route(r: Any) -> None:
        if r.request.url.startswith(base + "/"):
            r.continue_()
        else:
            external.append(r.request.url)
            r.abort()

    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            context = browser.new_context(viewport={"width": 1300, "height": 900})
            context.route("**/*", route)
            p = context.new_page()
            p.on("pageerror", lambda e: errors.append(str(e)))
            yield p, external, errors
        finally:
            browser.close()


def test_home_page_and_a_guide_render_offline(page: tuple[Any, list[str], list[str]], base: str) -> None:
    p, external, errors = page
    p.goto(f"{base}/")
    assert "shardserve" in p.title()
    nav = p.locator("nav.md-nav--primary").inner_text()
    assert all(word in nav for word in ("Getting started", "Guides", "Reference", "Benchmarks"))
    p.goto(f"{base}/guides/serving/")
    assert p.locator("article h1").first.inner_text().strip()
    assert p.locator("article pre code").count() > 0, "the serving guide shows no command"
    p.goto(f"{base}/reference/cli/")
    assert p.locator("article table").count() > 5
    assert not external, f"requests left the site: {external}"
    assert not errors, f"errors in the page: {errors}"


def test_search_finds_a_guide(page: tuple[Any, list[str], list[str]], base: str) -> None:
    p, external, errors = page
    p.goto(f"{base}/")
    box = p.locator("input.md-search__input")
    box.click()
    box.fill("pipeline")
    results = p.locator(".md-search-result__item")
    results.first.wait_for(timeout=15000)
    links = [results.nth(i).locator("a").first.get_attribute("href") or "" for i in range(results.count())]
    assert any("guides/" in href for href in links), f"the search found no guide: {links}"
    assert not external and not errors
