"""Load testing for shardserve: locust scenarios (steady, step, bursty Gamma arrivals, ramp-down),
a runner that drives locust headless in a subprocess while scraping ``/metrics``, and a report
(CSV, PNG plots, report.md/html) of throughput, latency percentiles, 429 rate, queue depth,
replicas and SLO attainment.

    shardserve loadtest --scenario step --host http://127.0.0.1:8000 --duration 40 --users 6

Modules: ``scenarios`` (pure load-shape logic), ``data`` (questions), ``checks`` (answer offsets,
loopback rule), ``locustfile`` (the locust user and shape), ``prom`` (metrics scraping), ``runner``
(one bounded run), ``report``, ``cli``.
Tests: ``tests/loadtest/``.
"""
