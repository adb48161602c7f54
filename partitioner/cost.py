"""Cost model for splitting an encoder into pipeline stages, and per-rank memory estimates.

The model is a chain of units: ``embeddings``, ``layer 0 … layer L-1``, ``qa_head``. Each unit has
a cost (relative forward time) and parameter bytes. Costs come from shapes (``analytic_costs``:
matmul FLOPs plus an elementwise term, so the embeddings and the head count for what they do) or
from a short measurement on the target device (``profile_costs``).

``balanced_split`` cuts the chain into ``pp`` contiguous stages minimising the slowest stage
(a min-max linear partition, solved exactly by dynamic programming). Embeddings always sit in
stage 0 and the head in the last stage; every stage owns at least one layer.

Memory (``serving_memory_bytes`` / ``training_memory_bytes``) follows the usual accounting: the
rank process's own runtime (``RANK_RUNTIME_BYTES``), weights / tp for sharded matrices, plus activations of the micro-batches in flight; training adds
gradients and Adam moments (the 16·N-bytes rule for mixed precision: 2 weights + 2 grads + 4 fp32
master + 4 + 4 moments; fp32 training is 4 + 4 + 4 + 4 = 16 as well). The data-parallel
all-reduce volume of a rank per optimizer step is ``ring_allreduce_bytes`` of its fp32 gradients.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from shardserve.models.config import EncoderConfig

# A rank process's own resident memory before any weight: Python, torch, transformers' modules, gloo
# (measured on CPU, torch 2.13 / transformers 5.24: 370-390 MB). ``PartitionPlan.memory_estimates``
# adds it once per rank.
RANK_RUNTIME_BYTES = 400 * 2**20


class InfeasiblePlanError(ValueError):
    """No split satisfies the constraints; the message prints the numbers."""


@dataclass(frozen=True)
class UnitCost:
    """Cost of one unit of the layer chain."""

    name: str  # "embeddings", "layer.3", "qa_head"
    cost: float  # relative forward time (FLOPs-equivalent or seconds)
    params: int  # parameter count of the whole (unsharded) unit
    sharded_params: int  # the part of ``params`` split across tensor-parallel ranks
    shard_row: int = 1  # parameters per indivisible row of the sharded part (a vocabulary row)
    shared: bool = False  # its parameters are those of every other shared unit (ALBERT's layers)
    stage_params: int = 0  # held once by each stage that holds the unit (DeBERTa's relative table)
    kv_params: int = 0  # the part of ``sharded_params`` in key/value projections, split by whole heads
    kv_heads: int = 1  # ... over this many heads: tp > kv_heads leaves each rank one whole head


def _layer_matrices(c: EncoderConfig) -> int:
    """Weights of a layer's projections: q and out (heads x head_dim), k and v (key/value heads), and
    two MLP matrices (three when gated: gate, up, down); all tp-sharded."""
    h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return 2 * h * q + 2 * h * kv + (3 if c.gated_mlp else 2) * h * c.intermediate_size


def _kv_params(c: EncoderConfig) -> int:
    """Weights and biases of a layer's key and value projections."""
    kv = c.num_kv_heads * c.head_dim
    return 2 * c.hidden_size * kv + (2 * kv if c.qkv_bias else 0)


def _relative_table_params(c: EncoderConfig) -> int:
    """DeBERTa's relative-position table and its LayerNorm, as transformers' encoder builds them
    (every pipeline stage holds them: ``models/deberta.py``); 0 for other families."""
    if c.arch != "deberta-v2":
        return 0
    hf = c.hf_fields
    if not hf.get("relative_attention", False):
        return 0
    max_relative = int(hf.get("max_relative_positions", -1))
    buckets = int(hf.get("position_buckets", -1))
    rows = 2 * (buckets if buckets > 0 else max_relative if max_relative >= 1 else c.max_position_embeddings)
    norm = "layer_norm" in [x.strip() for x in str(hf.get("norm_rel_ebd", "none")).lower().split("|")]
    return rows * c.hidden_size + (2 * c.hidden_size if norm else 0)


def _layer_params(c: EncoderConfig) -> tuple[int, int]:
    h, i = c.hidden_size, c.intermediate_size
    qkv_bias = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim if c.qkv_bias else 0
    if c.gated_mlp:  # column-parallel q/k/v biases (Qwen2); two norms' weights (no MLP biases)
        sharded_bias, replicated = qkv_bias, 2 * h
    else:  # q, k, v, up biases are column-parallel; out/down biases and two LayerNorms replicated
        sharded_bias, replicated = qkv_bias + i, 2 * h + 4 * h
    matrices = _layer_matrices(c)
    return matrices + sharded_bias + replicated, matrices + sharded_bias


