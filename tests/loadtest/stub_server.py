"""A stand-in shardserve HTTP server for load-test tests: the /v1/qa contract, health probes and a
Prometheus /metrics, on a loopback port in a thread, with deterministic behaviour to check reports.

    with StubServer(shed_every=5) as srv:   # every 5th request answers 429 with Retry-After
        srv.url, srv.counts                 # {"received": n, "ok": n, "shed": n}

``bad_offsets=True`` returns answers whose text does not match ``context[start:end]``;
``hang_after=N`` never answers requests after the N-th (a wedged server);
``export_metrics=False`` serves an empty /metrics (the report must survive missing metrics).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Server(ThreadingHTTPServer):
    # a burst of connections at once (replay's open loop) overflows socketserver's backlog of 5 on a
    # busy machine: the kernel drops the SYNs and the client retries them a second later
    request_queue_size = 128


class StubServer:
    def __init__(
        self,
        *,
        shed_every: int = 0,
        delay_s: float = 0.01,
        bad_offsets: bool = False,
        export_metrics: bool = True,
        replicas: int = 2,
        hang_after: int = 0,
    ) -> None:
        self.shed_every = shed_every
        self.delay_s = delay_s
        self.bad_offsets = bad_offsets
        self.export_metrics = export_metrics
        self.replicas = replicas
        self.hang_after = hang_after  # > 0: requests after this many never answer (until exit)
        self._release = threading.Event()
        self.counts = {"received": 0, "ok": 0, "shed": 0}
        self.in_flight = 0
        self._lock = threading.Lock()
        self._httpd = _Server(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def __enter__(self) -> StubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._release.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def log_message(self, *args: object) -> None:
                pass

            def _send(self, code: int, body: bytes, ctype: str, headers: dict | None = None) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path in ("/healthz", "/readyz"):
                    self._send(200, b'{"status":"ok"}', "application/json")
                elif self.path == "/metrics":
                    text = ""
                    if stub.export_metrics:
                        text = (
                            "# HELP shardserve_queue_depth_requests Requests waiting.\n"
                            "# TYPE shardserve_queue_depth_requests gauge\n"
                            f"shardserve_queue_depth_requests {stub.in_flight}\n"
                            "# TYPE shardserve_replicas gauge\n"
                            f'shardserve_replicas{{state="ready"}} {stub.replicas}\n'
                            'shardserve_replicas{state="starting"} 0\n'
                        )
                    self._send(200, text.encode(), "text/plain; version=0.0.4")
                else:
                    self._send(404, b"{}", "application/json")

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                req = json.loads(self.rfile.read(length) or b"{}")
                with stub._lock:
                    stub.counts["received"] += 1
                    n = stub.counts["received"]
                    shed = stub.shed_every > 0 and n % stub.shed_every == 0
                    stub.counts["shed" if shed else "ok"] += 1
                    stub.in_flight += 1
                try:
                    if shed:
                        self._send(429, b'{"detail":"overloaded"}', "application/json", {"Retry-After": "0"})
                        return
                    time.sleep(stub.delay_s)
                    if stub.hang_after and n > stub.hang_after:
                        stub._release.wait(timeout=60)
                        return
                    context = req["context"]
                    end = context.find(" ") if " " in context else len(context)
                    text = context[:end] + ("x" if stub.bad_offsets else "")
                    body = {
                        "answers": [{"text": text, "score": 0.5, "start": 0, "end": end}],
                        "model": "stub",
                    }
                    self._send(200, json.dumps(body).encode(), "application/json")
                finally:
                    with stub._lock:
                        stub.in_flight -= 1

        return Handler
