"""The pure config dataclasses of serving, built by the front end's settings and read by each room.

A leaf: it imports nothing from ``serving``'s rooms, so the front end (``serving/frontend/settings.py``
builds these), the engine (``SchedulerConfig``, and the builder reads all three) and the fleet
(``AutoscalingConfig``, ``FleetConfig``) share one definition without importing each other. Each is
validated once, on construction; errors print the numbers.

    SchedulerConfig(max_batch_size=16)                  # the batcher and queue knobs (Triton names)
    AutoscalingConfig(min_replicas=1, max_replicas=4)   # the autoscaler's knobs (Ray Serve names)
    FleetConfig(device="cpu", pp=2, pool_slots=6)       # where and how replica gangs run
    PlacementConfig(policy="auto", devices=2, device_memory_bytes=2**30)  # several models on shared devices
    model_flag("a=default"), repository_models(Path("models/"))   # the models of a server
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardserve.partitioner.runtime.remote import GangNetwork


@dataclass(frozen=True)
class SchedulerConfig:
    """Batcher and queue knobs (Triton names); validated once, errors print the numbers."""

    max_queue_size: int = 256  # requests with windows still waiting for dispatch
    max_batch_size: int = 32  # windows per micro-batch
    max_batch_tokens: int = 8192  # padded tokens per micro-batch: batch_size * longest window
    max_queue_delay_ms: float = 5.0  # oldest window may wait this long for a fuller batch (replicas busy)
    # an idle replica (nothing in flight) waits max_queue_delay_ms too, as Triton's dynamic batcher
    # does; by default it takes what is queued at once (work-conserving)
    wait_when_idle: bool = False
    length_buckets: tuple[int, ...] = (64, 128, 256, 384)  # sorted bucket upper bounds (tokens)
    max_inflight_per_replica: int = 2  # micro-batches in flight per replica
    default_deadline_s: float = 30.0  # request deadline when submit() gets none
    deadline_margin_ms: float = 50.0  # release a partial batch once a deadline is this near
    max_windows_per_request: int = 1024  # windows one request (all its pairs) may need; beyond: 413
    # before tokenizing, the work ahead of a request must fit this share of its time left (else 429)
    admission_margin: float = 0.35

    def __post_init__(self) -> None:
        problems = []
        for name in (
            "max_queue_size",
            "max_batch_size",
            "max_batch_tokens",
            "max_inflight_per_replica",
            "max_windows_per_request",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name}={value!r} must be an integer >= 1")
        for name in ("max_queue_delay_ms", "deadline_margin_ms"):
            if getattr(self, name) < 0:
                problems.append(f"{name}={getattr(self, name)!r} must be >= 0")
        if not 0 < self.admission_margin <= 1:
            problems.append(f"admission_margin={self.admission_margin!r} must be in (0, 1]")
        if self.default_deadline_s <= 0:
            problems.append(f"default_deadline_s={self.default_deadline_s!r} must be > 0")
        buckets = tuple(self.length_buckets)
        object.__setattr__(self, "length_buckets", buckets)
        if not buckets or buckets[0] < 1 or any(a >= b for a, b in itertools.pairwise(buckets)):
            problems.append(f"length_buckets={buckets} must be non-empty, >= 1 and strictly increasing")
        elif isinstance(self.max_batch_tokens, int) and self.max_batch_tokens < buckets[-1]:
            problems.append(
                f"max_batch_tokens={self.max_batch_tokens} is below the largest length bucket "
                f"{buckets[-1]}: windows of that bucket could never be batched"
            )
        if problems:
            raise ValueError("invalid SchedulerConfig: " + "; ".join(problems))


@dataclass(frozen=True)
class AutoscalingConfig:
    """Ray Serve-style autoscaling knobs; validated once, errors print the numbers."""

    min_replicas: int = 1
    max_replicas: int = 1
    target_ongoing_requests: float = 2.0  # queued + in-flight requests per replica
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    look_back_period_s: float = 30.0
    downscale_margin: float = 0.8  # dead-band: scale down only to counts loaded <= margin * target

    def __post_init__(self) -> None:
        problems = []
        for name in ("min_replicas", "max_replicas"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name}={value!r} must be an integer >= 1")
        if not problems and self.min_replicas > self.max_replicas:
            problems.append(f"min_replicas={self.min_replicas} > max_replicas={self.max_replicas}")
        if self.target_ongoing_requests <= 0:
            problems.append(f"target_ongoing_requests={self.target_ongoing_requests!r} must be > 0")
        for name in ("upscale_delay_s", "downscale_delay_s"):
            if getattr(self, name) < 0:
                problems.append(f"{name}={getattr(self, name)!r} must be >= 0")
        if self.look_back_period_s <= 0:
            problems.append(f"look_back_period_s={self.look_back_period_s!r} must be > 0")
        if not 0 < self.downscale_margin <= 1:
            problems.append(f"downscale_margin={self.downscale_margin!r} must be in (0, 1]")
        if problems:
            raise ValueError("invalid AutoscalingConfig: " + "; ".join(problems))


@dataclass(frozen=True)
class FleetConfig:
    """Where and how replica gangs run: the model's partition and positions, the device pool, the
    ranks' threads / dtype / compile / network, and the gangs' timeouts."""

    device: str = "cpu"  # cpu or cuda
    pp: int = 1  # pipeline stages per gang
    tp: int = 1  # tensor-parallel ranks per stage
    pool_slots: int = 2  # CPU device pool: ranks that may run at once
    ranks_per_gpu: int = 1  # cuda: ranks that may share one GPU
    max_seq_len: int = 384  # tokens per window: must fit the model's positions
    rank_threads: int = 1  # torch intra-op threads per rank
    dtype: str = "float32"  # the ranks' compute dtype (already resolved for the device)
    compile: bool = False  # torch.compile each rank's stage
    network: GangNetwork | None = None  # where gangs listen, which ranks run elsewhere (None: all here)
    heartbeat_timeout_s: float = 1.5  # a rank silent this long is lost
    start_timeout_s: float = 300.0  # a gang not ready after this is failed
    stall_timeout_s: float = 10.0  # a replica with work and no progress (batch or layer) this long is failed
    drain_timeout_s: float = 30.0  # a draining gang's in-flight work gets this long
    restart_backoff_s: float = 1.0  # pause before restarting a failed gang
    autoscale_interval_s: float = 0.5  # seconds between autoscaling decisions

    def __post_init__(self) -> None:
        problems = [
            f"{name}={getattr(self, name)!r} must be an integer >= 1"
            for name in ("pp", "tp", "pool_slots", "ranks_per_gpu", "max_seq_len", "rank_threads")
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1
        ]
        if self.device not in ("cpu", "cuda"):
            problems.append(f"device={self.device!r} must be cpu or cuda")
        if problems:
            raise ValueError("invalid FleetConfig: " + "; ".join(problems))

    @property
    def world_size(self) -> int:
        """Ranks per gang (pp * tp)."""
        return self.pp * self.tp


PLACEMENT_POLICIES = ("dedicated", "multiplexed", "auto")


@dataclass(frozen=True)
class PlacementConfig:
    """How a server places its models on its devices (``--placement``; AlpaServe's policies in
    ``partitioner/placement/``): the policy, the devices and each one's memory, the workload the
    choice is simulated for (declared; auto re-plans from the observed one) and the SLO.

    The one declaration of the placement's knobs: their defaults and the machine's defaults
    (``default_devices``, the labels, each device's memory). The serve flags
    (``serving/frontend/placement_flags.py``) name them for users, in their units, and take their
    defaults from here; the fleet's placement runtime (``serving/fleet/placement.py``, its device
    groups ``serving/fleet/groups.py``) reads them."""

    policy: str  # dedicated, multiplexed or auto
    devices: int  # devices the groups are made of (cpu: one core each; cuda: GPU slots)
    # what one device may hold: its stages of every model on it (None: the GPU's memory /
    # ranks_per_gpu on cuda, the machine's / devices on cpu)
    device_memory_bytes: int | None = None
    labels: tuple[str, ...] = ()  # each device's torch device (default: cpu, or the GPUs round-robin)
    rate: float = 10.0  # declared total requests/s, shared by the models (evenly, or as ``skew`` says)
    cv: float = 1.0  # declared inter-arrival coefficient of variation (Gamma; 1 is Poisson)
    skew: float = 0.0  # declared Zipf-like skew: the k-th model (from 1) gets rate in proportion to 1 / k**skew
    slo_scale: float = 5.0  # each model's SLO: this many times its single-request latency
    single_latency_s: float | None = None  # measured single-request latency at pp=1 (None: estimated)
    latency_profile: str | None = None  # a measured stage-time profile (JSON) instead of the cost model's
    seq_len: int = 384  # the windows' length the latencies and activation memory are for
    dtype_bytes: int = 4  # bytes per weight on the devices
    device: str = "cpu"
    ranks_per_gpu: int = 1  # cuda: devices (ranks) per GPU
    simulate_s: float = 60.0  # seconds of the declared workload simulated per candidate
    replan_interval_s: float = 60.0  # auto: seconds between re-plans from the observed load (0: never)
    look_back_s: float = 120.0  # auto: the observed arrivals a re-plan fits
    min_gain: float = 0.02  # auto: attainment a new placement must add to be rolled out
    min_requests: int = 50  # auto: fewer observed requests than this: no re-plan

    def __post_init__(self) -> None:
        problems = []
        if self.policy not in PLACEMENT_POLICIES:
            problems.append(f"policy={self.policy!r} must be one of {', '.join(PLACEMENT_POLICIES)}")
        if self.devices < 1 or (self.device_memory_bytes or 1) < 1:
            problems.append(
                f"devices={self.devices} and device_memory_bytes={self.device_memory_bytes} must be >= 1"
            )
        if self.labels and len(self.labels) != self.devices:
            problems.append(f"{len(self.labels)} device labels for devices={self.devices}")
        if self.skew < 0:
            problems.append(f"skew={self.skew!r} must be >= 0")
        for name in ("rate", "cv", "slo_scale", "simulate_s", "look_back_s"):
            if not getattr(self, name) > 0:
                problems.append(f"{name}={getattr(self, name)!r} must be > 0")
        if self.single_latency_s is not None and not self.single_latency_s > 0:
            problems.append(f"single_latency_s={self.single_latency_s!r} must be > 0")
        if self.replan_interval_s < 0 or self.min_gain < 0:
            problems.append(
                f"replan_interval_s={self.replan_interval_s!r} and min_gain={self.min_gain!r} must be >= 0"
            )
        if problems:
            raise ValueError("invalid PlacementConfig: " + "; ".join(problems))
        if self.device == "cuda" and (not self.labels or self.device_memory_bytes is None):
            import torch

            gpus = max(1, torch.cuda.device_count())
            if not self.labels:  # as the device pool deals them: a gang's ranks on different GPUs first
                object.__setattr__(self, "labels", tuple(f"cuda:{s % gpus}" for s in range(self.devices)))
        if not self.labels:
            object.__setattr__(self, "labels", (self.device,) * self.devices)
        if self.device_memory_bytes is None:
            from shardserve.partitioner.placement.cost_profile import default_device_memory_bytes

            share = self.ranks_per_gpu if self.device == "cuda" else 1
            memory = default_device_memory_bytes(self.device, self.devices) // share
            object.__setattr__(self, "device_memory_bytes", memory)

    @staticmethod
    def default_devices(device: str, *, ranks_per_gpu: int, cores: int) -> int:
        """The devices of a placement that names none: the ``cores`` on cpu (each running single-thread
        ranks), the GPU slots on cuda (``ranks_per_gpu`` per GPU)."""
        if device == "cuda":
            import torch

            return max(1, torch.cuda.device_count() * ranks_per_gpu)
        return cores


MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def check_model_name(name: str) -> str:
    """A public model name (letters, digits, ``. _ -``; at most 64); ValueError naming it otherwise."""
    if not MODEL_NAME.match(name):
        raise ValueError(
            f"model name {name!r} must be 1-64 letters, digits, '.', '_' or '-', starting with one"
        )
    return name


def model_flag(value: str) -> tuple[str | None, str]:
    """``NAME=MODEL`` -> (NAME, MODEL); a bare ``MODEL`` -> (None, MODEL) (its name comes from it)."""
    name, sep, ref = value.partition("=")
    if not sep:
        return None, value
    if not ref:
        raise ValueError(f"model {value!r}: nothing after '=' (NAME=MODEL)")
    return check_model_name(name), ref


def model_name_of(ref: str) -> str:
    """The public name of a model given without one: a registry name, or its folder's name."""
    return Path(ref).name or ref


def repository_models(root: Path) -> dict[str, str]:
    """The models of a Triton-style repository folder: each sub-folder ``NAME`` (a Hugging Face model
    directory, or numbered version folders ``NAME/1``, ``NAME/2``: the highest is served) -> its path."""
    found: dict[str, str] = {}
    for sub in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        versions = sorted((int(v.name), v) for v in sub.iterdir() if v.is_dir() and v.name.isdigit())
        found[sub.name] = str(versions[-1][1] if versions else sub)
    return found
