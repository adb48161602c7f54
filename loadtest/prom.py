"""Scrape the server's Prometheus ``/metrics`` during a load test: a tiny text-format parser, metric
selectors, and a background scraper thread writing ``metrics.csv``.

The metric names are the server's (``serving/metrics.py``); they are configurable here, and a
metric that is missing yields an empty value (NaN), never a crash::

    sel = MetricSelector.parse('shardserve_replicas{state="ready"}')
    sel.value(parse_prometheus_text(text))      # sum of the matching samples, NaN if none

    scraper = MetricsScraper(url="http://127.0.0.1:8000/metrics", selectors={...}, out_csv=path)
    scraper.start(); ...; scraper.stop()

Tests: ``tests/loadtest/test_prom.py``.
"""

from __future__ import annotations

import csv
import logging
import math
import re
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def _parse_labels(text: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    pos = 0
    while pos < len(text):
        m = _LABEL.match(text, pos)
        if not m:
            break
        labels[m.group(1)] = m.group(2).replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
        pos = m.end()
    return labels


def parse_prometheus_text(text: str) -> list[Sample]:
    """Samples of a Prometheus text exposition; comments and malformed lines are skipped."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        samples.append(Sample(m.group(1), _parse_labels(m.group(3) or ""), value))
    return samples


@dataclass(frozen=True)
class MetricSelector:
    """``name`` or ``name{label="value",...}``: the sum of the samples that match."""

    name: str
    labels: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> MetricSelector:
        m = re.match(r"^\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{(.*)\})?\s*$", text)
        if not m:
            raise ValueError(f'metric selector {text!r} is not NAME or NAME{{label="value"}}')
        return cls(m.group(1), _parse_labels(m.group(3) or ""))

    def value(self, samples: list[Sample]) -> float:
        matched = [
            s.value
            for s in samples
            if s.name == self.name and all(s.labels.get(k) == v for k, v in self.labels.items())
        ]
        return math.fsum(matched) if matched else math.nan

    def __str__(self) -> str:
        if not self.labels:
            return self.name
        inner = ",".join(f'{k}="{v}"' for k, v in sorted(self.labels.items()))
        return f"{self.name}{{{inner}}}"


def fetch_text(url: str, *, timeout_s: float = 2.0) -> str | None:
    """GET ``url`` as text; None (logged) on any connection or HTTP error."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        logger.debug("scrape %s failed: %s", url, exc)
        return None


class MetricsScraper:
    """Background thread: every ``interval_s`` scrape ``url`` and append one CSV row.

    Columns: ``time`` (epoch s), ``ok`` (1 if the scrape answered), then one per selector key.
    """

    def __init__(
        self, *, url: str, selectors: dict[str, MetricSelector], out_csv: str | Path, interval_s: float = 1.0
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s={interval_s} must be > 0")
        self.url = url
        self.selectors = dict(selectors)
        self.out_csv = Path(out_csv)
        self.interval_s = interval_s
        self.rows = 0
        self.failures = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def scrape_once(self, writer: csv.writer) -> None:
        now = time.time()
        text = fetch_text(self.url)
        samples = parse_prometheus_text(text) if text is not None else []
        if text is None:
            self.failures += 1
        values = [sel.value(samples) for sel in self.selectors.values()]
        writer.writerow([f"{now:.3f}", int(text is not None), *[f"{v:.6g}" for v in values]])
        self.rows += 1

    def _run(self) -> None:
        with open(self.out_csv, "w", newline="", encoding="utf-8") as fh:
            writer = csv.writer(fh)
            writer.writerow(["time", "ok", *self.selectors])
            while True:
                started = time.monotonic()
                self.scrape_once(writer)
                fh.flush()
                if self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started))):
                    break

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("scraper already started")
        self._thread = threading.Thread(target=self._run, name="metrics-scraper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        logger.info("scraped %s: %d rows, %d failed", self.url, self.rows, self.failures)
