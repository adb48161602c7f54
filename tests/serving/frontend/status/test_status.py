"""GET /ui/status (the status page's JSON) and the offline pages, without a browser: the numbers come
from the /metrics registry, unmeasured ones are null, replica failures and admin decisions show up,
the page and /docs + /redoc reference only local assets, and /ui/openapi.json matches the route
(schemathesis ``--checks all``).

Run: python -m pytest tests/serving/frontend/status/test_status.py -q      (fake gangs; ~20 s, most of it schemathesis)
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Histogram

from shardserve.serving.frontend.status.board import buckets, histogram_quantile, read_registry
from tests.serving.frontend.api_helpers import TOKEN, ask, serving, wait_until
from tests.serving.frontend.http.test_openapi import _report, live_server, run_schemathesis  # noqa: F401

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    r = CollectorRegistry()
    h = Histogram("lat_seconds", "x", buckets=(0.1, 0.2, 0.4), registry=r)
    for v in (0.05, 0.15, 0.15, 0.3):
        h.observe(v)
    cumulative = buckets(read_registry(r), "lat_seconds")
    assert cumulative == [(0.1, 1.0), (0.2, 3.0), (0.4, 4.0), (float("inf"), 4.0)]
    assert histogram_quantile(0.5, cumulative) == 0.1 + 0.1 * (2 - 1) / (3 - 1)  # rank 2 in (0.1, 0.2]
    assert histogram_quantile(1.0, cumulative) == 0.4
    assert histogram_quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None  # no observation
    h.observe(9.0)  # only the +Inf bucket holds it: the last finite bound, as Prometheus answers
    assert histogram_quantile(0.99, buckets(read_registry(r), "lat_seconds")) == 0.4


def test_status_reads_the_metrics_registry_and_nulls_what_is_not_measured() -> None:
    with serving() as (client, _):
        s = client.get("/ui/status").json()
        assert s["state"] == "ready" and s["api_key_required"] is False
        assert s["plan"]["pp"] == 1 and len(s["plan"]["stages"]) == 1
        [r] = s["replicas"]
        assert r["state"] == "ready" and r["world_size"] == 1 and r["ranks"][0]["pid"] is not None
        assert r["ranks"][0]["host"] == "fake-host" and r["hosts"] == ["fake-host"]  # as the rank says
        assert r["restarts"] == 0 and r["replaces"] is None
        assert r["stages"][0]["busy_s"] is None and r["bubble_fraction"] is None  # fakes report no busy ranks
        last_minute = s["windows"][0]
        assert last_minute["requests"] == 0 and last_minute["latency_ms"]["p50"] is None

        for _ in range(4):
            assert ask(client).status_code == 200
        too_long = "x" * (client.app.state.settings.max_context_chars + 1)  # the route's own 422
        assert ask(client, context=too_long).status_code == 422
        s = client.get("/ui/status").json()
        w = s["windows"][0]
        metrics = client.get("/metrics").text
        served = re.search(
            r'shardserve_requests_total\{endpoint="qa",model="tiny-bert",status="200"\} (\S+)', metrics
        )
        assert served is not None and w["requests"] == 5 and float(served.group(1)) == 4.0
        assert w["error_responses"] == {"422": 1}
        assert w["answered_per_s"] > 0 and w["windows_per_s"] > 0 and w["mean_batch_windows"] == 1.0
        assert w["context_cache_hits"] == 0.75  # one context four times: tokenized once
        assert 0 < w["latency_ms"]["p50"] <= w["latency_ms"]["p95"] <= w["latency_ms"]["p99"]
        assert s["queue"]["depth_requests"] == 0 and s["queue"]["max_queue_size"] == 256


def test_status_shows_failures_restarts_errors_and_admin_decisions() -> None:
    with serving() as (client, factory):
        factory.gangs[0].kill()
        wait_until(lambda: client.get("/ui/status").json()["replica_restarts"] >= 1, what="a restart")
        s = wait_until(
            lambda: (b := client.get("/ui/status").json())["state"] == "ready" and b, what="ready again"
        )
        assert s["replica_failures"] >= 1 and s["last_failure"]
        assert any(e["level"] == "ERROR" and "failed" in e["message"] for e in s["recent_errors"])
        assert client.post("/admin/replicas", json={"replicas": 2}, headers=AUTH).status_code == 200
        a = client.get("/ui/status").json()["autoscaler"]
        assert a["target"] == 2 and a["autoscaling"] is False and a["pinned"] == 2
        assert a["recent"][-1]["source"] == "admin" and a["recent"][-1]["after"] == 2


def test_each_gang_counts_its_own_restarts() -> None:
    """Two gangs; one fails twice: its replacements carry its line's count on, the other stays at 0."""
    with serving(replicas=2) as (client, factory):
        wait_until(lambda: len(ready_gangs(client)) == 2, what="two ready gangs")
        first, other = sorted(ready_gangs(client), key=lambda r: r["id"])
        for n in (1, 2):
            victim = next(g for g in factory.gangs if g.name.endswith(f"-{first['id']}"))
            victim.kill()
            wait_until(
                lambda victim=first: (
                    len(gangs := ready_gangs(client)) == 2 and all(g["id"] != victim["id"] for g in gangs)
                ),
                what=f"restart {n}",
            )
            [first] = [g for g in ready_gangs(client) if g["id"] != other["id"]]
            assert first["restarts"] == n and first["replaces"] is not None, first
        [still] = [g for g in ready_gangs(client) if g["id"] == other["id"]]
        assert still["restarts"] == 0 and still["replaces"] is None
        s = client.get("/ui/status").json()
        assert s["replica_restarts"] == 2 == sum(g["restarts"] for g in s["replicas"])


