"""Acceptance (issue 13): a training run whose stage 1 runs on another host.

Two network namespaces act as hosts (``loadtest/netns.py``): ``shardserve train --pp 2 --external-ranks
1`` (the driver and stage 0) on host A, ``shardserve worker`` (stage 1) on host B; tiny-bert on a
tiny SQuAD file, fp32, dropout 0. Stage 1 shares no filesystem path with the run as far as the
trainer is concerned: it gets the feature file and resume state from rank 0 and sends its
checkpoint parts back over torch.distributed (``training/run_files.py``).

- parity: the two-host run's final weights equal single-process training's within 1e-5 (and a
  worker whose ``WORLD_SIZE`` disagrees with the published gang is refused in one line);
- ``kill -9`` of the remote worker mid-run (after the first checkpoint): the driver fails with one
  ``error:`` line naming rank 1; ``--resume`` with a new worker finishes, equal to the
  uninterrupted run within 1e-5;
- host A lost (its link cut, so no connection is closed, only heartbeats stop): the worker on B exits
  by itself (code 4) within the channel's driver timeout, and removes its scratch copy of the features.

Skips, saying why, where network namespaces are not permitted.

    python -m pytest tests/deploy/test_multihost_training.py -q      (root; ~3 min on 2 cores)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from shardserve.loadtest.netns import REPO_ROOT, VirtualHost, netns_available, virtual_hosts
from shardserve.partitioner.runtime.channel import DRIVER_TIMEOUT_S
from shardserve.partitioner.runtime.wire import new_key
from shardserve.training.checkpoint import list_checkpoints
from shardserve.training.config import TrainConfig
from tests.training.test_trainer_parity import TOL, base_config, max_diff, reference_weights

PORT = 29500  # every port is free in a fresh namespace
RUN_TIMEOUT_S = 300


@pytest.fixture(autouse=True)
def _needs_netns() -> None:
    if reason := netns_available():
        pytest.skip(reason)


def train_argv(cfg: TrainConfig, host: VirtualHost, *extra: str) -> list[str]:
    """``shardserve train`` for ``cfg`` (``base_config``'s fields) with rank 1 on another host."""
    w = cfg.window
    flags = {
        "model": cfg.model, "train-file": cfg.train_file, "output": cfg.output, "pp": cfg.pp,
        "batch-size": cfg.batch_size, "micro-batch-size": cfg.micro_batch_size, "max-steps": cfg.max_steps,
        "lr": cfg.lr, "warmup-ratio": cfg.warmup_ratio, "weight-decay": cfg.weight_decay,
        "max-grad-norm": cfg.max_grad_norm, "dropout": cfg.dropout, "adam-eps": cfg.adam_eps,
        "seed": cfg.seed, "precision": cfg.precision, "save-every": cfg.save_every,
        "max-seq-len": w.max_seq_len, "doc-stride": w.doc_stride, "max-question-len": w.max_question_len,
        "log-every": 0, "external-ranks": 1, "gang-host": host.addr, "gang-port": PORT,
    }  # fmt: skip
    argv = [sys.executable, "-m", "shardserve", "--log-level", "INFO", "train", "--no-progress"]
    for k, v in flags.items():
        argv += [f"--{k}", str(v)]
    return [*argv, *extra]


class TwoHosts:
    """Start drivers on host A and workers on host B, with one gang key and each host's interface."""

    def __init__(self, a: VirtualHost, b: VirtualHost, logs: Path) -> None:
        self.a, self.b, self.logs = a, b, logs
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "SHARDSERVE_GANG_KEY": new_key().hex()}
        self._n = 0
        self.worker_tmp = logs / "host-b-tmp"  # the workers' TMPDIR: their scratch directories
        self.worker_tmp.mkdir()

    def _log(self, name: str) -> tuple[Path, object]:
        self._n += 1
        path = self.logs / f"{self._n}-{name}.log"
        return path, path.open("w")

    def driver(self, cfg: TrainConfig, *extra: str) -> tuple[subprocess.Popen, Path]:
        path, out = self._log("driver")
        env = {**self.env, "GLOO_SOCKET_IFNAME": self.a.ifname}
        proc = self.a.popen(
            train_argv(cfg, self.a, *extra), env=env, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT
        )
        return proc, path

    def worker(self, **env: str) -> tuple[subprocess.Popen, Path]:
        path, out = self._log("worker")
        env = {**self.env, "MASTER_ADDR": self.a.addr, "MASTER_PORT": str(PORT), "RANK": "1",
               "GLOO_SOCKET_IFNAME": self.b.ifname, "TMPDIR": str(self.worker_tmp), **env}  # fmt: skip
        argv = [sys.executable, "-m", "shardserve", "--log-level", "INFO", "worker"]
        return self.b.popen(argv, env=env, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT), path