def _embedding_params(c: EncoderConfig) -> tuple[int, int]:
    e = c.embedding_size
    word = c.vocab_size * e  # vocab-parallel
    if c.gated_mlp:  # the token table alone (rotary positions have no weights)
        return word, word
    positions = c.max_position_embeddings
    if c.arch == "deberta-v2" and not c.hf_fields.get("position_biased_input", True):
        positions = 0  # DeBERTa-v3: relative positions only, no absolute table
    other = (positions + c.type_vocab_size) * e + 2 * e
    if c.projects_embeddings:  # ELECTRA: E -> H, replicated
        other += e * c.hidden_size + c.hidden_size
    return word + other, word


def analytic_costs(config: EncoderConfig, *, seq_len: int) -> list[UnitCost]:
    """Per-token forward cost of each unit from shapes (FLOPs, elementwise ops weighted 1)."""
    h, i, s = config.hidden_size, config.intermediate_size, seq_len
    layer_flops = 2 * _layer_matrices(config) + 4 * s * config.num_heads * config.head_dim  # + QK^T, AV
    layer_elementwise = 12 * h + i + 5 * config.num_heads * s  # norms, residuals, act, softmax
    units = [UnitCost("embeddings", 10.0 * h, *_embedding_params(config), shard_row=config.embedding_size)]
    lp, ls = _layer_params(config)
    each = dict(
        shared=config.shares_layers,
        stage_params=_relative_table_params(config),
        kv_params=_kv_params(config),
        kv_heads=config.num_kv_heads,
    )
    units += [
        UnitCost(f"layer.{k}", float(layer_flops + layer_elementwise), lp, ls, **each)
        for k in range(config.num_layers)
    ]
    # what sits before the span classifier: a decoder's final norm; ModernBERT's, and its dense + norm
    final_norm = {"modernbert": 2 * h + h * h}.get(config.arch, h if config.is_decoder else 0)
    units.append(UnitCost("qa_head", float(4 * h + 2 + final_norm), 2 * h + 2 + final_norm, 0))
    return units


