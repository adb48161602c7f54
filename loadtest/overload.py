"""Overload probe: many concurrent clients with long contexts against one server; how fast is "no"?

A server past its capacity must shed at once (429 + ``Retry-After``), keep memory bounded and
never answer 5xx. This drives ``clients`` closed-loop asyncio clients (one connection each) that
post long-context questions for ``duration_s`` seconds; after a 429 or 503 a client waits what
``Retry-After`` says (``honor_retry_after``, as well-behaved clients do) or only
``pause_after_429_s`` (an impatient one), and sends again. Meanwhile it samples the server's
resident memory (the frontend process and its worker ranks) from ``/proc``::

    report = asyncio.run(run_overload(OverloadConfig(url="http://127.0.0.1:8000", pid=server_pid)))
    report.latency_ms(429, 99)   # p99 of the 429 answers, as the clients saw them
    report.rss_growth_mb          # peak RSS during the run minus RSS before it
    report.server_latencies_ms = access_log_latencies(log_text)   # the server's own view
    report.latency_ms(429, 99, server=True)

The server-side latencies come from its access log (``--log-level INFO``: from the request
reaching the app to its answer); the client-side ones add the wait for the event loop and the
load generator's own time on the shared cores.

Used by ``benchmarks/bench_overload.py`` (figures in docs/benchmarks.md) and the acceptance test
``tests/serving/test_overload.py``. Plain asyncio streams (``loadtest/http11.py``'s minimal HTTP/1.1
client): with 256 httpx clients the load generator itself, sharing the cores with the server,
delayed sending the bodies by seconds and the latencies were its own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from shardserve.loadtest.http11 import KEEPALIVE_EXPIRY_S, post_request, read_response

logger = logging.getLogger(__name__)

FILLER = (
    "The committee met again in the spring to review the harbour accounts, and the minutes record "
    "a long discussion of tariffs, ledgers and the repair of the northern pier. "
)
QUESTION = "In which city was the observatory built?"
FACT = "The observatory was built in Valparaiso in 1843. "


def long_context(chars: int) -> str:
    """About ``chars`` characters of filler with one answerable fact in the middle."""
    half = FILLER * max(1, chars // (2 * len(FILLER)))
    return half + FACT + half


@dataclass(frozen=True)
class OverloadConfig:
    """Knobs of one overload run; validated once, errors print the numbers."""

    url: str  # the server's base URL, e.g. http://127.0.0.1:8000
    pid: int | None = None  # the server's process id (RSS sampling); None: no memory figures
    clients: int = 256
    duration_s: float = 20.0
    context_chars: int = 20_000
    client_timeout_s: float = 120.0  # client-side timeout of one request (the server's deadline is its own)
    honor_retry_after: bool = True
    pause_after_429_s: float = 0.05  # the wait after a 429/503 when Retry-After is not honoured
    sample_every_s: float = 0.25

    def __post_init__(self) -> None:
        problems = [
            f"{name}={getattr(self, name)!r} must be > 0"
            for name in ("clients", "duration_s", "context_chars", "client_timeout_s", "sample_every_s")
            if getattr(self, name) <= 0
        ]
        if self.pause_after_429_s < 0:
            problems.append(f"pause_after_429_s={self.pause_after_429_s!r} must be >= 0")
        if problems:
            raise ValueError("invalid OverloadConfig: " + "; ".join(problems))


@dataclass
class OverloadReport:
    """What the clients saw and what the server's memory did."""

    latencies_ms: dict[int, list[float]] = field(default_factory=dict)  # HTTP status -> latencies
    server_latencies_ms: dict[int, list[float]] = field(default_factory=dict)  # from the access log
    transport_errors: Counter[str] = field(default_factory=Counter)  # exception name -> count
    missing_retry_after: int = 0  # 429/503 answers without a Retry-After header
    rss_before_mb: float | None = None
    rss_peak_mb: float | None = None
    rss_after_mb: float | None = None
    wall_s: float = 0.0

    def count(self, status: int) -> int:
        return len(self.latencies_ms.get(status, []))

    def latency_ms(self, status: int, percentile: float, *, server: bool = False) -> float | None:
        """Nearest-rank percentile of the latencies of answers with ``status`` (None: none seen),
        as the clients saw them or (``server``) as the server's access log gives them."""
        values = sorted((self.server_latencies_ms if server else self.latencies_ms).get(status, []))
        if not values:
            return None
        return values[max(0, math.ceil(percentile / 100 * len(values)) - 1)]

    @property
    def rss_growth_mb(self) -> float | None:
        if self.rss_before_mb is None or self.rss_peak_mb is None:
            return None
        return self.rss_peak_mb - self.rss_before_mb

    @property
    def server_errors(self) -> int:
        return sum(len(v) for status, v in self.latencies_ms.items() if status >= 500 and status != 503)

    def summary(self) -> dict[str, object]:
        """A JSON-ready summary: counts and p50/p99 per status, memory figures."""

        def table(latencies: dict[int, list[float]], server: bool) -> dict[str, dict[str, float | None]]:
            return {
                str(status): {
                    "count": len(latencies[status]),
                    "p50_ms": _round(self.latency_ms(status, 50, server=server)),
                    "p99_ms": _round(self.latency_ms(status, 99, server=server)),
                    "max_ms": _round(max(latencies[status])),
                }
                for status in sorted(latencies)
            }

        return {
            "statuses": table(self.latencies_ms, False),
            "server_statuses": table(self.server_latencies_ms, True),
            "transport_errors": dict(self.transport_errors),
            "missing_retry_after": self.missing_retry_after,
            "rss_before_mb": _round(self.rss_before_mb),
            "rss_peak_mb": _round(self.rss_peak_mb),
            "rss_after_mb": _round(self.rss_after_mb),
            "rss_growth_mb": _round(self.rss_growth_mb),
            "wall_s": _round(self.wall_s),
        }


