"""The flags of the scheduler: batching, the queue, admission and deadlines (Triton's names).

``SchedulerFlags`` is a pydantic-settings model (every field also reads ``SHARDSERVE_<NAME>``; the
console script makes its flags) that ``ServeSettings`` inherits, as it does ``GangFlags`` and
``PlacementFlags``. ``scheduler_problems`` is their one validation, ``scheduler_settings`` the
``SchedulerConfig`` (``serving/config.py``) they describe; both take what the rest of the settings
decide (the window length, the stages, the windows a request may need) as keywords.

    flags = ServeSettings(max_batch_size=8, max_queue_delay_ms=2)
    flags.scheduler_config()       # SchedulerConfig(max_batch_size=8, ..., length_buckets=(64, ..., 384))
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from shardserve.serving.config import SchedulerConfig

# windows of similar length batched together: a micro-batch's padding stays near 7 % on SQuAD, and
# short questions do not wait on long windows (docs/benchmarks.md)
DEFAULT_LENGTH_BUCKETS = (64, 96, 128, 160, 192, 256, 320, 384)


class SchedulerFlags(BaseSettings):
    """How windows are queued, batched, admitted and timed out (see module doc)."""

    model_config = SettingsConfigDict(env_prefix="SHARDSERVE_", extra="ignore", frozen=True)

    max_queue_size: int = Field(256, ge=1, description="requests waiting for dispatch; beyond: 429")
    max_batch_size: int = Field(32, ge=1, description="windows per micro-batch")
    max_batch_tokens: int = Field(8192, ge=1, description="padded tokens per micro-batch")
    max_queue_delay_ms: float = Field(
        5.0,
        ge=0,
        description="while the replicas are busy, the oldest queued window may wait this long for a fuller "
        "batch; a replica with nothing in flight takes what is queued at once (see --wait-when-idle)",
    )
    wait_when_idle: bool = Field(
        False,
        description="a replica with nothing in flight also waits max_queue_delay_ms for a fuller batch, as "
        "Triton's dynamic batcher does (default: it takes what is queued at once; waiting added 7 ms to a single "
        "request's median and 22 % to the p99 at 45 questions/s on a 2-core CPU: docs/benchmarks.md)",
    )
    length_buckets: Annotated[list[int], NoDecode] = Field(
        default_factory=list,
        description="comma-separated window length buckets (tokens): a micro-batch holds windows of one bucket; "
        "the last must be >= max_seq_len. Unset: "
        + ",".join(map(str, DEFAULT_LENGTH_BUCKETS))
        + " below max_seq_len, then max_seq_len. One bucket of max_seq_len served 7 % more questions/s "
        "to 32 clients on a 2-core CPU but raised the p99 latency by 20-40 % under Poisson arrivals "
        "(docs/benchmarks.md)",
    )
    max_inflight_per_replica: int = Field(
        0, ge=0, description="micro-batches in flight per replica (0: pp + 1, one per stage plus one queued)"
    )
    admission_margin: float = Field(
        0.35,
        gt=0,
        le=1,
        description="admission before tokenizing: a request is refused (429) unless the windows queued "
        "ahead of it, at the measured rate, fit this share of its time to the deadline (the rest "
        "absorbs the estimates moving while it waits for the tokenizer; raise it toward 1 for deadlines "
        "of a few single-request latencies, where 0.35 refuses work that would finish in time)",
    )
    request_timeout_s: float = Field(
        30.0, gt=0, description="default request deadline; a request not computed by then gets 504"
    )
    max_request_timeout_s: float = Field(300.0, gt=0, description="largest deadline a request may ask for")

    def scheduler_problems(self, *, max_seq_len: int) -> list[str]:
        """What is wrong with these flags, each with its numbers (empty: nothing)."""
        out = []
        if self.length_buckets and self.length_buckets[-1] < max_seq_len:
            out.append(
                f"largest length bucket {self.length_buckets[-1]} < max_seq_len={max_seq_len}: "
                "full windows could never be scheduled"
            )
        if self.request_timeout_s > self.max_request_timeout_s:
            out.append(
                f"request_timeout_s={self.request_timeout_s} > max_request_timeout_s={self.max_request_timeout_s}"
            )
        return out

    def scheduler_settings(
        self, *, pp: int, max_seq_len: int, max_windows_per_request: int
    ) -> SchedulerConfig:
        """The ``SchedulerConfig`` of these flags for ``pp`` stages and windows of ``max_seq_len``
        (``length_buckets`` left empty: ``DEFAULT_LENGTH_BUCKETS`` below it, then it)."""
        buckets = self.length_buckets or [b for b in DEFAULT_LENGTH_BUCKETS if b < max_seq_len] + [
            max_seq_len
        ]
        return SchedulerConfig(
            max_queue_size=self.max_queue_size,
            max_batch_size=self.max_batch_size,
            max_batch_tokens=self.max_batch_tokens,
            max_queue_delay_ms=self.max_queue_delay_ms,
            wait_when_idle=self.wait_when_idle,
            length_buckets=tuple(buckets),
            max_inflight_per_replica=self.max_inflight_per_replica or pp + 1,
            default_deadline_s=self.request_timeout_s,
            max_windows_per_request=max_windows_per_request,
            admission_margin=self.admission_margin,
        )


SCHEDULER_FIELDS: tuple[str, ...] = tuple(SchedulerFlags.model_fields)
