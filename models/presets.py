"""The tiny random-weight presets tests serve and train (``tiny-bert`` ... ``tiny-mistral``): their
configs, and their checkpoints written once by ``transformers`` itself (seeded) into the cache
directory, with tokenizers trained here by the tokenizers library (WordPiece presets use the bundled
vocabulary; SentencePiece-style Unigram and BPE ones frame a pair as their families do).

    python -c "from shardserve.models.presets import materialise_preset; print(materialise_preset('tiny-bert'))"
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

from shardserve.models.bundled import cache_dir, minilm_dir
from shardserve.models.config import DECODER_ARCHS, HF_CLASSES
from shardserve.models.hf_weights import copy_tokenizer_files

logger = logging.getLogger(__name__)

# Small configs for tests: 6 layers so pp=3 gets 2 each; 4 heads and intermediate 128 so tp=2 divides.
# initializer_range 0.1 (not 0.02) so random logits are large enough for parity checks to bite.
_TINY_COMMON: dict[str, Any] = {"vocab_size": 30522, "max_position_embeddings": 512, "initializer_range": 0.1}
_TINY_DECODER: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 2000,  # the byte-level / SentencePiece BPE tokenizer's (UNIGRAM_VOCAB)
    "max_position_embeddings": 512,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
}
TINY_PRESETS: dict[str, dict[str, Any]] = {
    "tiny-bert": {
        "model_type": "bert",
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "type_vocab_size": 2,
        "pad_token_id": 0,
        **_TINY_COMMON,
    },
    "tiny-roberta": {
        # pad_token_id=0 so the bundled WordPiece tokenizer's padding matches the position offset.
        "model_type": "roberta",
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "type_vocab_size": 1,
        "pad_token_id": 0,
        "layer_norm_eps": 1e-5,
        "bos_token_id": 101,
        "eos_token_id": 102,
        "vocab_size": 30522,
        "max_position_embeddings": 514,
        "initializer_range": 0.1,
    },
    "tiny-xlm-roberta": {
        "model_type": "xlm-roberta",
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "type_vocab_size": 1,
        "pad_token_id": 1,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "layer_norm_eps": 1e-5,
        "vocab_size": 2000,  # the Unigram tokenizer's (UNIGRAM_VOCAB)
        "max_position_embeddings": 514,
        "initializer_range": 0.1,
    },
    "tiny-electra": {
        "model_type": "electra",
        "embedding_size": 32,  # narrower than hidden_size: the projection is exercised
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "type_vocab_size": 2,
        "pad_token_id": 0,
        **_TINY_COMMON,
    },
    "tiny-albert": {
        "model_type": "albert",
        "embedding_size": 32,
        "hidden_size": 64,
        "num_hidden_layers": 6,  # one shared layer, applied 6 times
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "type_vocab_size": 2,
        "pad_token_id": 0,
        "hidden_act": "gelu_new",
        "vocab_size": 2000,  # the Unigram tokenizer's (UNIGRAM_VOCAB)
        "max_position_embeddings": 512,
        "initializer_range": 0.1,
    },
    # DeBERTa-v3's layout: disentangled attention over 32 relative-position buckets (fewer than the
    # verify samples' tokens: bucketing is exercised), the key/query projections shared with them
    "tiny-deberta-v2": {
        "model_type": "deberta-v2",
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 2000,  # the Unigram tokenizer's (UNIGRAM_VOCAB)
        "max_position_embeddings": 512,
        "type_vocab_size": 0,
        "relative_attention": True,
        "position_buckets": 32,
        "max_relative_positions": -1,
        "pos_att_type": ["p2c", "c2p"],
        "share_att_key": True,
        "position_biased_input": False,
        "norm_rel_ebd": "layer_norm",
        "layer_norm_eps": 1e-7,
        "pad_token_id": 0,
        "initializer_range": 0.1,
    },
    # ModernBERT: global attention every 3rd layer, a 32-token local window between (16 each side:
    # the verify samples are longer), rotary positions, GeGLU; windows up to 1024 tokens
    "tiny-modernbert": {
        "model_type": "modernbert",
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 2000,  # the byte-level BPE tokenizer's (UNIGRAM_VOCAB)
        "max_position_embeddings": 1024,
        "global_attn_every_n_layers": 3,
        "local_attention": 32,
        "pad_token_id": 0,
        "cls_token_id": 1,
        "sep_token_id": 2,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "initializer_range": 0.2,  # at 0.1 its random start logits tie to 0.01 in most windows
    },
    # decoders: grouped-query attention (4 query heads read 2 key/value heads), SwiGLU MLPs
    "tiny-llama": {"model_type": "llama", **_TINY_DECODER, "bos_token_id": 1, "eos_token_id": 2},
    "tiny-qwen2": {"model_type": "qwen2", **_TINY_DECODER, "bos_token_id": 0, "eos_token_id": 0},
    # a 32-token sliding window: windows longer than it exercise the sliding-window mask
    "tiny-mistral": {
        "model_type": "mistral",
        **_TINY_DECODER,
        "sliding_window": 32,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "tiny-distilbert": {
        "model_type": "distilbert",
        "dim": 64,
        "n_layers": 6,
        "n_heads": 4,
        "hidden_dim": 128,
        "pad_token_id": 0,
        **_TINY_COMMON,
    },
}
PRESET_SEED = 1234
UNIGRAM_VOCAB = 2000


def materialise_preset(name: str, *, root: Path | None = None) -> Path:
    """Write the tiny preset's checkpoint once (atomically) and return its directory."""
    spec = TINY_PRESETS[name]
    root = root or cache_dir()
    target = root / f"{name}-s{PRESET_SEED}-v2"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        _write_hf_checkpoint(spec, tmp)
        if spec["model_type"] in ("xlm-roberta", "albert", "deberta-v2"):
            tiny_unigram_tokenizer(spec["model_type"]).save_pretrained(tmp)
        elif spec["model_type"] in (*DECODER_ARCHS, "modernbert"):
            tiny_bpe_tokenizer(spec["model_type"]).save_pretrained(tmp)
        else:
            copy_tokenizer_files(minilm_dir(), tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("wrote preset %s to %s", name, target)
    return target


def _write_hf_checkpoint(spec: dict[str, Any], out: Path) -> None:
    import torch
    import transformers

    config_name, model_name = HF_CLASSES[spec["model_type"]]
    config_cls, model_cls = getattr(transformers, config_name), getattr(transformers, model_name)
    fields = {k: v for k, v in spec.items() if k != "model_type"}
    with torch.random.fork_rng():
        torch.manual_seed(PRESET_SEED)
        model = model_cls(config_cls(**fields))
    model.save_pretrained(out, safe_serialization=True)


def _tiny_corpus() -> list[str]:
    """Training text for the tiny tokenizers: the bundled WordPiece vocabulary's whole words, lower
    and capitalised, and punctuation, 64 to a line (offline, deterministic)."""
    words = [w for w in (minilm_dir() / "vocab.txt").read_text(encoding="utf-8").split() if w.isalnum()]
    words += [w.capitalize() for w in words if w.isalpha()] + list(".,;:!?'\"()-%$")
    return [" ".join(words[i : i + 64]) for i in range(0, len(words), 64)]


def _cls_sep_pair(specials: list[str], *, types: bool = True) -> Any:
    """The ``[CLS] A [SEP] B [SEP]`` frame (token types 0 / 1 with ``types``), with the ids the
    ``specials`` list gives ``[CLS]`` and ``[SEP]``."""
    from tokenizers import processors

    a, b = (":0", ":1") if types else ("", "")
    return processors.TemplateProcessing(
        single=f"[CLS]{a} $A{a} [SEP]{a}",
        pair=f"[CLS]{a} $A{a} [SEP]{a} $B{b} [SEP]{b}",
        special_tokens=[("[CLS]", specials.index("[CLS]")), ("[SEP]", specials.index("[SEP]"))],
    )


def tiny_bpe_tokenizer(kind: str) -> Any:
    """A BPE tokenizer of ``UNIGRAM_VOCAB`` pieces, framed as the family's own frames a pair:
    ``qwen2`` byte-level (GPT-2 style, spans keep their leading space, ``<|endoftext|>`` 0, the pair
    is ``A B`` with nothing between); ``modernbert`` byte-level too (``[PAD]`` 0, ``[CLS]`` 1,
    ``[SEP]`` 2; ``[CLS] A [SEP] B [SEP]``); ``llama`` / ``mistral`` SentencePiece-style (``▁`` word
    marks; ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2; the pair is ``<s> A <s> B``). No token types."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if kind in ("qwen2", "modernbert"):
        if kind == "qwen2":
            specials, names = ["<|endoftext|>"], dict(eos_token="<|endoftext|>", pad_token="<|endoftext|>")
            post = processors.ByteLevel(trim_offsets=False)
        else:
            specials = ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"]
            names = dict(pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]", unk_token="[UNK]",
                         mask_token="[MASK]")  # fmt: skip
            template = _cls_sep_pair(specials, types=False)
            post = processors.Sequence([processors.ByteLevel(trim_offsets=False), template])
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        specials = ["<unk>", "<s>", "</s>"]
        names = dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>")
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        alphabet = []
        post = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s>:1 $B:1", special_tokens=[("<s>", 1)]
        )
    trainer = trainers.BpeTrainer(
        vocab_size=UNIGRAM_VOCAB, special_tokens=specials, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(_tiny_corpus(), trainer)
    tok.post_processor = post
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, model_input_names=["input_ids", "attention_mask"], **names
    )


def tiny_unigram_tokenizer(kind: str) -> Any:
    """A SentencePiece-style fast tokenizer of ``UNIGRAM_VOCAB`` pieces (Unigram model, ``▁`` word
    marks) for ``kind``: ``xlm-roberta`` (cased; ``<s>`` 0, ``<pad>`` 1, ``</s>`` 2, ``<unk>`` 3; pair
    ``<s> A </s></s> B </s>``, no token types) or ``albert`` (lower-cased; ``<pad>`` 0, ``<unk>`` 1,
    ``[CLS]`` 2, ``[SEP]`` 3; pair ``[CLS] A [SEP] B [SEP]`` with token types 0 / 1) or ``deberta-v2``
    (DeBERTa-v3's: cased; ``[PAD]`` 0, ``[CLS]`` 1, ``[SEP]`` 2, ``[UNK]`` 3; the same pair). Trained on the
    bundled WordPiece vocabulary's whole words, lower and capitalised, and punctuation (offline,
    deterministic)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    if kind == "xlm-roberta":
        specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
        names = dict(bos_token="<s>", eos_token="</s>", sep_token="</s>", cls_token="<s>", unk_token="<unk>",
                     pad_token="<pad>", mask_token="<mask>")  # fmt: skip
        post = processors.TemplateProcessing(
            single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
        )
        normalizer, cls = normalizers.NFKC(), transformers.XLMRobertaTokenizerFast
    elif kind == "deberta-v2":
        specials = ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"]
        names = dict(bos_token="[CLS]", eos_token="[SEP]", sep_token="[SEP]", cls_token="[CLS]", unk_token="[UNK]",
                     pad_token="[PAD]", mask_token="[MASK]")  # fmt: skip
        post = _cls_sep_pair(specials)
        normalizer, cls = normalizers.NFKC(), transformers.PreTrainedTokenizerFast
    else:
        specials = ["<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]"]
        names = dict(bos_token="[CLS]", eos_token="[SEP]", sep_token="[SEP]", cls_token="[CLS]", unk_token="<unk>",
                     pad_token="<pad>", mask_token="[MASK]")  # fmt: skip
        post = _cls_sep_pair(specials)
        normalizer, cls = (
            normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()]),
            transformers.AlbertTokenizerFast,
        )
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(
        vocab_size=UNIGRAM_VOCAB, special_tokens=specials, unk_token=names["unk_token"], show_progress=False
    )
    tok.train_from_iterator(_tiny_corpus(), trainer)
    tok.post_processor = post
    types = ["token_type_ids"] if kind in ("albert", "deberta-v2") else []
    return cls(tokenizer_object=tok, model_input_names=["input_ids", *types, "attention_mask"], **names)
