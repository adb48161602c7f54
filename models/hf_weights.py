"""Hugging Face checkpoint reading and name mapping for every supported family.

``CheckpointReader`` opens a local HF model directory (``model.safetensors``, a sharded
``model.safetensors.index.json``, or ``pytorch_model.bin`` read with ``weights_only=True``) and
reads whole tensors or index regions of them (``Region``, a tuple of slices) lazily: safetensors
regions come straight off the mmap, so a caller that wants a quarter of a matrix reads a quarter of
its bytes.

``hf_name(arch, canonical)`` maps this project's canonical parameter names (``models/encoder.py``;
a family on transformers' modules: ``Family.checkpoint_name`` in ``models/hf_family.py``)
to Hugging Face names; ``load_weights(module, source, config)`` fills every parameter of a
(possibly partial) model from a ``WeightSource``. Its ``regions_of`` hook (canonical name, stored
shape -> a list of ``Region`` or None) lets a caller ask for only parts of each stored tensor; what
such a part means (a tensor-parallel shard) is ``partitioner/shard_loading.py``'s business, not this module's.

    report = load_weights(model, source.weights(), config)                  # whole tensors
    report = load_weights(part, weights, config, regions_of=lambda name, shape: [(slice(0, 32),)])
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from shardserve.models.config import HF_CLASSES, EncoderConfig
from shardserve.models.hf_family import FAMILIES

logger = logging.getLogger(__name__)

Region = tuple[slice, ...]
"""Which part of a stored tensor to read: one step-less slice per leading dimension (``t[region]``)."""

RegionsOf = Callable[[str, tuple[int, ...]], list[Region] | None]
"""(Canonical parameter name, its stored tensor's shape) -> the regions of that tensor to load,
concatenated along the last dimension they slice (one region, or one per block of a fused
projection); None for all of it."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or does not match the config; the message names the file."""


# ---------------------------------------------------------------------------------------------
# Name mapping
# ---------------------------------------------------------------------------------------------

_BERT_LAYER = {
    "attention.query": "attention.self.query",
    "attention.key": "attention.self.key",
    "attention.value": "attention.self.value",
    "attention.out": "attention.output.dense",
    "attention_norm": "attention.output.LayerNorm",
    "mlp.up": "intermediate.dense",
    "mlp.down": "output.dense",
    "mlp_norm": "output.LayerNorm",
}
_DISTIL_LAYER = {
    "attention.query": "attention.q_lin",
    "attention.key": "attention.k_lin",
    "attention.value": "attention.v_lin",
    "attention.out": "attention.out_lin",
    "attention_norm": "sa_layer_norm",
    "mlp.up": "ffn.lin1",
    "mlp.down": "ffn.lin2",
    "mlp_norm": "output_layer_norm",
}
_ALBERT_LAYER = {
    "attention.query": "attention.query",
    "attention.key": "attention.key",
    "attention.value": "attention.value",
    "attention.out": "attention.dense",
    "attention_norm": "attention.LayerNorm",
    "mlp.up": "ffn",
    "mlp.down": "ffn_output",
    "mlp_norm": "full_layer_layer_norm",
}
_SHARED_LAYER_RE = re.compile(r"^layers\.\d+\.(.+)$")  # what any index of a shared layer names
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")


def hf_name(arch: str, canonical: str) -> str:
    """Canonical name -> Hugging Face name without the base-model prefix (``bert.`` etc.)."""
    if arch in FAMILIES:
        return FAMILIES[arch].checkpoint_name(canonical)
    if canonical.startswith(
        "embeddings.project."
    ):  # ELECTRA's beside its embeddings, ALBERT's in its encoder
        where = "encoder.embedding_hidden_mapping_in." if arch == "albert" else "embeddings_project."
        return where + canonical.removeprefix("embeddings.project.")
    if canonical.startswith(("embeddings.", "qa_outputs.")):
        return canonical
    m = _LAYER_RE.match(canonical)
    if not m:
        raise KeyError(f"no Hugging Face name for parameter {canonical!r}")
    index, module, kind = m.groups()
    if arch == "distilbert":
        return f"transformer.layer.{index}.{_DISTIL_LAYER[module]}.{kind}"
    if arch == "albert":  # every layer is the one shared layer
        return f"encoder.albert_layer_groups.0.albert_layers.0.{_ALBERT_LAYER[module]}.{kind}"
    return f"encoder.layer.{index}.{_BERT_LAYER[module]}.{kind}"


def hf_prefix(arch: str) -> str:
    """The base model's attribute in ``*ForQuestionAnswering`` (XLM-RoBERTa's is ``roberta``)."""
    if arch in FAMILIES:
        return FAMILIES[arch].prefix + "."
    return "roberta." if arch == "xlm-roberta" else f"{arch}."


def outside_base(arch: str, canonical: str) -> bool:
    """Whether parameter ``canonical`` lives outside the base model (the span head): its checkpoint
    name has no base-model prefix."""
    return canonical.startswith(FAMILIES[arch].outside if arch in FAMILIES else "qa_outputs.")


def to_hf_state_dict(arch: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Canonical state dict -> ``*ForQuestionAnswering`` naming that ``transformers`` loads."""
    out = {}
    for name, tensor in state.items():
        mapped = hf_name(arch, name)
        out[mapped if outside_base(arch, name) else hf_prefix(arch) + mapped] = tensor
    return out


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def region_shape(shape: tuple[int, ...], region: Region | None) -> tuple[int, ...] | None:
    """Shape of ``tensor[region]`` for a tensor of ``shape``; None when the region has too many dims."""
    if region is None:
        return tuple(shape)
    if len(region) > len(shape):
        return None
    sliced = [len(range(*s.indices(size))) for s, size in zip(region, shape, strict=False)]
    return (*sliced, *shape[len(region) :])


class _SafetensorsFile:
    """One safetensors file. Each read maps the file afresh and unmaps it after: the pages a rank read
    do not stay in its resident set beside the parameters they were copied into (with one mapping
    held open, a rank's peak RSS was its weights twice over)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                self.shapes = {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: cannot open safetensors file ({exc})") from exc
        self.keys = set(self.shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def read(self, name: str, region: Region | None) -> torch.Tensor:
        try:
            with safe_open(str(self.path), framework="pt", device="cpu") as handle:
                if region is None:
                    return handle.get_tensor(name)
                rest = [slice(None)] * (len(self.shapes[name]) - len(region))
                return handle.get_slice(name)[(*region, *rest)]
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{self.path}: cannot read tensor {name!r} ({exc})") from exc


class _TorchBinFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # legacy (non-zip) format cannot be mmapped
                state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # unpickling errors come in many types
            raise CheckpointError(f"{path}: cannot load with torch.load(weights_only=True) ({exc})") from exc
        if not isinstance(state, dict):
            raise CheckpointError(f"{path}: expected a state dict, got {type(state).__name__}")
        self.state = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        self.keys = set(self.state)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.state[name].shape)

    def read(self, name: str, region: Region | None) -> torch.Tensor:
        tensor = self.state[name]
        return (tensor if region is None else tensor[region]).clone()


class CheckpointReader:
    """Lazy tensor access to one local Hugging Face model directory (or one safetensors file)."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        self.path = path
        self._files: dict[str, _SafetensorsFile | _TorchBinFile] = {}
        self._where: dict[str, str] = {}
        if path.is_file():
            self._add(path)
            return
        if not path.is_dir():
            raise CheckpointError(f"{path}: checkpoint directory does not exist")
        for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            index_path = path / index_name
            if index_path.is_file():
                try:
                    weight_map = json.loads(index_path.read_text())["weight_map"]
                except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
                    raise CheckpointError(f"{index_path}: bad shard index ({exc})") from exc
                for shard_file in sorted(set(weight_map.values())):
                    self._add(path / shard_file)
                return
        for name in ("model.safetensors", "pytorch_model.bin"):
            if (path / name).is_file():
                self._add(path / name)
                return
        raise CheckpointError(
            f"{path}: no weights found (expected model.safetensors, a sharded index, or pytorch_model.bin)"
        )

    def _add(self, file: Path) -> None:
        if not file.is_file():
            raise CheckpointError(f"{file}: weight file listed in the index is missing")
        reader = _SafetensorsFile(file) if file.suffix == ".safetensors" else _TorchBinFile(file)
        self._files[str(file)] = reader
        for key in reader.keys:
            self._where[key] = str(file)

    def names(self) -> set[str]:
        return set(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def file_of(self, name: str) -> str:
        return self._where[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._files[self._where[name]].shape(name)

    def read(self, name: str, region: Region | None = None) -> torch.Tensor:
        """Tensor ``name``, or only ``tensor[region]`` (read off the mmap for safetensors)."""
        return self._files[self._where[name]].read(name, region)


@dataclass
class WeightSource:
    """Where a model's weights come from: a HF checkpoint plus optional overlays.

    Overlays are safetensors files keyed by canonical names (e.g. a fine-tuned QA head and top
    layers shipped as a small file over a base model); the last overlay naming a tensor wins.
    """

    checkpoint: Path
    arch: str
    overlays: tuple[Path, ...] = ()
    _reader: CheckpointReader | None = field(default=None, repr=False)
    _overlay_readers: list[CheckpointReader] | None = field(default=None, repr=False)
    _prefix: str | None = field(default=None, repr=False)

    def _open(self) -> None:
        if self._reader is None:
            self._reader = CheckpointReader(self.checkpoint)
            self._overlay_readers = [CheckpointReader(p) for p in self.overlays]
            prefix = hf_prefix(self.arch)  # a QA checkpoint names its base model's tensors with it
            self._prefix = prefix if any(n.startswith(prefix) for n in self._reader.names()) else ""

    def overlay_tensor(self, canonical: str) -> tuple[CheckpointReader, str] | None:
        """(reader, name) of the last overlay holding ``canonical`` (e.g. a LoRA factor), or None."""
        self._open()
        assert self._overlay_readers is not None
        for overlay in reversed(self._overlay_readers):
            if (name := self._overlay_name(overlay, canonical)) is not None:
                return overlay, name
        return None

    def _overlay_name(self, overlay: CheckpointReader, canonical: str) -> str | None:
        """``canonical`` as ``overlay`` stores it; ALBERT's one layer under any layer index (a training
        run wrote each stage's copy under the index of that stage's first layer)."""
        if canonical in overlay:
            return canonical
        if self.arch == "albert" and (m := _SHARED_LAYER_RE.match(canonical)):
            return next(
                (n for n in sorted(overlay.names()) if (k := _SHARED_LAYER_RE.match(n)) and k[1] == m[1]),
                None,
            )
        return None

    def locate(self, canonical: str) -> tuple[CheckpointReader, str] | None:
        """(reader, stored name) holding ``canonical``, or None when no file has it."""
        self._open()
        assert self._reader is not None and self._overlay_readers is not None
        if (found := self.overlay_tensor(canonical)) is not None:
            return found
        name = hf_name(self.arch, canonical)
        candidates = [name] if outside_base(self.arch, canonical) else [self._prefix + name, name]
        for cand in list(candidates):  # TF-era checkpoints name LayerNorm parameters gamma/beta
            if ".LayerNorm." in cand or "layer_norm." in cand:
                candidates.append(cand.replace(".weight", ".gamma").replace(".bias", ".beta"))
        for cand in candidates:
            if cand in self._reader:
                return self._reader, cand
        return None


@dataclass
class LoadReport:
    """What ``load_weights`` did beyond a plain copy."""

    initialised: list[str] = field(default_factory=list)
    bytes_read: int = 0


@torch.no_grad()
def load_weights(
    module: nn.Module,
    source: WeightSource,
    config: EncoderConfig,
    *,
    head_seed: int = 0,
    regions_of: RegionsOf | None = None,
) -> LoadReport:
    """Fill every parameter of ``module`` (already materialised, e.g. by ``to_empty``) from ``source``.

    ``regions_of(name, stored_shape)`` (default: None for every name) picks the parts of the stored
    tensor a parameter receives, concatenated; only those parts are read. A missing QA head (base
    encoder checkpoints such as the bundled MiniLM) is initialised with a fixed seed, identically for every caller, and
    reported; any other missing tensor or shape mismatch is a CheckpointError.

    LoRA overlays: when an overlay holds ``X.lora_A`` (r, in) and ``X.lora_B`` (out, r) for a linear
    ``X`` (scale already folded into B), ``X.weight`` receives ``W + B A``, region by region:
    ``(W + B A)[rows, cols] = W[rows, cols] + B[rows, :] A[:, cols]``, so only those rows of B and
    columns of A are read.
    """
    report = LoadReport()
    for name, param in module.named_parameters():
        found = source.locate(name)
        if found is None:
            if name.startswith("qa_outputs."):
                full = _init_head_tensor(name, config, seed=head_seed)
                regions = regions_of(name, tuple(full.shape)) if regions_of is not None else None
                param.copy_(_joined([full if r is None else full[r] for r in regions or [None]], regions))
                report.initialised.append(name)
                continue
            raise CheckpointError(
                f"{source.checkpoint}: parameter {name!r} (HF name {hf_name(source.arch, name)!r}) not found"
            )
        reader, stored = found
        full_shape = reader.shape(stored)
        regions = regions_of(name, full_shape) if regions_of is not None else None
        if _joined_shape(full_shape, regions) != tuple(param.shape):
            where = "" if regions is None else f" (reading {regions})"
            raise CheckpointError(
                f"{reader.file_of(stored)}: tensor {stored!r} has shape {list(full_shape)}, but the config "
                f"expects {list(param.shape)}{where}"
            )
        parts = []
        for region in regions or [None]:
            part = reader.read(stored, region)
            if name.endswith(".weight"):
                part = _add_lora_delta(part, source, name[: -len(".weight")], region)
            parts.append(part)
        tensor = _joined(parts, regions)
        param.copy_(tensor.to(param.dtype))
        report.bytes_read += tensor.numel() * tensor.element_size()
    if report.initialised:
        logger.warning(
            "checkpoint %s has no QA head; initialised %s (seed=%d) - fine-tune before trusting answers",
            source.checkpoint,
            ", ".join(report.initialised),
            head_seed,
        )
    return report


def _joined_shape(shape: tuple[int, ...], regions: list[Region] | None) -> tuple[int, ...] | None:
    """Shape of the parts of a ``shape`` tensor that ``regions`` read, joined; None if they cannot be."""
    shapes = [region_shape(shape, r) for r in regions or [None]]
    if None in shapes or len({len(s) for s in shapes}) != 1:
        return None
    if len(shapes) == 1:
        return shapes[0]
    assert regions is not None
    dim = len(regions[0]) - 1
    if len({s[:dim] + s[dim + 1 :] for s in shapes}) != 1:
        return None
    joined = list(shapes[0])
    joined[dim] = sum(s[dim] for s in shapes)
    return tuple(joined)


def _joined(parts: list[torch.Tensor], regions: list[Region] | None) -> torch.Tensor:
    """The parts read for ``regions``, concatenated along the last dimension the regions slice."""
    if len(parts) == 1:
        return parts[0]
    assert regions is not None
    return torch.cat(parts, dim=len(regions[0]) - 1)


def _add_lora_delta(
    weight: torch.Tensor, source: WeightSource, owner: str, region: Region | None
) -> torch.Tensor:
    """``weight`` (``W[region]`` of an (out, in) ``W``) plus the overlay's ``(B A)[region]``."""
    found_a = source.overlay_tensor(f"{owner}.lora_A")
    found_b = source.overlay_tensor(f"{owner}.lora_B")
    if found_a is None and found_b is None:
        return weight
    if found_a is None or found_b is None:
        raise CheckpointError(f"overlay has only one LoRA factor of {owner!r} (need lora_A and lora_B)")
    a_region = b_region = None
    if region is not None:
        rows, cols = (*region, slice(None), slice(None))[:2]
        a_region, b_region = (slice(None), cols), (rows,)
    a = found_a[0].read(found_a[1], a_region).float()  # (r, in')
    b = found_b[0].read(found_b[1], b_region).float()  # (out', r)
    delta = b @ a  # (out', in')
    if delta.shape != weight.shape:
        raise CheckpointError(
            f"LoRA factors of {owner!r} give a {list(delta.shape)} update for a {list(weight.shape)} weight"
        )
    return (weight.float() + delta).to(weight.dtype)


def _init_head_tensor(name: str, config: EncoderConfig, *, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if name.endswith(".weight"):
        return torch.empty(2, config.hidden_size).normal_(0.0, config.initializer_range, generator=gen)
    return torch.zeros(2)


def save_hf_checkpoint(
    state: dict[str, torch.Tensor],
    config: EncoderConfig,
    out_dir: str | Path,
    *,
    base_config: Path,
    tokenizer_dir: Path | None = None,
) -> Path:
    """Write a ``*ForQuestionAnswering`` directory that ``transformers`` loads (safetensors).

    ``state`` holds canonical names; ``base_config`` is the HF ``config.json`` the model came
    from (its architecture entry is rewritten); tokenizer files are copied when given.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_cfg = json.loads(Path(base_config).read_text())
    hf_cfg["architectures"] = [HF_CLASSES[config.arch][1]]
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in to_hf_state_dict(config.arch, state).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer_dir is not None:
        copy_tokenizer_files(tokenizer_dir, out)
    return out


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",  # WordPiece (BERT, DistilBERT)
    "vocab.json",  # byte-level BPE (RoBERTa)
    "merges.txt",
)


def copy_tokenizer_files(src_dir: str | Path, out_dir: str | Path) -> None:
    """Copy whichever Hugging Face tokenizer files ``src_dir`` has into ``out_dir``."""
    for name in TOKENIZER_FILES:
        if (Path(src_dir) / name).is_file():
            shutil.copy(Path(src_dir) / name, Path(out_dir) / name)
