"""A QA client for the multi-host tests: runs inside a network namespace, prints JSON.

    python -m tests.deploy.qa_client http://10.213.5.1:8000 --wait-ready 120 --requests 16 --concurrency 4

Waits for ``/readyz`` (``--wait-ready`` seconds), then posts ``--requests`` questions (a fixed set,
cycled) with ``--concurrency`` threads and prints one JSON object: ``{"ready": bool, "results":
[{"i": n, "status": code, "text": best answer or null}, ...]}``. Transport errors count as status 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

PAIRS = [
    ("Who won the match?", "The final was played in Paris. Lyon won the match by two goals."),
    ("Where was the final played?", "The final was played in Paris. Lyon won the match by two goals."),
    ("When was the bridge opened?", "The old bridge was opened in 1874 and rebuilt after the flood."),
]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("--wait-ready", type=float, default=0.0)
    p.add_argument("--requests", type=int, default=len(PAIRS))
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args()
    ready = False
    deadline = time.monotonic() + args.wait_ready
    while True:
        try:
            ready = httpx.get(f"{args.url}/readyz", timeout=2).status_code == 200
        except httpx.TransportError:
            ready = False
        if ready or time.monotonic() >= deadline:
            break
        time.sleep(0.3)

    def ask(i: int) -> dict[str, object]:
        q, c = PAIRS[i % len(PAIRS)]
        try:
            r = httpx.post(f"{args.url}/v1/qa", json={"question": q, "context": c}, timeout=args.timeout)
        except httpx.TransportError:
            return {"i": i, "status": 0, "text": None}
        text = r.json()["answers"][0]["text"] if r.status_code == 200 else None
        return {"i": i, "status": r.status_code, "text": text}

    results = []
    if ready and args.requests:
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(ask, range(args.requests)))
    print(json.dumps({"ready": ready, "results": results}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
