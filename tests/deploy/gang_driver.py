"""A gang driver for the multi-host tests: runs in one network namespace, waits for rank 1 to join
from another, and reports what happens as JSON lines on stdout (one ``event`` each).

    python -m tests.deploy.gang_driver --host 10.213.5.1 --port 29500 --key HEX --rounds 2

Per round: start a tiny-bert pp=2 gang whose rank 1 is external (``shardserve worker``), print
``ready``, the logits of a fixed batch (``logits``), then keep it busy until it fails (``failed``,
with the rank the ``GangError`` names) and start the next round; after the last round's logits it
stops the gang (``stopped``).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from shardserve.models.registry import resolve_model
from shardserve.partitioner.plan import ParallelDims, make_plan
from shardserve.partitioner.runtime.gang import GangError
from shardserve.partitioner.runtime.rank import GangSpec
from shardserve.partitioner.runtime.remote import GangNetwork
from shardserve.partitioner.stream.driver import StreamGang
from shardserve.partitioner.stream.program import STREAM_PROGRAM, stream_spec


def fixed_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1000, 2000, (2, 12), generator=torch.Generator().manual_seed(0))  # (B, S)
    return ids, torch.ones_like(ids)


def tiny_spec() -> GangSpec:
    source = resolve_model("tiny-bert")
    return stream_spec(source, make_plan(source.config, ParallelDims(pp=2, tp=1)))


def _say(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--key", required=True, help="hex")
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()
    net = GangNetwork(
        host=args.host,
        store_port=args.port,
        external_ranks=(1,),
        key=bytes.fromhex(args.key),
        program=STREAM_PROGRAM,
    )
    for round_ in range(args.rounds):
        gang = StreamGang(tiny_spec(), network=net, heartbeat_timeout_s=5.0, start_timeout_s=180)
        gang.start()
        _say("ready", round=round_, local_pids=gang.pids())
        _say("logits", round=round_, values=gang.run([fixed_batch()], timeout_s=60)[0].tolist())
        if round_ == args.rounds - 1:
            gang.stop()
            _say("stopped", round=round_)
            return 0
        try:
            while True:  # busy until the test kills the remote worker
                futures = [gang.submit(*fixed_batch()) for _ in range(4)]
                for fut in futures:
                    fut.result(timeout=60)
        except GangError as err:
            _say("failed", round=round_, rank=err.rank, message=str(err).splitlines()[0])
        finally:
            gang.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
