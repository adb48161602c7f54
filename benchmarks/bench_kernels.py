"""Kernel-level forward throughput and accuracy: fp32 vs bf16 vs bf16 + torch.compile vs int8, one run.

The measurement behind the precision / compile / int8 decisions (issue 9): the whole unpartitioned
model, no HTTP, no gang, on real SQuAD windows padded to exactly --seq-len tokens, at each batch
size, with --threads torch threads. Every variant is also run on the same --accuracy-windows and
compared with fp32: max |logit diff| over the attended tokens and the fraction of windows whose
best span (argmax of start + end over context tokens, end - start < 30) is unchanged. The product's
bound for reduced precision is max |diff| <= 0.25 with (near-)full best-span agreement.

Variants (--variants, comma-separated):

  fp32            the model as shardserve ran it before issue 9
  bf16            weights and activations in bf16 (oneDNN; AMX / AVX512-BF16 when the CPU has them),
                  QA head in fp32
  bf16-compile    bf16 + torch.compile (inductor, weight freezing, dynamic=False: one graph per shape)
  bf16-compile-dyn  the same with dynamic=True (one graph for every batch size / bucket; what a
                  serving rank would need, since its batch shapes vary)
  fp32-compile    fp32 + torch.compile (freezing, static shapes)
  fp32-compile-dyn  fp32 + torch.compile (dynamic shapes: the candidate on a CPU without bf16 units)
  int8            torch.ao dynamic quantization of the encoder's nn.Linear layers (qint8 weights,
                  activations quantized per batch; fbgemm/VNNI), fp32 elsewhere, QA head fp32
  int8-torchao    torchao Int8DynamicActivationInt8Weight on the encoder's Linear layers + compile
                  (needs `pip install torchao`; skipped with one line when absent)
  ort-fp32        ONNX Runtime, the model exported with torch.onnx.export (needs the `bench` extra)
  ort-int8        ONNX Runtime after onnxruntime.quantization.quantize_dynamic (QInt8 weights)

    python benchmarks/bench_kernels.py                               # default model, seq 160, batch 1 and 32
    python benchmarks/bench_kernels.py --duration 3 --variants fp32,bf16,int8 --json out.json

Figures are only comparable within one run on one quiet machine; the CPU and its bf16/AMX/int8 units
are printed with them.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SQUAD = REPO.parent / "shared" / "data" / "squad" / "squad-v1.1-train-pool.json"
VARIANTS = (
    "fp32",
    "bf16",
    "bf16-compile",
    "bf16-compile-dyn",
    "fp32-compile",
    "fp32-compile-dyn",
    "int8",
    "int8-torchao",
    "ort-fp32",
    "ort-int8",
)
DEFAULT_VARIANTS = "fp32,bf16,bf16-compile,bf16-compile-dyn,int8,ort-fp32,ort-int8"
MAX_ANSWER_TOKENS = 30

logger = logging.getLogger("bench_kernels")

# A forward: (input_ids, attention_mask, token_type_ids | None) -> (B, S, 2) fp32 logits (torch tensor)
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass
class KernelResult:
    variant: str
    batch_size: int
    examples_per_s: float | None  # None: skipped
    max_abs_diff: float | None = None  # vs fp32, over attended tokens
    span_agreement: float | None = None  # fraction of windows with the fp32 best span
    note: str = ""


# ------------------------------------------------------------------------------------------ pure helpers


def best_spans(
    logits: torch.Tensor, context_mask: torch.Tensor, max_len: int = MAX_ANSWER_TOKENS
) -> torch.Tensor:
    """Best (start, end) per window: argmax of start + end logits over context tokens with
    0 <= end - start < max_len. logits (N, S, 2), context_mask (N, S) bool -> (N, 2) int64."""
    logits = logits.float()
    n, s, _ = logits.shape
    neg = torch.finfo(torch.float32).min / 4
    start = logits[..., 0].masked_fill(~context_mask, neg)  # (N, S)
    end = logits[..., 1].masked_fill(~context_mask, neg)
    scores = start[:, :, None] + end[:, None, :]  # (N, S_start, S_end)
    i = torch.arange(s)
    ok = (i[None, :] >= i[:, None]) & (i[None, :] - i[:, None] < max_len)  # (S, S)
    scores = scores.masked_fill(~ok, 2 * neg).reshape(n, -1)
    flat = scores.argmax(dim=1)
    return torch.stack([flat // s, flat % s], dim=1)


def compare_logits(
    ref: torch.Tensor, out: torch.Tensor, attention_mask: torch.Tensor, context_mask: torch.Tensor
) -> tuple[float, float]:
    """(max |out - ref| over attended tokens, fraction of windows whose best span is unchanged)."""
    keep = attention_mask.bool()[..., None].expand_as(ref)
    diff = (out.float() - ref.float()).abs()[keep]
    max_diff = float(diff.max()) if diff.numel() else 0.0
    same = (best_spans(ref, context_mask) == best_spans(out, context_mask)).all(dim=1)
    return max_diff, float(same.float().mean())


def parse_variants(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    return names


# ------------------------------------------------------------------------------------------ inputs


def load_windows(model: str, squad: Path, *, seq_len: int, n: int):
    """(source, WindowBatch) of ``n`` SQuAD windows padded to exactly ``seq_len`` tokens (generated
    text when the SQuAD file is absent)."""

    from shardserve.models.qa_windows import WindowConfig, encode_qa, pad_windows
    from shardserve.models.registry import resolve_model

    source = resolve_model(model)
    pairs = _pairs(squad, n)
    tok = source.tokenizer()
    q_len = min(64, seq_len // 4)
    enc = encode_qa(
        tok,
        [q for q, _ in pairs],
        [c for _, c in pairs],
        window=WindowConfig(
            max_seq_len=seq_len, doc_stride=max(8, min(128, seq_len - q_len - 8) // 2), max_question_len=q_len
        ),
    )
    windows = (enc.windows * (1 + n // max(1, len(enc.windows))))[:n]
    return source, pad_windows(windows, pad_token_id=enc.pad_token_id, pad_to_length=seq_len)


def _pairs(squad: Path, n: int) -> list[tuple[str, str]]:
    if squad.is_file():
        data = json.loads(squad.read_text())
        pairs = [
            (qa["question"], p["context"]) for a in data["data"] for p in a["paragraphs"] for qa in p["qas"]
        ]
        step = max(1, len(pairs) // n)
        return pairs[::step][:n]
    logger.warning("%s not found: generated questions", squad)
    words = "the team won the final in the city stadium after a long season of games and training".split()
    return [
        (f"Who won game {i}?", " ".join(words[(i + j) % len(words)] for j in range(200)) + f" Team {i} won.")
        for i in range(n)
    ]


# ------------------------------------------------------------------------------------------ variants


def make_forward(variant: str, source, *, onnx_dir: Path) -> tuple[Forward | None, str]:
    """A forward for ``variant`` (None with the reason when it cannot run here)."""
    from torch import nn

    from shardserve.models.build import build_model
    from shardserve.partitioner.compiled import compile_stage  # what `shardserve serve --compile on` runs

    types = source.config.uses_token_types
    if variant.startswith("ort-"):
        try:
            import onnxruntime  # noqa: F401
        except ImportError:
            return None, "onnxruntime not installed (pip install -e '.[bench]')"
        session = ort_session(source, onnx_dir, int8=variant == "ort-int8", threads=torch.get_num_threads())
        return (lambda ids, mask, tt: ort_forward(session, ids, mask, tt)), "ONNX Runtime CPU EP"
    dtype = torch.bfloat16 if variant.startswith("bf16") else torch.float32
    model = build_model(source, dtype=dtype)
    note = str(dtype).removeprefix("torch.")
    if variant == "int8":
        from torch.ao.quantization import quantize_dynamic

        model.layers = quantize_dynamic(model.layers, {nn.Linear}, dtype=torch.qint8)
        note = "torch.ao quantize_dynamic qint8 on encoder Linear layers"
    elif variant == "int8-torchao":
        try:
            from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
        except ImportError:
            return None, "torchao not installed"
        quantize_(model.layers, Int8DynamicActivationInt8WeightConfig())
        model = compile_stage(model, dynamic=False)
        note = "torchao int8 dynamic act + int8 weight, compiled"
    if variant.endswith("-compile"):
        model = compile_stage(model, dynamic=False)
        note += " + torch.compile (static)"
    elif variant.endswith("-compile-dyn"):
        model = compile_stage(model, dynamic=True)
        note += " + torch.compile (dynamic)"

    def forward(ids, mask, tt):
        return model(ids, mask, tt if types else None)

    return forward, note


def export_onnx(source, path: Path) -> Path:
    """The plain fp32 model as ONNX (dynamic batch and sequence axes)."""
    from shardserve.models.build import build_model
    from shardserve.models.packing import padded_inference

    model = build_model(source)
    ids = torch.full((2, 16), 1000, dtype=torch.long)
    mask = torch.ones_like(ids)
    names = ["input_ids", "attention_mask", "token_type_ids"]
    with padded_inference():  # traced packed, an all-ones mask would be dropped from the graph's inputs
        torch.onnx.export(
            model,
            (ids, mask, torch.zeros_like(ids)),
            str(path),
            input_names=names,
            output_names=["logits"],
            dynamic_axes={**{k: {0: "batch", 1: "seq"} for k in names}, "logits": {0: "batch", 1: "seq"}},
            opset_version=17,
            dynamo=False,
        )
    return path


def ort_session(source, onnx_dir: Path, *, int8: bool, threads: int):
    """An ONNX Runtime session over the exported model (int8: dynamic quantization, QInt8 weights)."""
    import onnxruntime as ort

    fp32 = onnx_dir / "model.onnx"
    if not fp32.exists():
        export_onnx(source, fp32)
    path = fp32
    if int8:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        path = onnx_dir / "model-int8.onnx"
        if not path.exists():
            quantize_dynamic(str(fp32), str(path), weight_type=QuantType.QInt8)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def ort_forward(session, ids: torch.Tensor, mask: torch.Tensor, tt: torch.Tensor | None) -> torch.Tensor:
    feed = {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
    if any(i.name == "token_type_ids" for i in session.get_inputs()):
        feed["token_type_ids"] = (tt if tt is not None else torch.zeros_like(ids)).numpy()
    return torch.from_numpy(session.run(None, feed)[0])


# ------------------------------------------------------------------------------------------ measuring


def throughput(forward: Forward, batches: list[tuple], *, duration_s: float) -> float:
    """Examples/s of ``forward`` cycling over ``batches`` for ``duration_s`` (after 2 warm-up calls)."""
    forward(*batches[0])
    forward(*batches[-1])
    done, i = 0, 0
    t0 = time.perf_counter()
    while True:
        b = batches[i % len(batches)]
        forward(*b)
        done += int(b[0].shape[0])
        i += 1
        if time.perf_counter() - t0 >= duration_s:
            break
    return done / (time.perf_counter() - t0)


def run(args: argparse.Namespace) -> list[KernelResult]:
    torch.set_num_threads(args.threads)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    n = max(max(sizes) * 2, args.accuracy_windows)
    source, wb = load_windows(args.model, args.squad, seq_len=args.seq_len, n=n)
    ids, mask, tt = wb.input_ids, wb.attention_mask, wb.token_type_ids
    ctx_mask = wb.offsets[..., 0] >= 0  # (N, S) context tokens
    acc = slice(0, args.accuracy_windows)
    results: list[KernelResult] = []
    ref: torch.Tensor | None = None
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        for variant in ["fp32"] + [v for v in args.variants if v != "fp32"]:
            t0 = time.perf_counter()
            forward, note = make_forward(variant, source, onnx_dir=Path(tmp))
            if forward is None:
                print(f"skipping {variant}: {note}")
                results.append(KernelResult(variant, 0, None, note=note))
                continue
            # accuracy (also warms the compiled graphs for batch 32 where used)
            outs = [
                forward(ids[i : i + 32], mask[i : i + 32], tt[i : i + 32])
                for i in range(0, args.accuracy_windows, 32)
            ]
            logits = torch.cat(outs)[: args.accuracy_windows].float()
            if variant == "fp32":
                ref = logits
            assert ref is not None
            max_diff, agree = compare_logits(ref, logits, mask[acc], ctx_mask[acc])
            setup_s = time.perf_counter() - t0
            if variant not in args.variants:  # fp32 only as the reference
                continue
            for bs in sizes:
                batches = [
                    (ids[i : i + bs], mask[i : i + bs], tt[i : i + bs]) for i in range(0, n - bs + 1, bs)
                ]
                eps = throughput(forward, batches, duration_s=args.duration)
                results.append(
                    KernelResult(variant, bs, eps, max_diff, agree, f"{note}; setup+accuracy {setup_s:.0f}s")
                )
                logger.info("%s batch %d: %.1f ex/s", variant, bs, eps)
            del forward, outs
            gc.collect()
    return results


def print_table(results: list[KernelResult], args: argparse.Namespace) -> None:
    from shardserve.models.cpu import cpu_capabilities

    caps = cpu_capabilities()
    print(
        f"\nmodel={args.model} seq_len={args.seq_len} threads={args.threads} cores={os.cpu_count()} "
        f"torch={torch.__version__} duration={args.duration:g}s per cell"
    )
    print(
        f"cpu: {caps.describe()}; bf16 units: {caps.bf16}, AMX: {caps.amx}, int8 kernels: {caps.int8_unit or 'none'}"
    )
    sizes = sorted({r.batch_size for r in results if r.examples_per_s is not None})
    base = {r.batch_size: r.examples_per_s for r in results if r.variant == "fp32" and r.examples_per_s}
    head = "".join(f" {'b' + str(b) + ' ex/s':>10} {'vs fp32':>7}" for b in sizes)
    print(f"{'variant':<18}{head} {'max|diff|':>9} {'span ok':>7}  note")
    for variant in dict.fromkeys(r.variant for r in results):
        rows = {r.batch_size: r for r in results if r.variant == variant}
        any_row = next(iter(rows.values()))
        if any_row.examples_per_s is None:
            print(f"{variant:<18} skipped: {any_row.note}")
            continue
        cells = ""
        for b in sizes:
            r = rows.get(b)
            v = r.examples_per_s if r else None
            ratio = f"{v / base[b]:.2f}x" if v and base.get(b) else "-"
            cells += f" {v:>10.1f} {ratio:>7}" if v else f" {'-':>10} {'-':>7}"
        print(
            f"{variant:<18}{cells} {any_row.max_abs_diff:>9.4f} {100 * any_row.span_agreement:>6.1f}%  "
            f"{any_row.note}"
        )
    print("accuracy bound for reduced precision: max|diff| <= 0.25 vs fp32, best span unchanged")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="model name or HF directory (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=160, help="tokens per window (default: %(default)s)")
    p.add_argument("--batch-sizes", default="1,32", help="comma-separated batch sizes (default: %(default)s)")
    p.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="torch / ORT threads (default: %(default)s)"
    )
    p.add_argument("--duration", type=float, default=10.0, help="seconds per cell (default: %(default)s)")
    p.add_argument(
        "--variants",
        default=DEFAULT_VARIANTS,
        help=f"comma-separated, from {', '.join(VARIANTS)} (default: %(default)s)",
    )
    p.add_argument(
        "--accuracy-windows", type=int, default=64, help="windows compared with fp32 (default: %(default)s)"
    )
    p.add_argument("--squad", type=Path, default=DEFAULT_SQUAD, help="SQuAD v1.1 JSON (default: %(default)s)")
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    args.variants = parse_variants(args.variants)
    results = run(args)
    print_table(results, args)
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