@torch.no_grad()
def profile_costs(
    config: EncoderConfig,
    *,
    batch_size: int = 4,
    seq_len: int = 128,
    device: str = "cpu",
    repeats: int = 3,
) -> list[UnitCost]:
    """Measure each unit's forward time (seconds, median of ``repeats``) on random weights."""
    from shardserve.models.build import new_model

    model = new_model(dataclasses.replace(config, num_layers=1)).to(device).eval()  # layers are alike
    ids = torch.randint(0, config.vocab_size, (batch_size, seq_len), device=device)
    mask = torch.ones(batch_size, seq_len, dtype=torch.long, device=device)

    def timed(fn) -> float:
        fn()  # warm-up
        samples = []
        for _ in range(repeats):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            samples.append(time.perf_counter() - t0)
        return sorted(samples)[len(samples) // 2]

    analytic = analytic_costs(config, seq_len=seq_len)
    embeddings, head = model.embeddings, model.qa_outputs
    assert embeddings is not None and head is not None
    hidden = embeddings(ids)
    t_emb = timed(lambda: embeddings(ids))
    t_head = timed(lambda: head(hidden))
    model.embeddings = None
    for name in model.head_modules:
        setattr(model, name, None)
    t_layer = timed(lambda: model(hidden, mask))  # the one layer (and its mask)
    measured = [t_emb] + [t_layer] * config.num_layers + [t_head]
    return [dataclasses.replace(u, cost=t) for u, t in zip(analytic, measured, strict=True)]


def balanced_split(costs: list[UnitCost], pp: int) -> list[tuple[int, int]]:
    """Split layers into ``pp`` contiguous stages minimising the most expensive stage.

    ``costs`` is [embeddings, layer 0..L-1, qa_head]. Returns per stage the layer range
    ``(start, end)`` (end exclusive). Embeddings count towards stage 0, the head to the last.
    """
    n_layers = len(costs) - 2
    if pp < 1 or pp > n_layers:
        raise InfeasiblePlanError(f"pp={pp} stages need 1 <= pp <= num_layers={n_layers}")
    emb, head = costs[0].cost, costs[-1].cost
    layer = [u.cost for u in costs[1:-1]]
    prefix = [0.0]
    for c in layer:
        prefix.append(prefix[-1] + c)

    def stage_cost(a: int, b: int, first: bool, last: bool) -> float:
        return prefix[b] - prefix[a] + (emb if first else 0.0) + (head if last else 0.0)

    inf = float("inf")
    # best[k][j]: minimal max-stage cost covering layers [0, j) with k stages; cut[k][j]: last start.
    best = [[inf] * (n_layers + 1) for _ in range(pp + 1)]
    cut = [[0] * (n_layers + 1) for _ in range(pp + 1)]
    best[0][0] = 0.0
    for k in range(1, pp + 1):
        for j in range(k, n_layers + 1):
            for a in range(k - 1, j):
                if best[k - 1][a] == inf:
                    continue
                cand = max(best[k - 1][a], stage_cost(a, j, a == 0, k == pp and j == n_layers))
                if cand < best[k][j] - 1e-12:
                    best[k][j], cut[k][j] = cand, a
    bounds = []
    j = n_layers
    for k in range(pp, 0, -1):
        a = cut[k][j]
        bounds.append((a, j))
        j = a
    return bounds[::-1]


def stage_costs(costs: list[UnitCost], bounds: list[tuple[int, int]]) -> list[float]:
    """Cost of each stage for given layer ranges (embeddings in the first, head in the last)."""
    out = []
    for k, (a, b) in enumerate(bounds):
        c = sum(u.cost for u in costs[1 + a : 1 + b])
        c += costs[0].cost if k == 0 else 0.0
        c += costs[-1].cost if k == len(bounds) - 1 else 0.0
        out.append(c)
    return out


def stage_param_counts(costs: list[UnitCost], bounds: list[tuple[int, int]], tp: int) -> list[int]:
    """Parameters held by the largest rank of each stage (sharded part / tp rounded up + replicated part);
    shared units (ALBERT's layers) and each unit's ``stage_params`` (DeBERTa's relative table) once per
    stage; key/value projections by whole heads (tp > key/value heads: one head on each rank)."""
    out = []
    for k, (a, b) in enumerate(bounds):
        layers = list(costs[1 + a : 1 + b])
        units = [u for i, u in enumerate(layers) if not (u.shared and any(v.shared for v in layers[:i]))]
        if k == 0:
            units.append(costs[0])
        if k == len(bounds) - 1:
            units.append(costs[-1])
        held = max((u.stage_params for u in layers), default=0)
        for u in units:
            kv_per_rank = u.kv_params // u.kv_heads * -(-u.kv_heads // tp) if u.kv_params else 0
            rows = -(-(u.sharded_params - u.kv_params) // u.shard_row)
            held += -(-rows // tp) * u.shard_row + kv_per_rank + u.params - u.sharded_params
        out.append(held)
    return out


def activation_bytes_per_layer(
    config: EncoderConfig, *, batch_size: int, seq_len: int, tp: int, dtype_bytes: int, training: bool
) -> int:
    """Activation bytes for one layer and one micro-batch on one tensor-parallel rank.

    Training keeps what backward needs (Korthikanti et al. 2022, without sequence parallelism):
    s·b·h·(10 + 24/t + 5·a·s/(h·t)) bytes at 2-byte precision, scaled to ``dtype_bytes``.
    Inference keeps only the working set of one layer: the residual stream, the q/k/v and MLP
    intermediates of this rank, and one attention score matrix.
    """
    b, s, h, a, t = batch_size, seq_len, config.hidden_size, config.num_heads, tp
    if training:
        two_byte = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
        return int(two_byte * dtype_bytes / 2)
    elems = b * s * (2 * h + 3 * h // t + config.intermediate_size // t) + b * (a // t) * s * s
    return elems * dtype_bytes


def serving_memory_bytes(
    params: int,
    config: EncoderConfig,
    *,
    n_layers: int,
    batch_size: int,
    seq_len: int,
    tp: int,
    dtype_bytes: int = 4,
    inflight: int = 2,
) -> int:
    """One model on one rank serving: weights + one layer's working set + ``inflight`` boundary
    activations (the process's own ``RANK_RUNTIME_BYTES`` comes on top, once per process)."""
    act = activation_bytes_per_layer(
        config, batch_size=batch_size, seq_len=seq_len, tp=tp, dtype_bytes=dtype_bytes, training=False
    )
    boundary = inflight * batch_size * seq_len * config.hidden_size * dtype_bytes
    return params * dtype_bytes + (act if n_layers else 0) + boundary


def training_memory_bytes(
    params: int,
    config: EncoderConfig,
    *,
    n_layers: int,
    batch_size: int,
    seq_len: int,
    tp: int,
    stage_index: int,
    pp: int,
    dtype_bytes: int = 4,
) -> int:
    """One rank training with Adam under 1F1B: 16 bytes/param + stored activations (+ the process's
    ``RANK_RUNTIME_BYTES``).

    1F1B keeps at most ``pp - stage_index`` micro-batches' activations alive on a stage.
    """
    per_layer = activation_bytes_per_layer(
        config, batch_size=batch_size, seq_len=seq_len, tp=tp, dtype_bytes=dtype_bytes, training=True
    )
    return 16 * params + per_layer * n_layers * (pp - stage_index)


def ring_allreduce_bytes(grad_bytes: int, dp: int) -> int:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``grad_bytes`` over ``dp``
    ranks: ``2 * (dp - 1) / dp * grad_bytes`` (reduce-scatter, then all-gather)."""
    return 0 if dp <= 1 else int(2 * (dp - 1) * grad_bytes / dp)
