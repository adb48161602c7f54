"""The layout flags, declared once: how a model is split over ranks, where they run, in which dtype.

``shardserve serve``, ``plan``, ``verify``, ``train`` and ``eval`` share these flags; each command's
settings model inherits the fields it takes from the mixins here, as ``ServeSettings`` inherits
``GangFlags``. They are plain pydantic models: the fields stay the command's own (``settings.pp``,
not a nested ``settings.layout.pp``), their flags keep their names (``--pp``, ``--max-memory-per-rank``)
and, in ``ServeSettings``, a pydantic-settings model, each also reads ``SHARDSERVE_<NAME>``:

- ``SplitFlags``: ``pp``, ``tp`` (an integer, or ``auto``: the fewest ranks that fit, chosen by
  ``partitioner/fit.py``), ``max_memory_per_rank`` (a size: ``4GiB``, ``500M``, ...) and ``device``
  (cpu or cuda). ``choose_layout`` is the one call that checks them against the plan's memory
  estimate (``memory_budget`` + ``fit_layout``). ``train`` takes these (its compute precision is
  ``--precision``: autocast over fp32 master weights, not an inference dtype).
- ``DtypeFlag``: ``dtype``, the ranks' compute dtype (``partitioner/precision.py`` resolves ``auto``).
  ``eval`` takes this one only (it runs on cpu, a fixed ``--pp`` x ``--tp`` gang with no ``auto``
  and no memory limit: its two integers are its own).
- ``LayoutFlags``: both, for ``serve``, ``plan`` and ``verify``, whose ``--help`` lists them in a
  section of their own (``LAYOUT_SECTION``: ``LAYOUT_FIELDS``); ``train`` lists them under its
  "parallelism".

The field types (``Degree``, ``MemorySize``) validate a value, from a flag or the environment, once
for every command. A field's help is one text, true for every command; where a command has more to
say about one (what serve's memory estimate is for), its settings model adds a sentence with
``flag_notes`` (``shardserve/flags.py``) instead of declaring the field again.

    class PartitionSettings(LayoutFlags, Settings): ...      # plan's and verify's flags
    choice = settings.choose_layout({"tiny-bert": cfg}, batch_size=8, seq_len=384, dtype=dtype)
    choice.dims, choice.line()                               # LayoutDoesNotFit (one line) when none fits
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field

from shardserve.models.config import EncoderConfig
from shardserve.partitioner.cost import UnitCost
from shardserve.partitioner.fit import (
    AUTO,
    MAX_AUTO_RANKS,
    SIZE_HELP,
    LayoutChoice,
    fit_layout,
    memory_budget,
    parse_size,
)
from shardserve.partitioner.precision import DTYPE_CHOICES, DtypeChoice

DEVICE_CHOICES: tuple[str, ...] = ("cpu", "cuda")


def _size_field(value: Any) -> int | None:
    """A settings field validator: a size (``parse_size``), or None (not given)."""
    if value is None or value == "":
        return None
    try:
        return parse_size(value)
    except ValueError:
        raise ValueError(f"must be a size: {SIZE_HELP}, e.g. 4GiB, 4096MiB, 4G, 500M") from None


def _degree_field(value: Any) -> int | str:
    """A settings field validator: an integer >= 1, or ``auto``."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    try:
        number = int(value) if not isinstance(value, bool | float) else None
    except (TypeError, ValueError):
        number = None
    if number is None or number < 1:
        raise ValueError("must be an integer greater than or equal to 1, or auto")
    return number


Degree = Annotated[int | Literal["auto"], BeforeValidator(_degree_field)]  # a settings field: N or auto
MemorySize = Annotated[int | None, BeforeValidator(_size_field)]  # a settings field: a size, or None
MEMORY_HELP = (
    "memory one rank may use, checked against the plan's estimate before any weight loads: "
    f"{SIZE_HELP}, e.g. 4GiB, 500M. A layout whose fullest rank needs more is refused with the numbers; "
    "pp/tp auto pick the fewest ranks that fit. Default: the device's memory: the GPU's total with "
    "cuda, the machine's total RAM with cpu (ranks on one machine share it: no limit per rank beyond "
    "the machine's)"
)
DEGREE_HELP = f"or auto: the fewest ranks that fit max_memory_per_rank (at most {MAX_AUTO_RANKS} in all)"


