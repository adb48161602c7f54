"""Server settings: one pydantic-settings model read from CLI flags and ``SHARDSERVE_*`` variables.

Every field is a flag of ``shardserve serve`` (``--max-queue-size`` <-> ``max_queue_size``) and an
environment variable (``SHARDSERVE_MAX_QUEUE_SIZE``); a flag given on the command line wins over
the environment, the environment over the default. The field descriptions below ARE the
``--help`` texts (the console script generates the flags from them, ``shardserve/flags.py``).

    from shardserve.serving.frontend.settings import ServeSettings
    s = ServeSettings(model="tiny-bert", pp=2)        # validated once, errors print the numbers
    s.scheduler_config(), s.autoscaling_config()      # the pure-logic configs built from it
    s.fleet_config(dtype="float32", compile=False)    # (serving/config.py), which the engine builds from
"""

from __future__ import annotations

import os
import socket
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, ClassVar

from pydantic import Field, model_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from shardserve.models.qa_windows import WindowConfig
from shardserve.partitioner.command import split_list
from shardserve.partitioner.compiled import COMPILE_CHOICES
from shardserve.partitioner.fit import AUTO
from shardserve.partitioner.layout_flags import Degree, LayoutFlags
from shardserve.partitioner.runtime.gang_flags import GangFlags, secret_from_file
from shardserve.serving.config import (
    AutoscalingConfig,
    FleetConfig,
    PlacementConfig,
    SchedulerConfig,
    model_flag,
    model_name_of,
    repository_models,
)
from shardserve.serving.frontend.placement_flags import PlacementFlags
from shardserve.serving.frontend.scheduler_flags import SchedulerFlags

