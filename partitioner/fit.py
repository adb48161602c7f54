"""Layouts that fit memory: ``--pp auto`` / ``--tp auto`` and ``--max-memory-per-rank``.

The one home of the choice that ``shardserve plan``, ``serve``, ``verify`` and ``train`` make before
any weight loads: which ``pp x tp`` layout of a model (or of several models sharing the layout)
keeps every rank within a per-rank memory limit, by the plan's own estimate
(``PartitionPlan.memory_estimates``: ``serving_bytes``, or ``training_bytes`` for training), and the
one-line refusal with the numbers when none does, and the sizes people write (``4GiB``,
``4096MiB``, ``4G``, ``500M``, bytes: ``parse_size``). The flags themselves, and their value types
(a size, a degree that may be ``auto``), are ``partitioner/layout_flags.py``'s.

The rule of ``auto`` (either degree, or both; the other stays as given): among the layouts with
``pp`` in ``1..num_layers`` and ``tp`` dividing the attention heads and the MLP width, with at most
``MAX_AUTO_RANKS`` ranks, the first whose fullest rank fits, in the order fewest ranks (``pp*tp``)
first, then on cpu the most pipeline stages (a stage boundary sends one activation per micro-batch;
tensor parallelism all-reduces twice per layer, slow over gloo), on cuda the most tensor-parallel
ranks (no pipeline bubble; NCCL all-reduces are cheap). An explicit layout is only checked.

    budget = memory_budget(None, device="cpu", batch_size=8, seq_len=384, dtype=resolve_dtype("auto"))
    choice = fit_layout({"tiny-bert": config}, pp=AUTO, tp=1, budget=budget)  # LayoutDoesNotFit: one line
    choice.dims, choice.line()        # ParallelDims(pp=2, tp=1), "layout pp=2 x tp=1 (...): ..."
    parse_size("4GiB")                # 4294967296

Run the tests: ``python -m pytest tests/partitioner/test_fit.py -q``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from shardserve.models.config import EncoderConfig
from shardserve.partitioner.cost import (
    RANK_RUNTIME_BYTES,
    InfeasiblePlanError,
    UnitCost,
    analytic_costs,
)
from shardserve.partitioner.plan import ParallelDims, make_plan
from shardserve.partitioner.precision import DtypeChoice

AUTO: Literal["auto"] = "auto"
MAX_AUTO_RANKS = 64  # the largest gang (pp * tp) auto considers
UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}  # K/KiB/Ki: powers of 1024
SI_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}  # KB: powers of 1000
SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?)(i?B?)\s*$", re.IGNORECASE)
SIZE_HELP = "bytes, or a number with a unit: K/M/G/T, KiB/MiB/GiB/TiB (powers of 1024), KB/MB/GB/TB (of 1000)"


class LayoutDoesNotFit(InfeasiblePlanError):
    """No layout allowed keeps every rank within the memory limit; the message prints the numbers."""


def parse_size(text: str | int) -> int:
    """``4GiB``, ``4096MiB``, ``4G``, ``500M``, ``1.5GB``, ``1048576`` -> bytes (``ValueError`` naming
    the text otherwise). A bare or ``i`` unit (``G``, ``Gi``, ``GiB``) is binary, ``GB`` is decimal."""
    if isinstance(text, int) and not isinstance(text, bool):
        number, factor = float(text), 1
    else:
        m = SIZE.match(str(text))
        if m is None or (not m[2] and m[3].lower() in ("i", "ib")):
            raise ValueError(f"{text!r} is not a size: give {SIZE_HELP}, e.g. 4GiB or 500M")
        unit, suffix = m[2].upper(), m[3].lower()
        factor = SI_UNITS[unit + "B"] if suffix == "b" and unit else UNITS[unit]
        number = float(m[1])
    size = int(number * factor)
    if size < 1:
        raise ValueError(f"{text!r} is not a size of at least one byte")
    return size


def format_size(n: float, digits: int = 1) -> str:
    """Bytes as people read them: ``6.1 GiB``, ``512.0 MiB``, ``3.2 KiB``, ``100 B``."""
    for unit, factor in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= factor:
            return f"{n / factor:.{digits}f} {unit}"
    return f"{int(n)} B"


def default_memory_bytes(device: str, *, share: int = 1) -> int:
    """The default limit: the (first) GPU's total memory with cuda, the machine's total RAM with cpu;
    divided by ``share`` ranks that must share one device (serve's ``ranks_per_gpu``)."""
    from shardserve.partitioner.placement.cost_profile import default_device_memory_bytes

    return default_device_memory_bytes(device, 1) // max(1, share)


@dataclass(frozen=True)
class MemoryBudget:
    """What one rank may hold (``limit_bytes``; ``given``: from the flag, else the device's default)
    and what the estimate is for: a micro-batch of ``batch_size x seq_len`` in ``dtype``, serving or
    training (weights, gradients and AdamW state + stored activations)."""

    limit_bytes: int
    batch_size: int
    seq_len: int
    dtype: str  # the resolved compute dtype, e.g. "bfloat16"
    dtype_bytes: int
    training: bool = False
    given: bool = True

    def limit_text(self, digits: int = 1) -> str:
        size = format_size(self.limit_bytes, digits)
        if self.given:
            return f"--max-memory-per-rank is {size}"
        return f"the device has {size} (the default of --max-memory-per-rank)"


def memory_budget(
    limit_bytes: int | None,
    *,
    device: str,
    batch_size: int,
    seq_len: int,
    dtype: DtypeChoice,
    training: bool = False,
    share: int = 1,
) -> MemoryBudget:
    """The budget of one rank: ``limit_bytes`` as given, else the device's (``default_memory_bytes``)."""
    limit = limit_bytes if limit_bytes is not None else default_memory_bytes(device, share=share)
    return MemoryBudget(
        limit,
        batch_size,
        seq_len,
        dtype.name,
        dtype.itemsize,
        training=training,
        given=limit_bytes is not None,
    )


@dataclass(frozen=True)
class RankNeed:
    """The estimate of a layout's fullest rank (of its fullest model, ``model``, when several)."""

    dims: ParallelDims
    rank: int
    weight_bytes: int  # weights (training: + gradients + AdamW state, 16 B/param)
    activation_bytes: int
    model: str | None = None
    runtime_bytes: int = RANK_RUNTIME_BYTES  # the rank process itself (torch, transformers, gloo)

    @property
    def total_bytes(self) -> int:
        return self.runtime_bytes + self.weight_bytes + self.activation_bytes

    def text(self, budget: MemoryBudget, digits: int = 1) -> str:
        """``pp=1 x tp=1 needs 6.5 GiB on rank 0 (process 0.4 GiB + weights 5.9 GiB + activations
        0.2 GiB at batch 8 x seq 384, bfloat16)``."""
        weights = "weights, gradients and AdamW state" if budget.training else "weights"
        of = f"model {self.model}: " if self.model else ""
        batch = "micro-batch" if budget.training else "batch"
        runtime = f"process {format_size(self.runtime_bytes, digits)} + "
        return (
            f"{of}pp={self.dims.pp} x tp={self.dims.tp} needs {format_size(self.total_bytes, digits)} "
            f"on rank {self.rank} ({runtime}{weights} {format_size(self.weight_bytes, digits)} + activations "
            f"{format_size(self.activation_bytes, digits)} at {batch} {budget.batch_size} x seq "
            f"{budget.seq_len}, {budget.dtype})"
        )

    def versus(self, budget: MemoryBudget) -> str:
        """``<text> but <limit>``, with more digits where one would print the same as the other."""
        digits = 1 if format_size(self.total_bytes) != format_size(budget.limit_bytes) else 3
        return f"{self.text(budget, digits)} but {budget.limit_text(digits)}"


@dataclass(frozen=True)
class LayoutChoice:
    """The layout to run (``dims``, dp=1), its fullest rank's estimate, and whether ``auto`` chose it."""

    dims: ParallelDims
    need: RankNeed
    budget: MemoryBudget
    auto: bool
    device: str = "cpu"

    def line(self) -> str:
        """Which layout and why, for ``plan``'s output and the serve/train logs."""
        prefer = "tp" if self.device == "cuda" else "pp"
        why = (
            f"chosen by auto (the fewest ranks whose every rank fits; ties go to more {prefer} on "
            f"{self.device})"
            if self.auto
            else "as given"
        )
        digits = 1 if format_size(self.need.total_bytes) != format_size(self.budget.limit_bytes) else 3
        return (
            f"layout {why}: {self.need.text(self.budget, digits)}, the fullest rank; within the limit: "
            f"{self.budget.limit_text(digits)}"
        )


def rank_need(
    config: EncoderConfig,
    dims: ParallelDims,
    budget: MemoryBudget,
    *,
    costs: list[UnitCost] | None = None,
    boundaries: Sequence[int] | None = None,
    model: str | None = None,
) -> RankNeed:
    """The fullest rank of ``config`` split as ``dims`` (``InfeasiblePlanError`` when it cannot be)."""
    plan = make_plan(
        config,
        ParallelDims(pp=dims.pp, tp=dims.tp),
        boundaries=list(boundaries) if boundaries else None,
        costs=costs,
        seq_len=budget.seq_len,
        devices=("cpu",) * dims.model_parallel_size,  # the estimate does not depend on where
    )
    mem = plan.memory_estimates(
        config, batch_size=budget.batch_size, seq_len=budget.seq_len, dtype_bytes=budget.dtype_bytes
    )
    key = "training_bytes" if budget.training else "serving_bytes"
    stage, est = max(zip(plan.stages, mem, strict=True), key=lambda pair: pair[1][key])
    # the estimate's parts: the rank process, weights (+ optimizer state), and activations
    weights = stage.params_per_rank * (16 if budget.training else budget.dtype_bytes)
    activations = est[key] - RANK_RUNTIME_BYTES - weights
    return RankNeed(dims, stage.ranks[0], weights, activations, model)


def _tp_choices(configs: Sequence[EncoderConfig]) -> list[int]:
    """Tensor-parallel degrees every model can be split into (dividing its heads and MLP width)."""
    g = 0
    for c in configs:
        g = math.gcd(g, math.gcd(c.num_heads, c.intermediate_size))
    return [t for t in range(1, min(g, MAX_AUTO_RANKS) + 1) if g % t == 0]


def candidates(
    configs: Sequence[EncoderConfig], *, pp: int | str, tp: int | str, device: str = "cpu"
) -> list[ParallelDims]:
    """The layouts ``auto`` may pick, in the order it tries them (see the module doc)."""
    pps = [pp] if isinstance(pp, int) else list(range(1, min(c.num_layers for c in configs) + 1))
    tps = [tp] if isinstance(tp, int) else _tp_choices(configs)
    dims = [
        ParallelDims(pp=p, tp=t)
        for p in pps
        for t in tps
        if p * t <= MAX_AUTO_RANKS or (isinstance(pp, int) and isinstance(tp, int))
    ]
    prefer = (lambda d: -d.tp) if device == "cuda" else (lambda d: -d.pp)
    return sorted(dims, key=lambda d: (d.model_parallel_size, prefer(d)))


def fit_layout(
    models: Mapping[str, EncoderConfig],
    *,
    pp: int | str,
    tp: int | str,
    budget: MemoryBudget,
    device: str = "cpu",
    costs: Mapping[str, list[UnitCost]] | None = None,
    boundaries: Sequence[int] | None = None,
    remedy: str = "raise --max-memory-per-rank, or use a smaller batch or sequence length",
) -> LayoutChoice:
    """The layout every model in ``models`` runs with: ``pp``/``tp`` as given, or the first of
    ``candidates`` where they are ``auto``; every rank of every model must fit ``budget``.
    ``LayoutDoesNotFit`` (an ``InfeasiblePlanError``: one line, exit 2) with the numbers otherwise,
    ending in a hint (an explicit layout: the one ``auto`` picks) or ``remedy`` (when none fits)."""
    auto = pp == AUTO or tp == AUTO
    if auto and boundaries:
        raise InfeasiblePlanError(
            "--boundaries needs a fixed --pp (it names the first layer of stages 1..pp-1)"
        )
    costs = dict(costs or {})
    for name, config in models.items():  # once per model, for every candidate
        costs.setdefault(name, analytic_costs(config, seq_len=budget.seq_len))
    named = len(models) > 1
    tried: list[RankNeed] = []
    unsplittable: InfeasiblePlanError | None = None
    for dims in candidates(list(models.values()), pp=pp, tp=tp, device=device):
        try:
            needs = [
                rank_need(c, dims, budget, costs=costs[n], boundaries=boundaries, model=n if named else None)
                for n, c in models.items()
            ]
        except InfeasiblePlanError as err:
            if not auto:
                raise  # an explicit layout that cannot be: its own message (tp=5 does not divide ...)
            unsplittable = unsplittable or err
            continue  # this candidate cannot split some model: the next
        need = max(needs, key=lambda x: x.total_bytes)
        if need.total_bytes <= budget.limit_bytes:
            return LayoutChoice(dims, need, budget, auto, device)
        tried.append(need)
    if not tried:
        raise unsplittable or InfeasiblePlanError(f"pp={pp} x tp={tp}: more than {MAX_AUTO_RANKS} ranks")
    if not auto:
        hint = _hint(models, tried[0].dims, budget, device, costs, remedy)
        raise LayoutDoesNotFit(f"{tried[0].versus(budget)}; {hint}")
    leanest = min(tried, key=lambda x: x.total_bytes)
    pps = sorted({d.dims.pp for d in tried})
    space = f"pp={pp}" if isinstance(pp, int) else f"pp={pps[0]}..{pps[-1]}"
    space += (
        f" x tp={tp}"
        if isinstance(tp, int)
        else f" x tp={','.join(map(str, sorted({d.dims.tp for d in tried})))}"
    )
    raise LayoutDoesNotFit(
        f"no layout of {space} (at most {MAX_AUTO_RANKS} ranks) fits: the leanest, {leanest.versus(budget)}; "
        f"{remedy}"
    )


def _hint(
    models: Mapping[str, EncoderConfig],
    given: ParallelDims,
    budget: MemoryBudget,
    device: str,
    costs: dict[str, list[UnitCost]],
    remedy: str,
) -> str:
    """What to try instead of the explicit layout ``given`` that does not fit: what ``auto`` picks."""
    try:
        dims = fit_layout(models, pp=AUTO, tp=AUTO, budget=budget, device=device, costs=costs).dims
    except InfeasiblePlanError:
        return f"no layout of at most {MAX_AUTO_RANKS} ranks fits either: {remedy}"
    flags = [f"--pp {dims.pp}"] if dims.pp != given.pp else []
    flags += [f"--tp {dims.tp}"] if dims.tp != given.tp else []
    return f"try {' '.join(flags)} (or --pp auto --tp auto)"
