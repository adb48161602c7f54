"""Parity check: the partitioned gang against the unpartitioned ``transformers`` reference.

Runs sample question/context pairs of several lengths as padded micro-batches through a gang at
the requested (pp, tp) and through ``AutoModelForQuestionAnswering`` on the same weights, and
reports the largest absolute difference of start/end logits over real (unpadded) tokens. With
``--dtype bfloat16`` (or float16) the gang computes in that dtype while the reference stays fp32,
and the report adds how many windows' best answer span (the argmax of start + end over spans of at
most ``MAX_ANSWER_TOKENS``) changed; each dtype has its own default tolerance (``TOLERANCES``).

``verify_multiplexed`` checks a gang holding several models (``stream_spec_multi``): each model's
sample batches, interleaved with the others', must match that model's own reference the same way.

A checkpoint without a QA head (the bundled MiniLM) or with overlays (the default model) is first
merged into a temporary full ``*ForQuestionAnswering`` directory for the reference; the gang still
loads from the original source, so the overlay and head-initialisation paths are checked too.

    shardserve verify --model tiny-bert --pp 2 --tp 2
    verify_multiplexed({"bert": resolve_model("tiny-bert"), "roberta": resolve_model("tiny-roberta")},
                       ParallelDims(pp=2))          # {"bert": VerifyResult, "roberta": VerifyResult}

Run the tests: ``python -m pytest tests/partitioner/stream tests/partitioner/runtime/test_gang.py -q``.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shardserve.models.build import build_model
from shardserve.models.registry import ModelSource
from shardserve.partitioner.plan import ParallelDims, PartitionPlan, default_devices, make_plan
from shardserve.partitioner.stream.driver import StreamGang
from shardserve.partitioner.stream.program import stream_spec_multi

logger = logging.getLogger(__name__)

_CONTEXT = (
    "The Normans were the people who in the 10th and 11th centuries gave their name to Normandy, "
    "a region in France. They were descended from Norse raiders and pirates from Denmark, Iceland "
    "and Norway who, under their leader Rollo, agreed to swear fealty to King Charles III of West "
    "Francia. Through generations of assimilation and mixing with the native Frankish and "
    "Roman-Gaulish populations, their descendants would gradually merge with the Carolingian-based "
    "cultures of West Francia. "
)
SAMPLES: list[tuple[str, str]] = [
    ("In what country is Normandy located?", _CONTEXT),
    ("Who was the Norse leader?", "Rollo led the Norse raiders."),
    ("What is the capital?", "Paris."),
    (
        "From which countries did the Norse originate, and when did the Normans give their name to Normandy?",
        _CONTEXT * 4,
    ),
    ("Who did the Normans swear fealty to?", _CONTEXT),
    ("When did the Normans give their name to Normandy?", _CONTEXT),
    ("With whom did their descendants merge?", _CONTEXT),
    ("Where did the Norse raiders come from?", _CONTEXT),
]
# Largest max |logit diff| accepted per compute dtype (the reference is fp32). Reduced precision
# keeps ~8 (bf16) / ~11 (fp16) mantissa bits: measured on the default model (pp, tp in (1,1), (2,1),
# (1,2)), bf16 logits (magnitudes up to ~10) move by at most 0.165 and on tiny-bert by 0.022
# (tests/partitioner/test_precision.py); fp16 keeps 3 more bits.
# int8 (calibrated static int8 Linear layers, partitioner/int8.py) is judged by F1 (eval: >= 99 % of
# fp32's, MLPerf's bound); its logit bound only catches a broken path: on the default model's 676
# calibration windows int8 logits moved by at most 1.86.
TOLERANCES: dict[str, float] = {"float32": 1e-4, "bfloat16": 0.25, "float16": 0.05, "int8": 2.5}
MAX_ANSWER_TOKENS = 30
SAMPLE_SEQ_LEN = 256  # the longest sample window (tokens); the largest batch is all of SAMPLES


@dataclass
class VerifyResult:
    """Outcome of a parity run."""

    max_abs_start: float
    max_abs_end: float
    tolerance: float
    batch_shapes: list[tuple[int, int]] = field(default_factory=list)
    dtype: str = "float32"
    windows: int = 0
    span_changes: int = 0  # windows whose best span differs from the reference's

    @property
    def span_change_fraction(self) -> float:
        return self.span_changes / self.windows if self.windows else 0.0

    @property
    def max_abs(self) -> float:
        return max(self.max_abs_start, self.max_abs_end)

    @property
    def passed(self) -> bool:
        return self.max_abs <= self.tolerance


def sample_batches(
    source: ModelSource, *, max_seq_len: int = SAMPLE_SEQ_LEN
) -> list[dict[str, torch.Tensor]]:
    """Padded micro-batches of mixed lengths: all samples together, one short one, the long pair."""

    tok = source.tokenizer()
    max_len = min(max_seq_len, source.config.max_seq_len)

    def encode(pairs: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
        enc = tok(
            [q for q, _ in pairs],
            [c for _, c in pairs],
            padding=True,
            truncation="only_second",
            max_length=max_len,
            return_tensors="pt",
        )
        batch = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
        if source.config.uses_token_types and "token_type_ids" in enc:
            batch["token_type_ids"] = enc["token_type_ids"]
        return batch

    return [encode(SAMPLES), encode(SAMPLES[2:3]), encode([SAMPLES[0], SAMPLES[3]])]


def reference_dir(source: ModelSource, workdir: Path) -> Path:
    """A full HF QA checkpoint with the same weights the gang will load."""
    from shardserve.models.hf_weights import WeightSource, save_hf_checkpoint

    weights: WeightSource = source.weights()
    if not source.overlays and weights.locate("qa_outputs.weight") is not None:
        return source.checkpoint
    model = build_model(source)
    return save_hf_checkpoint(
        model.state_dict(),
        source.config,
        workdir / "reference",
        base_config=source.checkpoint / "config.json",
    )


@torch.no_grad()
def reference_logits(ref_dir: Path, batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    from transformers import AutoModelForQuestionAnswering

    ref = AutoModelForQuestionAnswering.from_pretrained(ref_dir).eval()
    outs = []
    for b in batches:
        r = ref(**b)
        outs.append(torch.stack([r.start_logits, r.end_logits], dim=-1))  # (B, S, 2)
    return outs


def best_spans(logits: torch.Tensor, mask: torch.Tensor, *, max_len: int = MAX_ANSWER_TOKENS) -> torch.Tensor:
    """(B, S, 2) logits, (B, S) mask -> (B, 2) best (start, end): argmax of start + end logits
    over spans of real tokens with start <= end < start + max_len."""
    s = logits.shape[1]
    pad = ~mask.bool()
    start = logits[..., 0].float().masked_fill(pad, -torch.inf)  # (B, S)
    end = logits[..., 1].float().masked_fill(pad, -torch.inf)
    score = start[:, :, None] + end[:, None, :]  # (B, S, S)
    i = torch.arange(s)
    allowed = (i[None, :] >= i[:, None]) & (i[None, :] < i[:, None] + max_len)  # (S, S)
    flat = score.masked_fill(~allowed, -torch.inf).flatten(1).argmax(dim=1)  # (B,)
    return torch.stack([flat // s, flat % s], dim=1)


def compare(
    got: list[torch.Tensor],
    want: list[torch.Tensor],
    batches: list[dict[str, torch.Tensor]],
    *,
    tolerance: float,
    dtype: str = "float32",
) -> VerifyResult:
    """Largest |got - want| over unpadded tokens, per logit kind, and the windows whose best span moved."""
    d_start = d_end = 0.0
    windows = changes = 0
    for g, w, b in zip(got, want, batches, strict=True):
        mask = b["attention_mask"].bool()  # (B, S)
        diff = (g.float() - w).abs()  # (B, S, 2)
        d_start = max(d_start, diff[..., 0][mask].max().item())
        d_end = max(d_end, diff[..., 1][mask].max().item())
        windows += len(mask)
        changes += int((best_spans(g, mask) != best_spans(w, mask)).any(dim=1).sum())
    return VerifyResult(
        d_start,
        d_end,
        tolerance,
        [tuple(b["input_ids"].shape) for b in batches],
        dtype=dtype,
        windows=windows,
        span_changes=changes,
    )


def verify_partitioned(
    source: ModelSource,
    dims: ParallelDims,
    *,
    tolerance: float | None = None,
    threads_per_rank: int = 1,
    boundaries: list[int] | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    compile: bool = False,
) -> VerifyResult:
    """Run the gang (ranks on ``device``, computing in ``dtype``, their stages compiled with ``compile``
    as ``shardserve serve --compile on`` does) and the fp32 CPU reference on the
    sample batches and compare (``tolerance`` defaults to the dtype's entry in ``TOLERANCES``; given,
    it must be > 0; ``threads_per_rank`` >= 1): ``ValueError`` before any rank starts otherwise."""
    _check_settings(tolerance, threads_per_rank)
    plan = make_plan(
        source.config, dims, boundaries=boundaries, devices=default_devices(dims.world_size, device=device)
    )
    results = _verify_gang(
        {source.name: (source, plan)},
        tolerance=tolerance,
        threads_per_rank=threads_per_rank,
        dtype=dtype,
        compile=compile,
    )
    return results[source.name]


def verify_multiplexed(
    sources: Mapping[str, ModelSource],
    dims: ParallelDims,
    *,
    tolerance: float | None = None,
    threads_per_rank: int = 1,
    device: str = "cpu",
    dtype: str = "float32",
    compile: bool = False,
) -> dict[str, VerifyResult]:
    """One gang holding every model of ``sources`` (gang name -> model, each split at ``dims`` by
    its own balanced plan) answers each model's sample batches, interleaved micro-batch by
    micro-batch with the others'; each model's answers are compared with its own fp32 reference
    (settings as ``verify_partitioned``). Returns each model's ``VerifyResult`` by name."""
    _check_settings(tolerance, threads_per_rank)
    devices = default_devices(dims.world_size, device=device)
    models = {name: (src, make_plan(src.config, dims, devices=devices)) for name, src in sources.items()}
    return _verify_gang(
        models, tolerance=tolerance, threads_per_rank=threads_per_rank, dtype=dtype, compile=compile
    )


