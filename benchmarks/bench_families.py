"""Each architecture family's forward against transformers' own, at pp = tp = 1, fp32 and bf16, one run.

The speed check of the families shardserve serves (issue 29): for each family a random-weight
checkpoint of a real model's shape is written with transformers' own ``*ForQuestionAnswering`` class
(seeded, into a temporary folder), loaded by shardserve (``shardserve.models.build.build_model``) and by
transformers (``AutoModelForQuestionAnswering``), and both forwards are timed on the same random
batches, alternating, with the same threads, in each precision (bf16 only where the CPU has bf16
units). The fp32 logits are compared too (max |diff| over the batch).

    python benchmarks/bench_families.py                                # every family, batch 8 x 256
    python benchmarks/bench_families.py --families electra,xlm-roberta --duration 5 --json f.json

Shapes (random weights; the vocabulary sizes are the real ones):
  bert         BERT-base (12 x 768)           roberta      RoBERTa-base (12 x 768)
  xlm-roberta  multilingual MiniLM-L12 (12 x 384, 250 002 pieces)
  electra      ELECTRA-small (12 x 256, embeddings 128)
  albert       ALBERT-base (one 768-wide layer applied 12 times, embeddings 128)
  distilbert   DistilBERT-base (6 x 768)
  deberta-v2   DeBERTa-v3-base (12 x 768, 256 relative-position buckets, 128 100 pieces)
  modernbert   ModernBERT-base (22 x 768, GeGLU 1152, global attention every 3rd layer, 128-token local)
  llama        SmolLM2-135M (30 x 576, 9 query / 3 key-value heads, SwiGLU)
  qwen2        Qwen2 blocks at BERT-base width (12 x 768, 12 / 2 heads, q/k/v biases, 151 936 tokens)
  mistral      Mistral blocks at BERT-base width (12 x 768, 12 / 4 heads, a 4096-token sliding window)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving_report import machine_info

from shardserve.models.build import build_model
from shardserve.models.config import HF_CLASSES, EncoderConfig
from shardserve.models.registry import ModelSource

logger = logging.getLogger("bench_families")

_BASE = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072}
SHAPES: dict[str, dict[str, Any]] = {
    "bert": {**_BASE, "vocab_size": 30522},
    "roberta": {**_BASE, "vocab_size": 50265, "max_position_embeddings": 514, "pad_token_id": 1,
                "type_vocab_size": 1, "layer_norm_eps": 1e-5},
    "xlm-roberta": {"hidden_size": 384, "num_hidden_layers": 12, "num_attention_heads": 12,
                    "intermediate_size": 1536, "vocab_size": 250002, "max_position_embeddings": 514,
                    "pad_token_id": 1, "type_vocab_size": 1, "layer_norm_eps": 1e-5},
    "electra": {"embedding_size": 128, "hidden_size": 256, "num_hidden_layers": 12, "num_attention_heads": 4,
                "intermediate_size": 1024, "vocab_size": 30522},
    "albert": {**_BASE, "embedding_size": 128, "vocab_size": 30000, "hidden_act": "gelu_new"},
    "distilbert": {"dim": 768, "n_layers": 6, "n_heads": 12, "hidden_dim": 3072, "vocab_size": 30522},
    "deberta-v2": {**_BASE, "vocab_size": 128100, "type_vocab_size": 0, "relative_attention": True,
                   "position_buckets": 256, "max_relative_positions": -1, "pos_att_type": ["p2c", "c2p"],
                   "share_att_key": True, "position_biased_input": False, "norm_rel_ebd": "layer_norm",
                   "layer_norm_eps": 1e-7},
    "modernbert": {"hidden_size": 768, "num_hidden_layers": 22, "num_attention_heads": 12,
                   "intermediate_size": 1152, "vocab_size": 50368, "max_position_embeddings": 8192,
                   "global_attn_every_n_layers": 3, "local_attention": 128, "pad_token_id": 50283},
    "llama": {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
              "intermediate_size": 1536, "vocab_size": 49152, "max_position_embeddings": 8192,
              "rope_theta": 100000.0},
    "qwen2": {**_BASE, "num_key_value_heads": 2, "intermediate_size": 2048, "vocab_size": 151936,
              "max_position_embeddings": 32768},
    "mistral": {**_BASE, "num_key_value_heads": 4, "intermediate_size": 2048, "vocab_size": 32000,
                "max_position_embeddings": 32768, "sliding_window": 4096},
}  # fmt: skip

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def write_checkpoint(family: str, out: Path) -> ModelSource:
    """A random ``family`` checkpoint of its SHAPES entry, written by transformers (seed 0)."""
    import transformers

    config_name, model_name = HF_CLASSES[family]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = getattr(transformers, model_name)(getattr(transformers, config_name)(**SHAPES[family]))
    model.save_pretrained(out, safe_serialization=True)
    return ModelSource(family, out, EncoderConfig.from_pretrained_dir(out), out)


def forwards(source: ModelSource, dtype: torch.dtype) -> tuple[Forward, Forward]:
    """shardserve's forward and transformers' of ``source`` in ``dtype`` (the QA head: fp32 in ours)."""
    from transformers import AutoModelForQuestionAnswering

    ours = build_model(source).eval().to_compute_dtype(dtype)
    ref = AutoModelForQuestionAnswering.from_pretrained(source.checkpoint, dtype=dtype).eval()

    def shardserve(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return ours(ids, mask)  # (B, S, 2)

    def transformers_(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            out = ref(input_ids=ids, attention_mask=mask)
        return torch.stack([out.start_logits, out.end_logits], dim=-1).float()  # (B, S, 2)

    return shardserve, transformers_


def timed(forward: Forward, batches: list[tuple[torch.Tensor, torch.Tensor]], duration_s: float) -> float:
    """Examples/s of ``forward`` cycling over ``batches`` for ``duration_s`` (after one warm-up call)."""
    forward(*batches[0])
    done, i, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < duration_s:
        ids, mask = batches[i % len(batches)]
        forward(ids, mask)
        done, i = done + ids.shape[0], i + 1
    return done / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--batch", type=int, default=8, help="windows per forward")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per window")
    p.add_argument("--duration", type=float, default=3.0, help="seconds per timing (two rounds each)")
    p.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    families = [f for f in args.families.split(",") if f]
    if unknown := [f for f in families if f not in SHAPES]:
        p.error(f"unknown family {unknown[0]!r}; choose from {', '.join(SHAPES)}")
    info = machine_info("auto")
    dtypes = [torch.float32] + ([torch.bfloat16] if info["bf16_units"] else [])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            source = write_checkpoint(family, Path(tmp) / family)
            g = torch.Generator().manual_seed(1)
            vocab = source.config.vocab_size
            batches = []
            for _ in range(3):
                ids = torch.randint(5, vocab, (args.batch, args.seq_len), generator=g)
                mask = torch.ones_like(ids)
                mask[0, args.seq_len // 2 :] = 0  # one padded row
                ids[0, args.seq_len // 2 :] = source.config.pad_token_id
                batches.append((ids, mask))
            for dtype in dtypes:
                ours, ref = forwards(source, dtype)
                diff = (ours(*batches[0]) - ref(*batches[0]))[batches[0][1].bool()].abs().max().item()
                ours_s, ref_s = [], []
                for _ in range(2):  # alternate: the VM's speed drifts
                    ours_s.append(timed(ours, batches, args.duration))
                    ref_s.append(timed(ref, batches, args.duration))
                row = {
                    "family": family, "dtype": str(dtype).removeprefix("torch."), "max_abs_diff": diff,
                    "shardserve_ex_s": max(ours_s), "transformers_ex_s": max(ref_s),
                    "params_m": round(sum(p.numel() for p in build_model(source).parameters()) / 1e6, 1),
                }  # fmt: skip
                row["ratio"] = row["shardserve_ex_s"] / row["transformers_ex_s"]
                rows.append(row)
                logger.info("%s %s: %.1f vs %.1f ex/s (x%.2f), max |diff| %.2g", family, row["dtype"],
                            row["shardserve_ex_s"], row["transformers_ex_s"], row["ratio"], diff)  # fmt: skip
                del ours, ref
    print(f"\n{info['cpu']}, {torch.get_num_threads()} threads; batch {args.batch} x {args.seq_len} tokens")
    print(
        f"{'family':12} {'params':>7} {'dtype':9} {'shardserve':>11} {'transformers':>13} {'ratio':>6} {'max|diff|':>9}"
    )
    for r in rows:
        print(f"{r['family']:12} {r['params_m']:6.1f}M {r['dtype']:9} {r['shardserve_ex_s']:11.1f} "
              f"{r['transformers_ex_s']:13.1f} {r['ratio']:6.2f} {r['max_abs_diff']:9.2g}")  # fmt: skip
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {"machine": info, "args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=2
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
