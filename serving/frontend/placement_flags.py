"""The flags of a placement of several models on shared devices (``shardserve serve --placement``).

``PlacementFlags`` is a pydantic-settings model (every field also reads ``SHARDSERVE_<NAME>``; the
console script makes its flags) that ``ServeSettings`` inherits, as it does ``GangFlags``: the policy,
the devices and their memory, the workload and SLO the placement is chosen for, a measured latency
profile, and auto's re-planning. ``placement_problems`` is their one validation, ``placement_settings``
the ``PlacementConfig`` (``serving/config.py``) they describe. The knobs are declared there (their
defaults, and the machine's default devices); the flags give them their users' names and units.

    flags = ServeSettings(model=["a=default", "b=default"], placement="auto", workload_cv=4)
    flags.placement_config(dtype="bfloat16")    # PlacementConfig(policy="auto", devices=2, ...)
"""

from __future__ import annotations

from collections.abc import Set
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from shardserve.partitioner.placement.latency import MeasuredLatency, PlacementError
from shardserve.partitioner.precision import compute_dtype
from shardserve.serving.config import PLACEMENT_POLICIES, PlacementConfig

# the flags that apply with placement only
PLACEMENT_FIELDS = (
    "devices",
    "device_memory_mb",
    "workload_rate",
    "workload_cv",
    "workload_skew",
    "slo_scale",
    "single_latency_ms",
    "latency_profile",
    "replan_interval_s",
    "replan_look_back_s",
)
# what a placement decides: not together with it
PLACEMENT_DECIDES = ("pp", "tp", "replicas", "min_replicas", "max_replicas", "cpu_slots", "external_ranks")


class PlacementFlags(BaseSettings):
    """How several models share the devices (see module doc)."""

    model_config = SettingsConfigDict(env_prefix="SHARDSERVE_", extra="ignore", frozen=True)

    placement: str | None = Field(
        None,
        description="place the models on shared devices by simulating their load (AlpaServe): dedicated "
        "(every device holds whole models; how many replicas each model gets is chosen for the load), "
        "multiplexed (every model split over all the devices as one pipeline: a burst of one model is "
        "served by every device), auto (the search over group sizes, pipeline degrees and the models of "
        "each group; re-planned from the observed load every replan_interval_s, rolled like a reload). "
        "It decides pp and the replicas, so not together with pp, tp or the replica flags. Unset: every "
        "model has replica gangs of its own, as pp, tp and the replica flags say",
    )
    devices: int | None = Field(
        None,
        ge=1,
        description="with placement: the devices the models are placed on (default: the cores on cpu, "
        "each running single-thread ranks; the GPU slots on cuda, ranks_per_gpu per GPU)",
    )
    device_memory_mb: float | None = Field(
        None,
        gt=0,
        description="with placement: what one device may hold, MiB: its stage of every model placed on it "
        "plus one micro-batch's activations (default: the GPU's memory on cuda, the machine's memory "
        "divided by devices on cpu)",
    )
    workload_rate: float = Field(
        PlacementConfig.rate,
        gt=0,
        description="with placement: the requests/s (all models together, shared as workload_skew says) "
        "the placement is chosen for at start",
    )
    workload_cv: float = Field(
        PlacementConfig.cv,
        gt=0,
        description="with placement: the burstiness it is chosen for: the coefficient of variation of "
        "each model's inter-arrival times (a Gamma process; 1 is Poisson, 4 very bursty)",
    )
    workload_skew: float = Field(
        PlacementConfig.skew,
        ge=0,
        description="with placement: how unevenly the models share workload_rate at start, Zipf-like: the "
        "k-th model given (from 1) in proportion to 1 / k**skew (0: evenly; 1: the first twice the "
        "second's); auto placement then follows the load it observes",
    )
    slo_scale: float = Field(
        PlacementConfig.slo_scale,
        gt=0,
        description="with placement: each model's latency objective, a multiple of its single-request "
        "latency; the placement maximises the share of requests answered within it",
    )
    single_latency_ms: float | None = Field(
        None,
        gt=0,
        description="with placement: one request's latency at pp=1, as measured (default: estimated "
        "from the model's FLOPs, which only orders the choices)",
    )
    latency_profile: str | None = Field(
        None,
        description="with placement: a JSON file of stage times measured on this machine for the models' "
        "shape (what benchmarks/bench_multimodel.py writes), used instead of the cost model's estimate",
    )
    replan_interval_s: float = Field(
        PlacementConfig.replan_interval_s,
        ge=0,
        description="with placement auto: seconds between re-plans for the arrivals observed over the "
        "last replan_look_back_s; a placement that predicts 2 points more SLO attainment is rolled "
        "out (0: never re-plan)",
    )
    replan_look_back_s: float = Field(
        PlacementConfig.look_back_s,
        gt=0,
        description="with placement auto: seconds of observed arrivals a re-plan is fitted to",
    )

    def placement_problems(self, given: Set[str]) -> list[str]:
        """What is wrong with these flags (``given``: the fields set by the user), one line each."""
        if self.placement is None:
            extra = [f for f in PLACEMENT_FIELDS if f in given]
            return [f"{', '.join(extra)} apply with placement only"] if extra else []
        out = []
        if self.placement not in PLACEMENT_POLICIES:
            out.append(f"placement={self.placement!r} must be one of {', '.join(PLACEMENT_POLICIES)}")
        if self.latency_profile is not None:
            try:
                MeasuredLatency.read(self.latency_profile)
            except PlacementError as err:
                out.append(str(err))
        clash = [f"{f}={getattr(self, f)}" for f in PLACEMENT_DECIDES if f in given]
        if clash:
            out.append(
                f"placement={self.placement} decides pp, tp and the replicas: not with {', '.join(clash)}"
            )
        return out

    def placement_devices(self, *, device: str, ranks_per_gpu: int, cores: int) -> int:
        """The devices a placement uses (see ``devices``)."""
        if self.devices is not None:
            return self.devices
        return PlacementConfig.default_devices(device, ranks_per_gpu=ranks_per_gpu, cores=cores)

    def placement_settings(self, *, dtype: str, devices: int, **where: Any) -> PlacementConfig | None:
        """The ``PlacementConfig`` (None without ``placement``); ``dtype`` as resolved, ``where``: the
        server's device, ranks_per_gpu and seq_len."""
        if self.placement is None:
            return None
        mb, single = self.device_memory_mb, self.single_latency_ms
        return PlacementConfig(
            policy=self.placement,
            devices=devices,
            device_memory_bytes=None if mb is None else int(mb * 2**20),
            rate=self.workload_rate,
            cv=self.workload_cv,
            skew=self.workload_skew,
            slo_scale=self.slo_scale,
            single_latency_s=None if single is None else single / 1000.0,
            latency_profile=self.latency_profile,
            dtype_bytes=compute_dtype(dtype).itemsize,
            replan_interval_s=self.replan_interval_s,
            look_back_s=self.replan_look_back_s,
            **where,
        )