MAX_AUTO_API_WORKERS = 8  # the engine core's own loop caps what more API processes could add


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def auto_replicas(*, device: str, world_size: int, ranks_per_gpu: int = 1) -> int:
    """Replica gangs that use the machine with one core (or ``1/ranks_per_gpu`` GPU) per rank, at least one."""
    if device == "cuda":
        import torch

        return max(1, torch.cuda.device_count() * ranks_per_gpu // world_size)
    return max(1, available_cores() // world_size)


class ServeSettings(GangFlags, PlacementFlags, SchedulerFlags, LayoutFlags):
    """Everything ``shardserve serve`` can be told (see the module doc for flags / env vars); the
    flags of a gang across hosts (``external_ranks``, ``gang_*``) are ``GangFlags``', shared with
    training; those of a placement of several models (``placement``, ...) are ``PlacementFlags``';
    those of batching, the queue, admission and deadlines ``SchedulerFlags``'; the layout (``pp``,
    ``tp``, ``max_memory_per_rank``, ``device``, ``dtype``) is ``LayoutFlags``', shared with plan,
    verify and train (``partitioner/layout_flags.py``)."""

    model_config = SettingsConfigDict(
        env_prefix="SHARDSERVE_", extra="ignore", frozen=True, allow_inf_nan=False
    )
    flag_notes: ClassVar[dict[str, str]] = {  # serve's own words on the layout flags (shardserve/flags.py)
        "max_memory_per_rank": "On cuda the default is divided by ranks_per_gpu. Estimated for a micro-batch "
        "of max_batch_size windows (at most max_batch_tokens / max_seq_len) of max_seq_len tokens; every "
        "model must fit the one layout",
        "device": "On cuda the device pool is the visible GPUs, ranks_per_gpu slots each",
    }

    # ---- network
    host: str = Field("0.0.0.0", description="interface to listen on")
    port: int = Field(8000, ge=0, le=65535, description="TCP port to listen on (0: any free port)")
    grpc_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="also serve KServe v2 / Triton gRPC (inference.GRPCInferenceService) on this port of "
        "--host (0: any free port; unset: no gRPC). Same API key (`authorization: Bearer <key>` metadata), "
        "admin token, admission and limits as REST",
    )

    api_workers: Degree = Field(
        AUTO,
        description="HTTP API processes in front of one engine core (vLLM's --api-server-count). 1: "
        "everything in this process. N >= 2: N processes share the port (SO_REUSEPORT, Linux), each "
        "parsing, validating, tokenizing and decoding (gRPC too, with grpc_port), while this process "
        "keeps the models, the one queue, the gangs, metrics and status; a dead one is replaced. auto: 1 on cpu (the ranks "
        f"use the cores); on cuda, the cores left after one per rank and one for the core, at most "
        f"{MAX_AUTO_API_WORKERS}",
    )

    # ---- model and partition
    model: Annotated[list[str] | None, NoDecode] = Field(
        None,
        json_schema_extra={"action": "append", "metavar": "[NAME=]MODEL"},
        description="a model to serve, repeatable: [NAME=]MODEL, MODEL one of default (embedded MiniLM QA "
        "model), minilm, tiny-bert, tiny-roberta, tiny-distilbert, or a local Hugging Face directory; NAME its "
        "public name in requests, /v2/models/NAME and metrics (default: served_model_name, else the MODEL's "
        "own name). The first is the model of requests that name none (default: default, unless "
        "model_repository is given; env: comma-separated)",
    )
    model_repository: str | None = Field(
        None,
        description="a Triton-style model repository folder: every sub-folder NAME (a Hugging Face model "
        "directory, or numbered version folders of one, the highest served) is loaded at start as model "
        "NAME, after the model flags; POST /v2/repository/models/NAME/load and /unload (admin token) "
        "change the served models live",
    )
    threads_per_rank: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads of each worker rank (default: the cores divided among the "
        "ranks of all replicas, at least 1)",
    )
    compile: str = Field(
        "off",
        description="on: torch.compile each rank's stage (inductor, dynamic shapes), warmed up over the length "
        "buckets before the replica turns ready (~30 s per gang start). Off by default: faster in isolation "
        "on AMX CPUs, it served 2-8 % fewer questions/s there (docs/benchmarks.md)",
    )

    # ---- replicas, device pool, autoscaling (Ray Serve names)
    replicas: int | None = Field(
        None,
        ge=1,
        description="fixed number of replica gangs (sets min and max replicas; default: one gang per "
        "pp*tp cores on cpu, per pp*tp GPU slots on cuda (see ranks_per_gpu), when no replica or thread "
        "flag is given)",
    )
    min_replicas: int | None = Field(None, ge=1, description="autoscaling lower bound (default 1)")
    max_replicas: int | None = Field(None, ge=1, description="autoscaling upper bound (default min)")
    cpu_slots: int | None = Field(
        None,
        ge=1,
        description="CPU device pool: worker processes (ranks) that may run at once; a gang takes pp*tp "
        "slots. Default: pp*tp*(max_replicas*models+1), room for one spare gang used by restarts and reloads",
    )
    ranks_per_gpu: int = Field(
        1,
        ge=1,
        description="cuda only: worker ranks that may share one GPU, e.g. 4 replicas on one GPU, or a pp=2 gang "
        "on one GPU (each rank its own CUDA context; ranks of a gang that share a GPU talk through gloo)",
    )
    target_ongoing_requests: float = Field(
        2.0, gt=0, description="autoscaler: queued + in-flight requests wanted per replica"
    )
    upscale_delay_s: float = Field(30.0, ge=0, description="autoscaler: a scale-up wish must last this long")
    downscale_delay_s: float = Field(
        600.0, ge=0, description="autoscaler: a scale-down wish must last this long"
    )
    look_back_period_s: float = Field(30.0, gt=0, description="autoscaler: load averaging window")
    autoscale_interval_s: float = Field(0.5, gt=0, description="autoscaler: seconds between decisions")

    # ---- question answering
    max_seq_len: int = Field(384, ge=16, description="tokens per window (special tokens included)")
    doc_stride: int = Field(128, ge=0, description="context tokens shared by consecutive windows")
    max_question_len: int = Field(64, ge=1, description="question tokens kept (longer ones are truncated)")
    context_cache_mb: float = Field(
        32.0,
        ge=0,
        description="tokenized contexts kept per model and API process, least recently used out first: a "
        "question about a text seen before skips tokenizing it (0.27 ms of an 800-character paragraph's "
        "0.44); about 16 KB per such paragraph; 0: off (also where tenants must not learn from the "
        "timing whether a text was sent before)",
    )
    null_threshold: float | None = Field(
        None,
        description="SQuAD 2.0 no-answer threshold: answer 'no answer' when null_score - best_span "
        "> threshold (unset: always answer); a request's own null_threshold field overrides it",
    )

    # ---- limits on input
    max_body_bytes: int = Field(
        1_000_000,
        ge=1024,
        description="largest request body (bytes, inflated when gzip / deflate); beyond: 413",
    )
    client_timeout_s: float = Field(
        30.0,
        gt=0,
        description="a client must send a request's headers within this many seconds of connecting (or of "
        "the previous answer on a kept-alive connection), and its body within as many again; beyond: 408 "
        "and the connection is closed (stalled or slow clients cannot hold connections)",
    )
    max_context_chars: int = Field(100_000, ge=1, description="longest context (characters); beyond: 422")
    max_question_chars: int = Field(2_000, ge=1, description="longest question (characters); beyond: 422")
    max_batch_items: int = Field(64, ge=1, description="pairs per /v1/qa/batch call; beyond: 422")
    max_windows_per_request: int = Field(
        128,
        ge=1,
        description="windows (max_seq_len token pieces of the contexts) one call may need, all its items "
        "together; beyond: 413 with the numbers (the default fits one longest context)",
    )

    # ---- lifecycle, health
    admin_token: str | None = Field(
        None, description="bearer token of the /admin endpoints (unset: admin endpoints answer 401)"
    )
    admin_token_file: str | None = Field(
        None,
        description="read the admin bearer token from this file (first line; keeps it out of `ps`); "
        "not together with admin_token",
    )
    api_key: str | None = Field(
        None,
        description="API key of the inference endpoints (/v1/*, /v2/models/*): clients send "
        "`Authorization: Bearer <api_key>` (gRPC: the `authorization` metadata), else 401 (unset: open). /healthz, /readyz, /metrics, /v2, "
        "/v2/health/* and /v2/models/<name>/ready stay open",
    )
    api_key_file: str | None = Field(
        None,
        description="read the API key from this file (first line; keeps it out of `ps`); not together "
        "with api_key",
    )
    served_model_name: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="the model's public name in /v1/models, QA answers and the /v2/models/<name> routes "
        "(letters, digits, . _ -; stays the same across /admin/reload; default: the loaded model's name)",
    )
    drain_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM / scale-down: wait this long for work")
    stall_timeout_s: float | None = Field(
        None,
        gt=0,
        description="a replica with work in flight and no progress this long (no micro-batch completed, "
        "no layer finished on any rank) is failed and its work retried on another (it leaves readiness "
        "after half of it); must be below request_timeout_s (default: a third of request_timeout_s)",
    )
    heartbeat_timeout_s: float = Field(
        1.5,
        ge=1.0,
        description="a rank (here or on another host) that sends no heartbeat this long is lost: its "
        "replica is failed and its work retried on another (ranks beat every 0.5 s; raise it for "
        "ranks on a slow network)",
    )
    gang_start_timeout_s: float = Field(300.0, gt=0, description="a gang not ready after this is failed")

    restart_backoff_s: float = Field(1.0, ge=0, description="pause before restarting a failed gang")

    @model_validator(mode="before")
    @classmethod
    def _read_admin_token_file(cls, data: Any) -> Any:
        return secret_from_file(data, secret="admin_token", file="admin_token_file")

    @model_validator(mode="before")
    @classmethod
    def _read_api_key_file(cls, data: Any) -> Any:
        return secret_from_file(data, secret="api_key", file="api_key_file")

    @model_validator(mode="before")
    @classmethod
    def _split_lists(cls, data: Any) -> Any:
        return split_list(data, "length_buckets", "model")

    @model_validator(mode="after")
    def _check(self) -> ServeSettings:
        problems = self._model_problems()
        if problems:  # the sizes below count the models
            raise ValueError("invalid settings: " + "; ".join(problems))
        if self.replicas is not None and (self.min_replicas is not None or self.max_replicas is not None):
            problems.append(
                f"replicas={self.replicas} cannot be combined with min_replicas={self.min_replicas} / "
                f"max_replicas={self.max_replicas}"
            )
        problems += self.scheduler_problems(max_seq_len=self.max_seq_len)
        if self.doc_stride + self.max_question_len + 4 >= self.max_seq_len:
            problems.append(
                f"doc_stride={self.doc_stride} + max_question_len={self.max_question_len} leaves no room in "
                f"max_seq_len={self.max_seq_len}"
            )
        if self.stall_timeout_s is not None and self.stall_timeout_s >= self.request_timeout_s:
            problems.append(
                f"stall_timeout_s={self.stall_timeout_s} must be below request_timeout_s="
                f"{self.request_timeout_s}: a stalled replica's requests must be retried before their deadline"
            )
        if self.api_workers not in (AUTO, 1) and not hasattr(socket, "SO_REUSEPORT"):
            problems.append(f"api_workers={self.api_workers} needs SO_REUSEPORT (Linux); use 1 here")
        if self.grpc_port is not None and self.grpc_port == self.port != 0:
            problems.append(f"grpc_port={self.grpc_port} is the HTTP port; give gRPC a port of its own")
        if self.device == "cpu" and self.ranks_per_gpu != 1:
            problems.append(
                f"ranks_per_gpu={self.ranks_per_gpu} applies to device=cuda only (on cpu: cpu_slots)"
            )
        if self.compile not in COMPILE_CHOICES:
            problems.append(f"compile={self.compile!r} must be one of {', '.join(COMPILE_CHOICES)}")
        if self.placement is not None and "max_memory_per_rank" in self.model_fields_set:
            problems.append("max_memory_per_rank does not apply with placement (its device_memory_mb does)")
        problems += [] if self.auto_layout else self._layout_problems()
        problems += self.placement_problems(self.model_fields_set)
        if problems:
            raise ValueError("invalid settings: " + "; ".join(problems))
        if not self.auto_layout:  # else with_layout checks these, once the layout is chosen
            self.scheduler_config()  # raises with the numbers
            self.autoscaling_config()
        return self

    def with_layout(self, pp: int, tp: int) -> ServeSettings:
        """These settings with the layout ``pp`` x ``tp`` (what ``auto`` chose), checked as a layout
        given as flags is (``ValueError`` with the numbers)."""
        out = self.model_copy(update={"pp": pp, "tp": tp})
        if problems := out._layout_problems():
            raise ValueError("invalid settings: " + "; ".join(problems))
        out.scheduler_config()
        out.autoscaling_config()
        return out

    def _layout_problems(self) -> list[str]:
        """The problems that need pp and tp as numbers: the replica bounds, the gang across hosts."""
        lo, hi = self.replica_bounds
        return ([f"min_replicas={lo} > max_replicas={hi}"] if lo > hi else []) + self._gang_problems()

    def _model_problems(self) -> list[str]:
        flags = self.model or []
        if self.served_model_name is not None and (len(flags) > 1 or any("=" in m for m in flags)):
            return [
                f"served_model_name={self.served_model_name!r} names one model given without a name, got {flags}"
            ]
        if self.model_repository is not None and not Path(self.model_repository).expanduser().is_dir():
            return [f"model_repository={self.model_repository!r} is not a folder"]
        try:
            names = [name for name, _ in self.models()]
        except ValueError as err:
            return [str(err)]
        if not names:
            return [
                f"model_repository={self.model_repository!r} holds no model folder and no model was given"
            ]
        if len(set(names)) < len(names):
            return [f"model names must differ, got {names}"]
        return []

    def models(self) -> list[tuple[str, str]]:
        """The models to serve at start, in order: (public name, registry name or path); the model
        flags (default: ``default``, when no repository is given), then the repository's folders
        (read once: the sizes and the start-up count them)."""
        return list(self._models)

    @cached_property
    def _models(self) -> tuple[tuple[str, str], ...]:
        flags = self.model if self.model is not None else ([] if self.model_repository else ["default"])
        out = []
        for value in flags:
            name, ref = model_flag(value)
            out.append((name or self.served_model_name or model_name_of(ref), ref))
        if self.model_repository is not None:
            out += repository_models(Path(self.model_repository).expanduser()).items()
        return tuple(out)

    def _gang_problems(self) -> list[str]:
        out = self.gang_problems(world_size=self.world_size, layout=f"pp={self.pp} x tp={self.tp}")
        if self.external_ranks and self.replica_bounds != (1, 1):
            out.append(
                f"external_ranks need exactly one replica, got {self.replica_bounds[0]}..{self.replica_bounds[1]}"
            )
        return out

    @property
    def api_worker_count(self) -> int:
        """API processes (``api_workers``, auto resolved); 1: no separate API process."""
        if self.api_workers != AUTO:
            return int(self.api_workers)
        if self.device != "cuda" or self.auto_layout:
            return 1
        ranks = self.world_size * self.replica_bounds[1] * self.model_count
        return max(1, min(MAX_AUTO_API_WORKERS, available_cores() - ranks - 1))

    @property
    def world_size(self) -> int:
        return self.pp * self.tp

    @property
    def auto_sized(self) -> bool:
        """No replica or thread flag given: size replicas x threads to the machine."""
        return (
            self.replicas is None
            and self.min_replicas is None
            and self.max_replicas is None
            and self.threads_per_rank is None
        )

    @property
    def replica_bounds(self) -> tuple[int, int]:
        """(min_replicas, max_replicas) after applying ``replicas`` and the defaults."""
        if self.replicas is not None:
            return self.replicas, self.replicas
        if self.auto_sized:  # the machine shared by the models
            n = auto_replicas(
                device=self.device, world_size=self.world_size, ranks_per_gpu=self.ranks_per_gpu
            )
            n = max(1, n // self.model_count)
            return n, n
        lo = self.min_replicas if self.min_replicas is not None else 1
        hi = self.max_replicas if self.max_replicas is not None else max(lo, 1)
        return lo, hi

    @property
    def rank_threads(self) -> int:
        """Threads per rank: as given, else the cores shared by the ranks of the largest fleet (with
        a placement: by its devices)."""
        if self.threads_per_rank is not None:
            return self.threads_per_rank
        if self.device == "cuda":
            return 1
        if self.placement is not None:
            return max(1, available_cores() // self.placement_device_count)
        return max(1, available_cores() // (self.world_size * self.replica_bounds[1] * self.model_count))

    @property
    def autoscaling(self) -> bool:
        lo, hi = self.replica_bounds
        return hi > lo

    @property
    def pool_slots(self) -> int:
        """Rank slots of the CPU device pool (see ``cpu_slots``)."""
        if self.cpu_slots is not None:
            return self.cpu_slots
        if self.external_ranks:  # one gang on a fixed port: a restart or reload replaces it in place
            return self.world_size
        return self.world_size * (self.replica_bounds[1] * self.model_count + 1)

    @property
    def model_count(self) -> int:
        """Models served at start (they share the device pool and the cores)."""
        return max(1, len(self.models()))

    def scheduler_config(self) -> SchedulerConfig:
        return self.scheduler_settings(
            pp=self.pp, max_seq_len=self.max_seq_len, max_windows_per_request=self.max_windows_per_request
        )

    @property
    def context_cache_bytes(self) -> int:
        return int(self.context_cache_mb * 2**20)

    def window(self) -> WindowConfig:
        """How contexts are cut into windows (what eval must use to see the server's answers)."""
        return WindowConfig(
            max_seq_len=self.max_seq_len, doc_stride=self.doc_stride, max_question_len=self.max_question_len
        )

    @property
    def stall_after_s(self) -> float:
        """The stall timeout in effect (``stall_timeout_s``, else a third of the request deadline)."""
        return self.stall_timeout_s if self.stall_timeout_s is not None else self.request_timeout_s / 3

    def fleet_config(self, *, dtype: str = "float32", compile: bool = False) -> FleetConfig:
        """Where and how gangs run; ``dtype`` and ``compile`` as resolved for the device
        (``shardserve.partitioner.precision.resolve_dtype``, ``shardserve.partitioner.compiled.resolve_compile``)."""
        return FleetConfig(
            device=self.device,
            pp=self.pp,
            tp=self.tp,
            pool_slots=self.pool_slots,
            ranks_per_gpu=self.ranks_per_gpu,
            max_seq_len=self.max_seq_len,
            rank_threads=self.rank_threads,
            dtype=dtype,
            compile=compile,
            network=self.network(),
            heartbeat_timeout_s=self.heartbeat_timeout_s,
            start_timeout_s=self.gang_start_timeout_s,
            stall_timeout_s=self.stall_after_s,
            drain_timeout_s=self.drain_timeout_s,
            restart_backoff_s=self.restart_backoff_s,
            autoscale_interval_s=self.autoscale_interval_s,
        )

    @property
    def placement_device_count(self) -> int:
        """The devices a placement uses (``devices``; default: the cores, or the GPU slots)."""
        return self.placement_devices(
            device=self.device, ranks_per_gpu=self.ranks_per_gpu, cores=available_cores()
        )

    def placement_config(self, *, dtype: str = "float32") -> PlacementConfig | None:
        """How the models are placed (None without ``placement``); ``dtype`` as resolved."""
        return self.placement_settings(
            dtype=dtype,
            devices=self.placement_device_count,
            device=self.device,
            ranks_per_gpu=self.ranks_per_gpu,
            seq_len=self.max_seq_len,
        )

    def autoscaling_config(self) -> AutoscalingConfig:
        lo, hi = self.replica_bounds
        return AutoscalingConfig(
            min_replicas=lo,
            max_replicas=hi,
            target_ongoing_requests=self.target_ongoing_requests,
            upscale_delay_s=self.upscale_delay_s,
            downscale_delay_s=self.downscale_delay_s,
            look_back_period_s=self.look_back_period_s,
        )