def _check_settings(tolerance: float | None, threads_per_rank: int) -> None:
    if isinstance(threads_per_rank, bool) or not isinstance(threads_per_rank, int) or threads_per_rank < 1:
        raise ValueError(f"threads_per_rank={threads_per_rank!r} must be an integer >= 1")
    if tolerance is not None and not tolerance > 0:
        raise ValueError(f"tolerance={tolerance!r} must be > 0 (a max |logit difference|)")


def _verify_gang(
    models: Mapping[str, tuple[ModelSource, PartitionPlan]],
    *,
    tolerance: float | None,
    threads_per_rank: int,
    dtype: str,
    compile: bool,
) -> dict[str, VerifyResult]:
    """One gang holding ``models``: each model's sample batches, interleaved, against its reference."""
    spec = stream_spec_multi(models, threads_per_rank=threads_per_rank, dtype=dtype, compile=compile)
    dims = spec.plan.dims
    batches = {name: sample_batches(src) for name, (src, _plan) in models.items()}
    want: dict[str, list[torch.Tensor]] = {}
    with tempfile.TemporaryDirectory(prefix="shardserve-verify-") as tmp:
        for i, (name, (src, _plan)) in enumerate(models.items()):
            workdir = Path(tmp) / str(i)
            workdir.mkdir()
            want[name] = reference_logits(reference_dir(src, workdir), batches[name])
    label = "multi-" if len(models) > 1 else ""
    with StreamGang(spec, name=f"verify-{label}pp{dims.pp}-tp{dims.tp}") as gang:
        futures: dict[str, list[Future]] = {name: [] for name in models}
        for k in range(max(len(b) for b in batches.values())):  # micro-batch k of every model, in turn
            for name, bs in batches.items():
                if k < len(bs):
                    b = bs[k]
                    args = (b["input_ids"], b["attention_mask"], b.get("token_type_ids"))
                    futures[name].append(gang.submit(*args, model=name))
        got = {name: [f.result(timeout=300) for f in futs] for name, futs in futures.items()}
    tol = TOLERANCES[dtype] if tolerance is None else tolerance
    results = {}
    for name in models:
        result = compare(got[name], want[name], batches[name], tolerance=tol, dtype=dtype)
        logger.info(
            "verify %s pp=%d tp=%d %s: max |diff| start=%.3g end=%.3g, best span changed in %d of %d windows",
            name,
            dims.pp,
            dims.tp,
            dtype,
            result.max_abs_start,
            result.max_abs_end,
            result.span_changes,
            result.windows,
        )
        results[name] = result
    return results