class SplitFlags(BaseModel):
    """How a model is split over ranks and where they run (see module doc): ``serve``, ``plan``,
    ``verify``, ``train``."""

    pp: Degree = Field(1, description=f"pipeline-parallel degree: number of stages, {DEGREE_HELP}")
    tp: Degree = Field(
        1, description=f"tensor-parallel degree: ranks per stage sharing heads and MLP, {DEGREE_HELP}"
    )
    max_memory_per_rank: MemorySize = Field(
        None, description=MEMORY_HELP, json_schema_extra={"metavar": "SIZE"}
    )
    device: Literal[DEVICE_CHOICES] = Field(  # type: ignore[valid-type]
        "cpu",
        description="where ranks run: cpu (gloo), or cuda (the visible GPUs, a gang's ranks on different GPUs "
        "first; NCCL when every rank has its own GPU, gloo through host memory when ranks share one)",
    )

    @property
    def auto_layout(self) -> bool:
        """pp or tp is ``auto``: the layout is chosen by ``choose_layout`` (``partitioner/fit.py``)."""
        return self.pp == AUTO or self.tp == AUTO

    def choose_layout(
        self,
        models: Mapping[str, EncoderConfig],
        *,
        batch_size: int,
        seq_len: int,
        dtype: DtypeChoice,
        training: bool = False,
        share: int = 1,
        costs: Mapping[str, list[UnitCost]] | None = None,
        boundaries: Sequence[int] | None = None,
        remedy: str | None = None,
    ) -> LayoutChoice:
        """``pp`` x ``tp`` (either ``auto``) for ``models``, every rank within ``max_memory_per_rank``
        (default: the device's memory, divided by ``share`` ranks per GPU) by the plan's estimate of
        a ``batch_size x seq_len`` micro-batch in ``dtype`` (``training``: + gradients and AdamW
        state): ``partitioner/fit.py``'s ``memory_budget`` and ``fit_layout``. ``LayoutDoesNotFit``
        (one line, exit 2) with the numbers and ``remedy`` when none fits."""
        budget = memory_budget(
            self.max_memory_per_rank,
            device=self.device,
            batch_size=batch_size,
            seq_len=seq_len,
            dtype=dtype,
            training=training,
            share=share,
        )
        return fit_layout(
            models,
            pp=self.pp,
            tp=self.tp,
            budget=budget,
            device=self.device,
            costs=costs,
            boundaries=boundaries,
            **({} if remedy is None else {"remedy": remedy}),
        )


class DtypeFlag(BaseModel):
    """The ranks' compute dtype (see module doc): ``serve``, ``plan``, ``verify``, ``eval``."""

    dtype: Literal[DTYPE_CHOICES] = Field(  # type: ignore[valid-type]
        "auto",
        description="compute dtype of the ranks: auto (bfloat16 on GPUs and on CPUs with bf16 units, AMX or "
        "AVX512-BF16, else float32; serve and eval pick int8 on x86 CPUs with AVX2 or better and no AMX for "
        "models calibrated with `shardserve quantize`), float32, bfloat16, float16 (only where the device "
        "has fp16 units), int8 (CPU: calibrated static int8 Linear layers, the rest bf16 or fp32; F1 within "
        "1 % of fp32, docs/benchmarks.md). Span logits stay float32",
    )


class LayoutFlags(DtypeFlag, SplitFlags):  # (this order: pp, tp, ... dtype, as --help lists them)
    """Every layout flag (see module doc): ``serve``, ``plan``, ``verify``."""


LAYOUT_FIELDS: tuple[str, ...] = tuple(LayoutFlags.model_fields)  # pp, tp, max_memory_per_rank, device, dtype
LAYOUT_SECTION = (  # the --help section of serve's, plan's and verify's layout flags
    "the layout: how the model is split over ranks, where they run, in which dtype (the same flags in "
    "serve, plan and verify; train and eval take some)"
)
