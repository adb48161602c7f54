"""Multi-model placement (AlpaServe, OSDI'23): which device groups serve which models, chosen by simulation.

Several models share a group of devices, each split across the whole group as a pipeline, so a burst
for one model is served by every device of the group instead of the one it would own alone. The
placement is chosen by simulating the workload; everything here is PURE LOGIC (no processes, no
torch at simulation time):

- ``workload.py``: arrival processes (Gamma, per model), traces, burst scenarios;
- ``latency.py``: a model's stage latencies per parallel config and its memory (``ModelProfile``);
- ``cost_profile.py``: such a profile from the analytic cost model and one single-request latency;
- ``layout.py``: ``Group`` / ``Placement`` and the per-device memory check;
- ``gpus.py``: named GPUs' datasheet figures and their roofline micro-batch time (planning without one);
- ``simulator.py``: discrete-event simulation of the server's scheduler -> ``SimResult``;
- ``evaluate.py``: many placements on one trace, simulated component by component and cached;
- ``search.py``: the policies ``dedicated``, ``multiplexed``, ``auto`` and ``replan``;
- ``headroom.py``: the largest rate (or CV) a fixed placement serves at a target attainment;
- ``plan_command.py``: ``shardserve plan --placement``'s flags and output (not pure: it reads models).

    shardserve plan --placement auto --models a=default,b=default --devices 2 --rate 40 --cv 3
    python -m pytest tests/partitioner/placement -q
"""

from shardserve.partitioner.placement.latency import LatencyModel, ModelProfile, PlacementError
from shardserve.partitioner.placement.layout import Group, Placement
from shardserve.partitioner.placement.search import (
    PlacementChoice,
    auto,
    choose_placement,
    dedicated,
    multiplexed,
    replan,
)
from shardserve.partitioner.placement.simulator import ModelStats, SimConfig, SimResult, simulate
from shardserve.partitioner.placement.workload import (
    ArrivalSpec,
    Trace,
    Workload,
    alternating_bursts,
    load_trace,
    steady,
)

__all__ = [
    "ArrivalSpec",
    "Group",
    "LatencyModel",
    "ModelProfile",
    "ModelStats",
    "Placement",
    "PlacementChoice",
    "PlacementError",
    "SimConfig",
    "SimResult",
    "Trace",
    "Workload",
    "alternating_bursts",
    "auto",
    "choose_placement",
    "dedicated",
    "load_trace",
    "multiplexed",
    "replan",
    "simulate",
    "steady",
]
