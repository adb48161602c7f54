"""The question answering that bench_serving.py's Python servers all run, so that they differ only in
their serving: the naive FastAPI server (b), LitServe (e) and Mosec (f). One `QAModel` per model
process: the registry's model (``resolve_model``) at a precision on a device, ``encode_qa`` of one
question, ``pad_windows``, the forward, ``decode_spans`` (top 1), answered as /v1/qa's JSON
(``{"answers": [{"text", "score", "start", "end"}]}``); one question (``answer``) or the windows of
several questions padded into one forward (``answer_batch``, what a batching server runs).

Not run on its own: the naive server is ``bench_serving.py --naive-server``, the others
``litserve_qa.py`` and ``mosec_qa.py`` next to this file. Tests: ``tests/benchmarks/test_bench_helpers.py``.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger("bench_serving.qa_model")


class QAModel:
    """The model, its tokenizer and window settings (--max-seq-len, doc stride 128, questions up to
    64 tokens), with ``threads`` torch threads in this process."""

    def __init__(self, model: str, *, dtype: str, device: str, max_seq_len: int, threads: int) -> None:
        import torch

        from shardserve.models.build import build_model
        from shardserve.models.qa_windows import WindowConfig
        from shardserve.models.registry import resolve_model
        from shardserve.partitioner.precision import DTYPES

        torch.set_num_threads(threads)
        self.source = resolve_model(model)
        self.tokenizer = self.source.tokenizer()
        self.model = build_model(self.source, dtype=DTYPES[dtype], device=device)
        self.device = device
        self.types = self.source.config.uses_token_types
        self.window = WindowConfig(max_seq_len=max_seq_len, doc_stride=128, max_question_len=64)
        logger.info("%s on %s, %s, %d torch threads", model, device, dtype, threads)

    def encode(self, question: str, context: str) -> Any:
        """One question's `EncodedBatch`: its unpadded windows (more than one for a long context)."""
        from shardserve.models.qa_windows import encode_qa

        return encode_qa(self.tokenizer, [question], [context], window=self.window)

    @staticmethod
    def pad(encs: Sequence[Any]) -> Any:
        """The windows of ``encs`` (one question's or several) right-padded into one `WindowBatch`, (W, S)."""
        from shardserve.models.qa_windows import pad_windows

        return pad_windows([w for e in encs for w in e.windows], pad_token_id=encs[0].pad_token_id)

    def forward(self, b: Any) -> Any:
        """Start / end logits of a `WindowBatch`, (W, S, 2), on the CPU."""
        import torch

        tt = b.token_type_ids.to(self.device) if self.types else None
        with torch.inference_mode():
            return self.model(b.input_ids.to(self.device), b.attention_mask.to(self.device), tt).cpu()

    @staticmethod
    def decode(windows: Sequence[Any], logits: Any, context: str) -> dict[str, Any]:
        """The /v1/qa answer of one question from its windows' logits, (W, >= S, 2) (padding cut off)."""
        from shardserve.models.qa_decoding import decode_spans

        pred = decode_spans(windows, logits[..., 0], logits[..., 1], context, top_k=1)
        return {
            "answers": [
                {"text": a.text, "score": a.score, "start": a.start, "end": a.end} for a in pred.answers
            ]
        }

    def answer(self, question: str, context: str) -> dict[str, Any]:
        """One question end to end (what the naive server runs per request)."""
        enc = self.encode(question, context)
        return self.decode(enc.windows, self.forward(self.pad([enc])), context)

    @staticmethod
    def split(logits: Any, encs: Sequence[Any]) -> list[Any]:
        """The logits of ``pad(encs)``'s forward, (sum of W_i, S, 2), cut into each question's, (W_i, S, 2)."""
        return list(logits.split([len(e.windows) for e in encs]))

    def answer_batch(self, asks: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """/v1/qa bodies (``question``, ``context``) answered with ONE forward over all their windows
        (padded to the longest)."""
        encs = [self.encode(a["question"], a["context"]) for a in asks]
        logits = self.split(self.forward(self.pad(encs)), encs)
        return [self.decode(e.windows, x, a["context"]) for e, x, a in zip(encs, logits, asks, strict=True)]


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The flags LitServe's and Mosec's server scripts share: the model, its windows, the workers
    running it and their batches."""
    p.add_argument("--model", default="default", help="model name or HF directory (default: %(default)s)")
    p.add_argument("--dtype", default="float32", help="model precision (default: %(default)s)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="(default: %(default)s)")
    p.add_argument("--max-seq-len", type=int, default=384, help="window length (default: %(default)s)")
    p.add_argument("--workers", type=int, default=2, help="model worker processes (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (default: %(default)s)")
    p.add_argument(
        "--max-batch-size", type=int, default=32, help="requests per batch, at most (default: %(default)s)"
    )
