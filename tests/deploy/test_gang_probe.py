"""deploy/gang_probe.py: two ranks on loopback rendezvous through torchrun-style variables and
pass the all-reduce and stage-to-stage p2p checks (what deploy/gang-two-hosts.yaml runs per host).

python -m pytest tests/deploy/test_gang_probe.py -q
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_rendezvous_and_exchange() -> None:
    port = _free_port()
    procs = []
    try:
        for rank in range(2):
            env = {
                **os.environ,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "WORLD_SIZE": "2",
                "RANK": str(rank),
                "LOCAL_RANK": "0",
                "GANG_PROBE_TIMEOUT_S": "60",
                "GLOO_SOCKET_IFNAME": "lo",
            }
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(REPO / "deploy" / "gang_probe.py")],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, (out, err)) in enumerate(zip(procs, results, strict=True)):
        assert p.returncode == 0, err[-2000:]
        res = json.loads(out.strip().splitlines()[-1])
        assert res["rank"] == rank and res["world_size"] == 2 and res["ok"] is True
        assert res["all_reduce"] == 3.0
        assert res["received_from_previous_stage"] == float((rank - 1) % 2)


def test_missing_variables_are_named() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "RANK")}
    proc = subprocess.run(
        [sys.executable, str(REPO / "deploy" / "gang_probe.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "MASTER_ADDR" in proc.stderr and "RANK" in proc.stderr
