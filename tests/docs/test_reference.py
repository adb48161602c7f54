"""docs/reference/ is what the code generates (``shardserve/reference.py``), and the generator sees the code.

Run: python -m pytest tests/docs/test_reference.py -q        (~5 s)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shardserve import reference
from shardserve.cli import COMMANDS
from shardserve.flags import flag
from shardserve.serving.frontend.settings import ServeSettings
from shardserve.serving.metrics import ServingMetrics


@pytest.fixture(autouse=True)
def _no_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pages show the code's defaults, not this shell's SHARDSERVE_* variables."""
    import os

    for name in [n for n in os.environ if n.startswith("SHARDSERVE_")]:
        monkeypatch.delenv(name)


def test_the_committed_pages_are_what_the_code_generates() -> None:
    stale = reference.stale_pages()
    assert not stale, f"stale reference pages {stale}: run python -m shardserve.reference and commit docs/reference/"


def test_a_changed_page_is_found_stale(tmp_path: Path) -> None:
    assert reference.main(["--out", str(tmp_path)]) == 0
    assert reference.stale_pages(tmp_path) == []
    page = tmp_path / "cli.md"
    page.write_text(page.read_text().replace("--max-seq-len", "--max-sequence-length"))
    assert reference.stale_pages(tmp_path) == ["cli.md"]
    assert reference.main(["--check", "--out", str(tmp_path)]) == 1


def test_the_cli_page_has_every_command_and_every_serve_field() -> None:
    page = reference.cli_page()
    for command in COMMANDS:
        assert f"## shardserve {command.name}\n" in page
    serve = page.split("## shardserve serve\n")[1].split("\n## ")[0]
    missing = [name for name in ServeSettings.model_fields if f"`{flag(name)}`" not in serve]
    assert not missing, f"serve flags missing from the page: {missing}"


def test_the_http_pages_have_every_route_and_schema() -> None:
    spec = reference._openapi()
    routes, schemas = reference.http_page(), reference.schemas_page()
    for path, ops in spec["paths"].items():
        for method in ops:
            assert f"## {method.upper()} {path}\n" in routes
    for name in spec["components"]["schemas"]:
        assert f"## {name}\n" in schemas
    assert "`/v1/qa`" in routes and "`question`" in schemas


def test_the_metrics_page_has_every_series_with_its_labels() -> None:
    page = reference.metrics_page()
    names = {f.name for f in ServingMetrics().registry.collect()}
    assert names and all(f"`{n}" in page for n in names)
    row = next(line for line in page.splitlines() if line.startswith("| `shardserve_requests_total`"))
    assert "`model`, `endpoint`, `status`" in row
