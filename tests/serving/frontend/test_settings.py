"""Server settings (serving/frontend/settings.py) without a server: those that depend on the machine
(auto-sizing of replicas x threads, the dtype, GPUs), the ``serve`` flags and environment mapped
onto them, ``serve --help`` documenting each, and validation errors that print the numbers.

python -m pytest tests/serving/frontend/test_settings.py -q
"""

from __future__ import annotations

import re

import pytest
import torch
from pydantic import ValidationError

from shardserve.models.qa_windows import WindowConfig
from shardserve.serving.fleet.model_loader import device_pool
from shardserve.serving.frontend import settings as settings_mod
from shardserve.serving.frontend.settings import ServeSettings, available_cores


@pytest.fixture
def cores(monkeypatch):
    def use(n: int) -> None:
        monkeypatch.setattr(settings_mod, "available_cores", lambda: n)

    return use


@pytest.mark.parametrize(
    ("n_cores", "pp", "tp", "replicas", "threads"),
    [(2, 1, 1, 2, 1), (2, 2, 1, 1, 1), (8, 2, 1, 4, 1), (1, 2, 1, 1, 1), (16, 2, 2, 4, 1)],
)
def test_no_flags_sizes_one_rank_per_core(cores, n_cores, pp, tp, replicas, threads):
    cores(n_cores)
    s = ServeSettings(pp=pp, tp=tp)
    assert s.auto_sized
    assert s.replica_bounds == (replicas, replicas)
    assert s.rank_threads == threads
    assert not s.autoscaling


@pytest.mark.parametrize(
    ("flags", "bounds", "threads"),
    [
        (dict(replicas=1), (1, 1), 8),  # one replica: its rank gets every core
        (dict(threads_per_rank=2), (1, 1), 2),
        (dict(min_replicas=1, max_replicas=4), (1, 4), 2),  # threads sized for the largest fleet
    ],
)
def test_explicit_flags_win(cores, flags, bounds, threads):
    cores(8)
    s = ServeSettings(**flags)
    assert not s.auto_sized
    assert s.replica_bounds == bounds
    assert s.rank_threads == threads


def test_dtype_and_device_are_validated_with_the_choices():
    """The layout flags' own types (``partitioner/layout_flags.py``), as for plan, verify, train, eval."""
    assert ServeSettings().dtype == "auto" and ServeSettings().device == "cpu"
    assert ServeSettings(dtype="int8").dtype == "int8"
    with pytest.raises(
        ValidationError, match=r"dtype\n.*Input should be 'auto', 'float32', 'bfloat16', 'float16' or 'int8'"
    ):
        ServeSettings(dtype="int4")
    with pytest.raises(ValidationError, match=r"device\n.*Input should be 'cpu' or 'cuda'"):
        ServeSettings(device="gpu")


def test_compile_is_validated_with_the_choices():
    assert ServeSettings().compile == "off" and ServeSettings(compile="on").compile == "on"
    with pytest.raises(ValidationError, match="compile='yes' must be one of off, on"):
        ServeSettings(compile="yes")


def test_window_is_the_flags_windowing():
    """The one place the server's windows come from (the engine and the eval parity test use it)."""
    got = ServeSettings(max_seq_len=256, doc_stride=64, max_question_len=32).window()
    assert got == WindowConfig(max_seq_len=256, doc_stride=64, max_question_len=32)
    assert ServeSettings().window() == WindowConfig(max_seq_len=384, doc_stride=128, max_question_len=64)