def test_rank_hosts_and_pids_are_what_the_ranks_report() -> None:
    """Host and pid per rank come from the ranks (their heartbeats: ``rank_processes``), not from the
    server's host name or the pids of its children: a gang with ranks on other hosts shows them."""
    with serving(pp=2, cpu_slots=2) as (client, factory):
        gang = factory.gangs[0]
        gang.rank_processes = lambda: [("node-a", 4100), ("node-b", 77)]  # type: ignore[method-assign]
        [r] = client.get("/ui/status").json()["replicas"]
        assert [(k["rank"], k["stage"], k["host"], k["pid"]) for k in r["ranks"]] == [
            (0, 0, "node-a", 4100),
            (1, 1, "node-b", 77),
        ]
        assert r["hosts"] == ["node-a", "node-b"]
        gang.rank_processes = lambda: [("node-a", 4100), None]  # type: ignore[method-assign]  # rank 1 not heard
        [r] = client.get("/ui/status").json()["replicas"]
        assert r["ranks"][1]["host"] is None and r["ranks"][1]["pid"] is None and r["hosts"] == ["node-a"]
        gang.rank_processes = None  # type: ignore[assignment]  # a backend that cannot tell: null, no guess
        [r] = client.get("/ui/status").json()["replicas"]
        assert all(k["host"] is None and k["pid"] is None for k in r["ranks"]) and r["hosts"] == []


def ready_gangs(client: Any) -> list[dict[str, Any]]:
    return [r for r in client.get("/ui/status").json()["replicas"] if r["state"] == "ready"]


def test_pages_reference_only_local_assets() -> None:
    with serving(api_key="k") as (client, _):
        assert client.get("/ui/status").json()["api_key_required"] is True  # open, like /metrics
        page = client.get("/")
        assert page.status_code == 200 and "default-src 'self'" in page.headers["content-security-policy"]
        for path in ("/", "/docs", "/redoc"):
            html = client.get(path).text
            urls = re.findall(r'(?:src|href)="([^"]+)"', html) + re.findall(r"url: '([^']+)'", html)
            assert urls, path
            assert all(not re.match(r"^[a-z]+://|^//", u) or u.startswith("data:") for u in urls), (
                path,
                urls,
            )
            for u in urls:
                if not u.startswith("data:"):
                    assert client.get(u if u.startswith("/") else "/" + u).status_code == 200, u
        assert client.get("/ui/static/app.js").headers["content-type"].startswith("text/javascript")
        assert "redoc.ly" not in client.get("/redoc").headers["content-security-policy"]
        paths = set(client.get("/openapi.json").json()["paths"])
        assert not {"/", "/docs", "/redoc"} & paths  # HTML pages stay out of the API document


def test_ui_status_document_matches_the_route(live_server: str, tmp_path: Path) -> None:  # noqa: F811
    """schemathesis --checks all on /ui/openapi.json (GET /ui/status): 0 failures."""
    time.sleep(1.1)  # one sample of the registry history, so the series is not empty
    proc = run_schemathesis(f"{live_server}/ui", tmp_path, token=None, extra=())
    assert proc.returncode == 0, _report(proc)
    assert "Tested: 1" in proc.stdout, _report(proc)