def _finished(proc: subprocess.Popen, log: Path, *, code: int = 0) -> str:
    try:
        rc = proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{log.name} still running after {RUN_TIMEOUT_S}s:\n{log.read_text()[-3000:]}")
    text = log.read_text()
    assert rc == code, f"{log.name} exited {rc}, expected {code}:\n{text[-3000:]}"
    return text


def _final_weights(cfg: TrainConfig) -> dict:
    return load_file(str(Path(cfg.output) / "final" / "model.safetensors"))


def test_two_host_training_equals_single_process(tmp_path: Path) -> None:
    cfg = base_config(tmp_path, pp=2, max_steps=4, save_every=2)
    want, _ = reference_weights(cfg)
    with virtual_hosts(2) as (a, b):
        hosts = TwoHosts(a, b, tmp_path)
        driver, driver_log = hosts.driver(cfg)
        wrong, wrong_log = hosts.worker(WORLD_SIZE="3")  # torchrun told it another gang: refused
        text = _finished(wrong, wrong_log, code=2)
        errors = [line for line in text.splitlines() if line.startswith("error:")]
        assert errors == [
            "error: WORLD_SIZE=3, but the gang the driver published has 2 ranks (pp=2, tp=1)"
        ], text
        worker, worker_log = hosts.worker(WORLD_SIZE="2")
        _finished(driver, driver_log)
        _finished(worker, worker_log)
    assert "joins the train_rank gang" in worker_log.read_text()
    assert not list(hosts.worker_tmp.iterdir())  # the worker removed its scratch
    worst, where = max_diff(_final_weights(cfg), want)
    assert worst <= TOL, (worst, where)


def test_remote_worker_killed_mid_run_then_resumed_equals_uninterrupted(tmp_path: Path) -> None:
    cfg = base_config(tmp_path, pp=2, max_steps=10, save_every=2)
    want, _ = reference_weights(cfg)  # the uninterrupted run
    out = Path(cfg.output)
    with virtual_hosts(2) as (a, b):
        hosts = TwoHosts(a, b, tmp_path)
        driver, driver_log = hosts.driver(cfg)
        worker, _ = hosts.worker()
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not list_checkpoints(out) and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        os.killpg(worker.pid, signal.SIGKILL)  # mid-run: a checkpoint exists, the final does not
        assert list_checkpoints(out), driver_log.read_text()[-3000:]
        assert not (out / "final").exists(), "the run finished before the kill"
        text = _finished(driver, driver_log, code=1)
        errors = [line for line in text.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith("error: train: rank 1 (stage 1, tp 0)"), text

        driver, driver_log = hosts.driver(cfg, "--resume")
        worker, worker_log = hosts.worker()
        text = _finished(driver, driver_log)
        _finished(worker, worker_log)
    assert "resuming from" in text and "sending 2 file(s) of" in text  # rank 1's state came from rank 0
    worst, where = max_diff(_final_weights(cfg), want)
    assert worst <= TOL, (worst, where)


def test_worker_exits_by_itself_when_its_driver_host_is_lost(tmp_path: Path) -> None:
    cfg = base_config(tmp_path, pp=2, max_steps=100_000, save_every=0)
    with virtual_hosts(2) as (a, b):
        hosts = TwoHosts(a, b, tmp_path)
        driver, driver_log = hosts.driver(cfg)
        worker, worker_log = hosts.worker()
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while "train ready" not in driver_log.read_text() and time.monotonic() < deadline:
            assert driver.poll() is None, driver_log.read_text()[-3000:]
            time.sleep(0.1)
        # host A vanishes from the network: no connection is closed, only its heartbeats stop
        a.run(["ip", "link", "set", a.ifname, "down"], check=True)
        t0 = time.monotonic()
        code = worker.wait(timeout=DRIVER_TIMEOUT_S + 30)
        waited = time.monotonic() - t0
    assert code == 4, (code, worker_log.read_text()[-3000:])  # the channel's "driver is gone" exit
    assert waited <= DRIVER_TIMEOUT_S + 10, waited
    assert "nothing from the driver" in worker_log.read_text()
    assert not list(hosts.worker_tmp.iterdir())  # its scratch copy of the features went with it