def test_external_ranks_need_one_replica_a_fixed_port_an_address_and_the_key(tmp_path) -> None:
    ok = dict(pp=2, replicas=1, external_ranks="1", gang_host="10.0.0.1", gang_port=29500, gang_key="ab" * 32)
    s = ServeSettings(**ok)
    assert s.external_ranks == [1] and s.pool_slots == 2  # one gang on a fixed port, replaced in place
    key_file = tmp_path / "gang.key"
    key_file.write_text("cd" * 32 + "\n")
    assert ServeSettings(**{**ok, "gang_key": None, "gang_key_file": str(key_file)}).gang_key == "cd" * 32
    for change, problem in [
        ({"external_ranks": "2"}, "external_ranks [2] are not ranks of a pp=2 x tp=1 gang (0..1)"),
        ({"replicas": 2}, "external_ranks need exactly one replica, got 2..2"),
        ({"gang_port": 0}, "external_ranks need a fixed gang_port"),
        ({"gang_host": "0.0.0.0"}, "would listen on every interface"),
        ({"gang_key": None}, "external_ranks need the gang key"),
        ({"gang_key": "not-hex" * 10}, "external_ranks need the gang key"),
    ]:
        with pytest.raises(ValueError, match=re.escape(problem)):
            ServeSettings(**{**ok, **change})


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has ``n`` CUDA devices (the pool only counts them)."""

    def use(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return use


@pytest.mark.parametrize(
    ("n_gpus", "per_gpu", "pp", "replicas", "slots"),
    [
        (1, 1, 1, 1, ["cuda:0"]),
        (1, 4, 1, 4, ["cuda:0"] * 4),  # four replicas share the GPU
        (1, 2, 2, 1, ["cuda:0", "cuda:0"]),  # one pp=2 gang on one GPU
        (2, 2, 2, 2, ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]),  # each gang spans both GPUs
    ],
)
def test_gpus_are_shared_by_ranks_per_gpu_ranks(gpus, n_gpus, per_gpu, pp, replicas, slots):
    gpus(n_gpus)
    s = ServeSettings(device="cuda", ranks_per_gpu=per_gpu, pp=pp)
    assert s.replica_bounds == (replicas, replicas)
    assert s.rank_threads == 1
    pool = device_pool(s.fleet_config())
    assert pool.labels == slots
    assert [pool.devices(pool.acquire(pp)) for _ in range(replicas)] == [
        tuple(slots[i * pp : (i + 1) * pp]) for i in range(replicas)
    ]


def test_a_gang_larger_than_the_gpus_names_ranks_per_gpu(gpus):
    gpus(1)
    with pytest.raises(ValueError, match=r"has 1 slots, a gang needs 2 \(raise --ranks-per-gpu"):
        device_pool(ServeSettings(device="cuda", pp=2).fleet_config())
    with pytest.raises(ValidationError, match="ranks_per_gpu=2 applies to device=cuda only"):
        ServeSettings(ranks_per_gpu=2)


@pytest.mark.parametrize(
    ("n_cores", "n_gpus", "flags", "workers"),
    [
        (2, 0, {}, 1),  # cpu: the ranks use the cores
        (64, 0, {}, 1),
        (2, 0, dict(api_workers=3), 3),  # as asked
        (16, 1, dict(device="cuda"), 8),  # 16 - 1 rank - 1 core = 14, at most 8
        (16, 1, dict(device="cuda", ranks_per_gpu=4), 8),  # 16 - 4 - 1 = 11
        (8, 1, dict(device="cuda", ranks_per_gpu=4), 3),  # 8 - 4 - 1
        (4, 2, dict(device="cuda", ranks_per_gpu=2), 1),  # 4 ranks leave no core to spare
    ],
)
def test_api_workers_auto_uses_the_cores_the_ranks_leave(cores, gpus, n_cores, n_gpus, flags, workers):
    cores(n_cores)
    gpus(n_gpus)
    assert ServeSettings(**flags).api_worker_count == workers


def test_api_workers_is_a_count_or_auto():
    with pytest.raises(ValidationError, match=r"api_workers\n.*greater than or equal to 1, or auto"):
        ServeSettings(api_workers=0)
    assert ServeSettings(api_workers="auto").api_workers == "auto"


def test_pp_auto_is_chosen_at_start_and_the_chosen_layout_is_checked_then(cores):
    """``--pp auto``: the settings validate without a layout; ``fit_serve_layout`` picks the fewest
    ranks that fit ``--max-memory-per-rank`` and checks them as a given layout (partitioner/fit.py)."""
    from shardserve.partitioner.fit import parse_size
    from shardserve.serving.frontend.layout import fit_serve_layout

    cores(8)
    s = ServeSettings(model=["tiny-bert"], pp="auto", tp="auto", max_memory_per_rank="1GiB")
    assert s.auto_layout and s.max_memory_per_rank == parse_size("1GiB")
    fitted, chosen = fit_serve_layout(s)
    assert (fitted.pp, fitted.tp) == (1, 1) and not fitted.auto_layout  # tiny-bert fits one rank
    assert chosen is not None and chosen.startswith("layout chosen by auto")
    assert fitted.replica_bounds == (8, 8) and fitted.fleet_config().world_size == 1
    assert fit_serve_layout(ServeSettings(model=["tiny-bert"]))[1] is None  # a given layout: checked only
    with pytest.raises(ValueError, match="must be an integer greater than"):
        ServeSettings(tp="0")
    with pytest.raises(ValueError, match="max_memory_per_rank does not apply with placement"):
        ServeSettings(model=["a=tiny-bert"], placement="dedicated", max_memory_per_rank="1G")


def test_length_buckets_default_to_the_padded_ones_below_max_seq_len_then_max_seq_len() -> None:
    padded = (64, 96, 128, 160, 192, 256, 320, 384)
    for flags, buckets in [
        (dict(), padded),
        (dict(max_seq_len=200, doc_stride=64), (*padded[:5], 200)),
        (dict(max_seq_len=512), (*padded, 512)),  # no --length-buckets needed past 384
        (dict(max_seq_len=512, length_buckets="128,512"), (128, 512)),
    ]:
        assert ServeSettings(**flags).scheduler_config().length_buckets == buckets, flags
    with pytest.raises(ValidationError, match="largest length bucket 384 < max_seq_len=512"):
        ServeSettings(max_seq_len=512, length_buckets="64,384")


# ------------------------------------------------------------------------------------- serve flags, validation


def test_serve_flags_and_environment_map_onto_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardserve.cli import build_parser, settings_from_args

    monkeypatch.setenv("SHARDSERVE_MAX_QUEUE_SIZE", "7")
    monkeypatch.setenv("SHARDSERVE_PORT", "1234")
    monkeypatch.setenv("SHARDSERVE_LENGTH_BUCKETS", "64,512")
    args = build_parser().parse_args(
        ["serve", "--port", "9001", "--pp", "2", "--min-replicas", "1", "--max-replicas", "3"]
    )
    s = settings_from_args(args)
    assert (s.port, s.max_queue_size, s.pp, s.length_buckets) == (9001, 7, 2, [64, 512])  # flag beats env
    assert s.replica_bounds == (1, 3) and s.autoscaling and s.pool_slots == 2 * (3 + 1)
    monkeypatch.delenv("SHARDSERVE_PORT")
    monkeypatch.delenv("SHARDSERVE_MAX_QUEUE_SIZE")
    monkeypatch.delenv("SHARDSERVE_LENGTH_BUCKETS")
    d = settings_from_args(build_parser().parse_args(["serve"]))
    cores = available_cores()
    assert (d.models(), d.host, d.port, d.replica_bounds, d.pp, d.tp, d.dtype) == (
        [("default", "default")],
        "0.0.0.0",
        8000,
        (
            cores,
            cores,
        ),  # no flags: one single-rank replica per core (tests/serving/frontend/test_settings.py)
        1,
        1,
        "auto",
    )


def test_serve_help_documents_every_setting() -> None:
    from shardserve.cli import build_parser

    parser = build_parser()
    serve = next(a for a in parser._subparsers._group_actions if a.dest == "command").choices["serve"]
    text = serve.format_help()
    for name, field in ServeSettings.model_fields.items():
        assert f"--{name.replace('_', '-')}" in text and f"SHARDSERVE_{name.upper()}" in text
        assert field.description


def test_invalid_settings_print_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"min_replicas=3 > max_replicas=2"):
        ServeSettings(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match=r"largest length bucket 256 < max_seq_len=384"):
        ServeSettings(length_buckets=[64, 256])


def test_stall_timeout_must_be_inside_the_request_deadline() -> None:
    assert ServeSettings().stall_after_s == pytest.approx(10.0)  # a third of the 30 s deadline
    with pytest.raises(ValueError, match=r"stall_timeout_s=30.0 must be below request_timeout_s=30.0"):
        ServeSettings(stall_timeout_s=30.0)
