"""The placement search at cluster scale (64 devices, 32 models: the pruned greedy of ``search.py``) on
the two cases that motivate the policies, as ``test_search.py`` has them for two models:

- steady Poisson load, a tight SLO and a pipeline hop that costs: whole models on single devices win;
- the models burst in turns and a device holds one model: pipelines over many devices, each holding
  a share of many models, win (AlpaServe's statistical multiplexing).

Latencies: 10 ms per request at pp=1 with a little batching gain; pp stages split it and add a hop.
"""

from __future__ import annotations

from shardserve.partitioner.placement.latency import LatencyModel, ModelProfile
from shardserve.partitioner.placement.search import auto, dedicated, multiplexed
from shardserve.partitioner.placement.simulator import SimConfig
from shardserve.partitioner.placement.workload import alternating_bursts, steady

GiB = 2**30
DEVICES = 64
NAMES = tuple(f"m{k}" for k in range(32))
MEMORY = int(1.5 * GiB)  # one 1 GiB model per device, not two
CONFIG = SimConfig(max_batch_size=4)


def _profiles(*, hop: float) -> list[ModelProfile]:
    table = {
        (pp, 1): {b: 0.010 / pp * (0.2 + 0.8 * b) + (hop if pp > 1 else 0.0) for b in (1, 2, 4, 8, 16)}
        for pp in (1, 2, 4, 8)
    }
    return [ModelProfile(m, param_bytes=GiB, latency=LatencyModel(table)) for m in NAMES]


def _run(profiles, trace, slo):
    kw = {"num_devices": DEVICES, "device_memory_bytes": MEMORY, "slo_s": slo, "config": CONFIG}
    return (
        dedicated(profiles, trace, **kw),
        multiplexed(profiles, trace, group_size=8, **kw),
        auto(profiles, trace, **kw),
    )


def test_at_cluster_scale_dedicated_wins_under_steady_load_and_a_tight_slo() -> None:
    trace = steady(NAMES, rate=1200.0, duration_s=3.0, seed=3).trace()  # ~3,600 requests
    ded, mux, best = _run(_profiles(hop=0.002), trace, 0.020)  # pp=2: 14 ms of a 20 ms SLO
    assert sorted(len(g.devices) for g in ded.placement.groups) == [1] * DEVICES
    assert all(len(ded.placement.replicas(m)) == 2 for m in NAMES)  # 64 devices, 32 models
    assert ded.result.attainment > 0.9
    assert ded.result.attainment > mux.result.attainment + 0.1, (ded.result.attainment, mux.result.attainment)
    assert best.result.attainment >= ded.result.attainment - 0.01
    assert all(g.pp == 1 for g in best.placement.groups)


def test_at_cluster_scale_pipelines_win_when_models_burst_in_turns() -> None:
    # each model in turn gets 600 req/s for 0.25 s: two whole replicas (~240 req/s) fall behind
    trace = alternating_bursts(NAMES, burst_rate=600.0, period_s=0.25, duration_s=8.0, seed=1).trace()
    ded, mux, best = _run(_profiles(hop=0.0005), trace, 0.050)
    assert all(g.pp == 8 for g in mux.placement.groups)
    assert mux.result.attainment > ded.result.attainment + 0.1, (ded.result.attainment, mux.result.attainment)
    assert best.result.attainment >= mux.result.attainment - 0.01
    assert best.placement.groups[0].pp > 1
