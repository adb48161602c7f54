"""The placement search at cluster scale (64 devices, 32 models: the pruned greedy of ``search.py``) on
the two cases that motivate the policies, as ``test_search.py`` has them for two models:

- steady Poisson load, a tight SLO and a pipeline hop that costs: whole models on single devices win;
- the models burst in turns and a device holds one model: pipelines over many devices, each holding
  a share of many models, win (AlpaServe's statistical multiplexing);
- an SLO below one device's time for one request: only tensor-parallel groups can meet it, and auto
  finds them; where the all-reduces cost more than the shards save, it keeps tp = 1.

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


def _tp_profiles(*, one_request_s: float, allreduce_s: float) -> list[ModelProfile]:
    """Compute-bound models: a micro-batch of b takes ``b * one_request_s`` on one device, shared by
    ``tp`` shards plus ``allreduce_s`` per shard group; pp stages split it and add 1 ms."""
    table = {
        (pp, tp): {
            b: one_request_s * b / (pp * tp) + (0.001 if pp > 1 else 0.0) + (allreduce_s if tp > 1 else 0.0)
            for b in (1, 2, 4, 8, 16)
        }
        for pp, tp in ((1, 1), (2, 1), (4, 1), (1, 2), (1, 4), (2, 2), (1, 8))
    }
    return [ModelProfile(m, param_bytes=GiB, latency=LatencyModel(table)) for m in NAMES]


def test_at_cluster_scale_tensor_parallel_groups_win_an_slo_below_one_devices_latency() -> None:
    trace = steady(NAMES, rate=320.0, duration_s=2.0, seed=5).trace()  # 10 req/s a model
    kw = {"num_devices": DEVICES, "device_memory_bytes": MEMORY, "slo_s": 0.030, "config": CONFIG}
    profiles = _tp_profiles(one_request_s=0.040, allreduce_s=0.002)  # tp=2: 22 ms, tp=4: 12 ms
    ded, best = dedicated(profiles, trace, **kw), auto(profiles, trace, **kw)
    assert ded.result.attainment == 0.0  # 40 ms alone > the 30 ms SLO
    assert best.result.attainment > 0.9, best.placement.describe()
    assert all(g.tp > 1 for g in best.placement.groups if g.models)
    # all-reduces dearer than the shards save, SLO loose: tensor parallelism is never chosen
    cheap = _tp_profiles(one_request_s=0.004, allreduce_s=0.010)
    kept = auto(cheap, trace, **{**kw, "slo_s": 0.040})
    assert kept.result.attainment > 0.9 and all(g.tp == 1 for g in kept.placement.groups)
