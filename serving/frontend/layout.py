"""``shardserve serve``'s layout: ``--pp``/``--tp auto`` chosen, and the layout checked against
``--max-memory-per-rank``, for the models served at start, before any weight loads.

The choice itself is ``partitioner/fit.py``'s (through ``LayoutFlags.choose_layout``,
``partitioner/layout_flags.py``); this module feeds it serve's settings (the models,
the scheduler's largest micro-batch, the resolved dtype, the GPU share of a rank). The CLI calls it
before it loads the models; ``build_app`` calls it for settings that still say ``auto``.

    settings, chosen = fit_serve_layout(ServeSettings(model=["tiny-bert"], pp="auto"))  # ValueError: none fits
"""

from __future__ import annotations

from shardserve.models.registry import ModelSource, resolve_model
from shardserve.partitioner.int8 import calibration_path, model_calibration
from shardserve.partitioner.precision import DtypeChoice, resolve_dtype
from shardserve.serving.frontend.settings import ServeSettings


def _sources(settings: ServeSettings) -> dict[str, ModelSource]:
    """The models served at start that resolve (one that does not is left to its loading, which says why)."""
    sources = {}
    for name, ref in settings.models():
        try:
            sources[name] = resolve_model(ref)
        except (ValueError, OSError):  # ModelConfigError and the like
            continue
    return sources


def serve_precision(settings: ServeSettings) -> DtypeChoice:
    """``--dtype`` resolved for the device and the models served at start: ``auto`` picks int8 where
    every one of them has an int8 calibration (``shardserve quantize``) and the CPU has oneDNN's int8 kernels and no AMX;
    ``int8`` for a model without one is ``CalibrationMissing`` naming the command (one line)."""
    sources = _sources(settings)
    calibrated = bool(sources) and all(calibration_path(s).is_file() for s in sources.values())
    choice = resolve_dtype(settings.dtype, settings.device, int8_calibrated=calibrated)
    if choice.int8:
        for source in sources.values():
            model_calibration(source)  # readable, this format
    return choice


def fit_serve_layout(settings: ServeSettings) -> tuple[ServeSettings, str | None]:
    """``settings`` with ``--pp``/``--tp auto`` replaced by the fewest ranks whose every rank fits
    ``--max-memory-per-rank`` (``partitioner/fit.py``), for every model served at start, at the
    largest micro-batch the scheduler forms (``max_batch_size`` windows, at most ``max_batch_tokens``
    tokens, of ``max_seq_len``) in the resolved dtype; an explicit layout is only checked. A
    ``ValueError`` (``LayoutDoesNotFit``) with the numbers when none fits. With ``--placement`` the
    placement decides (and checks its own ``--device-memory-mb``). A model that does not resolve is
    left to its loading, which says why; a model loaded later (the repository API) is not checked.
    Also returns the line saying which layout ``auto`` chose and why (None: the layout was given)."""
    if settings.placement is not None:
        return settings, None
    configs = {name: source.config for name, source in _sources(settings).items()}
    if not configs:  # nothing to fit: a fixed layout for the loading to fail with its own message
        pp, tp = (1 if d == "auto" else int(d) for d in (settings.pp, settings.tp))
        return (settings.with_layout(pp, tp) if settings.auto_layout else settings), None
    choice = settings.choose_layout(
        configs,
        batch_size=max(1, min(settings.max_batch_size, settings.max_batch_tokens // settings.max_seq_len)),
        seq_len=settings.max_seq_len,
        dtype=serve_precision(settings),
        share=settings.ranks_per_gpu if settings.device == "cuda" else 1,
        remedy="raise --max-memory-per-rank, or lower --max-batch-size / --max-batch-tokens / --max-seq-len",
    )
    if not settings.auto_layout:
        return settings, None
    return settings.with_layout(choice.dims.pp, choice.dims.tp), choice.line()