_ACCESS_LINE = re.compile(r"method=POST path=(\S+) status=(\d+) latency_ms=([\d.]+)")


def access_log_latencies(log_text: str, *, path: str = "/v1/qa") -> dict[int, list[float]]:
    """HTTP status -> latencies (ms) of the POSTs to ``path`` in a shardserve access log."""
    out: dict[int, list[float]] = {}
    for m in _ACCESS_LINE.finditer(log_text):
        if m.group(1) == path:
            out.setdefault(int(m.group(2)), []).append(float(m.group(3)))
    return out


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def process_tree(pid: int) -> list[int]:
    """``pid`` followed by all its descendants, read from /proc (parent ids)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the process went away
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


def tree_rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and all its descendants (MiB), read from /proc."""
    total_kb = 0
    for p in process_tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kb += int(line.split()[1])
        except OSError:
            continue
    return total_kb / 1024


async def _client(cfg: OverloadConfig, request: bytes, stop_at: float, report: OverloadReport) -> None:
    """One closed-loop client on one keep-alive connection (plain asyncio streams: a minimal
    HTTP/1.1 client, so the load generator's own CPU stays small next to the server's)."""
    url = urlsplit(cfg.url)
    reader: asyncio.StreamReader | None = None
    writer: asyncio.StreamWriter | None = None
    last_used = 0.0
    try:
        while time.monotonic() < stop_at:
            if writer is not None and time.monotonic() - last_used > KEEPALIVE_EXPIRY_S:
                writer.close()  # before the server's keep-alive timeout closes it under us
                writer = None
            t0 = time.perf_counter()
            try:
                if writer is None:
                    reader, writer = await asyncio.open_connection(url.hostname, url.port or 80)
                assert reader is not None
                writer.write(request)
                await writer.drain()
                status, headers, _ = await asyncio.wait_for(read_response(reader), cfg.client_timeout_s)
            except (OSError, EOFError, TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
                report.transport_errors[type(exc).__name__] += 1
                if writer is not None:
                    writer.close()
                writer = None
                continue
            last_used = time.monotonic()
            report.latencies_ms.setdefault(status, []).append((time.perf_counter() - t0) * 1000)
            if headers.get("connection") == "close":
                writer.close()
                writer = None
            if status in (429, 503):
                retry_after = headers.get("retry-after")
                if retry_after is None:
                    report.missing_retry_after += 1
                wait = float(retry_after) if cfg.honor_retry_after and retry_after else cfg.pause_after_429_s
                await asyncio.sleep(min(wait, max(0.0, stop_at - time.monotonic())))
    finally:
        if writer is not None:
            writer.close()


async def _sample_rss(pid: int, every_s: float, report: OverloadReport, stop: asyncio.Event) -> None:
    while not stop.is_set():
        rss = await asyncio.to_thread(tree_rss_mb, pid)
        report.rss_peak_mb = max(report.rss_peak_mb or 0.0, rss)
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except TimeoutError:
            pass


async def run_overload(cfg: OverloadConfig, *, headers: dict[str, str] | None = None) -> OverloadReport:
    """Run the overload for ``cfg.duration_s`` seconds and return what was seen."""
    report = OverloadReport()
    body = json.dumps({"question": QUESTION, "context": long_context(cfg.context_chars)}).encode()
    request = post_request(cfg.url, "/v1/qa", body, headers)
    stop = asyncio.Event()
    sampler = None
    if cfg.pid is not None:
        report.rss_before_mb = tree_rss_mb(cfg.pid)
        sampler = asyncio.create_task(_sample_rss(cfg.pid, cfg.sample_every_s, report, stop))
    t0 = time.monotonic()
    stop_at = t0 + cfg.duration_s
    await asyncio.gather(*(_client(cfg, request, stop_at, report) for _ in range(cfg.clients)))
    report.wall_s = time.monotonic() - t0
    stop.set()
    if sampler is not None:
        await sampler
        report.rss_after_mb = tree_rss_mb(cfg.pid)
    logger.info("overload: %s", report.summary())
    return report
