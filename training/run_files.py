"""The run directory as each rank sees it: ranks on other hosts get and give files through rank 0.

A run's directory (``TrainConfig.output``: the feature file, ``checkpoint-*``, ``final``) lives on
the driver's host, where rank 0 runs (a training gang's rank 0 is never external). Ranks spawned by
the driver read and write it directly. A rank joined with ``shardserve worker`` on another host
(``RunInfo.remote_ranks``) assumes no shared filesystem and works in a scratch directory of its
own, exchanging files with rank 0 over torch.distributed (``partitioner/runtime/file_transfer.py``):

- ``fetch``: rank 0 sends each remote rank the files it needs (the feature file at start, the
  checkpoint files on ``--resume``); the others return the path they read them from;
- ``writable`` / ``collect``: a remote rank writes its part of a checkpoint in scratch, then sends
  it to rank 0, which puts it into the checkpoint being assembled.

Every rank calls these at the same points of ``train_rank`` (ranks with nothing to do return at
once), so the exchanges pair up without any extra coordination.

    files = RunFiles(ctx, run)
    cache = files.fetch(Path(run.features).parent, lambda rank: [Path(run.features).name])
    data = read_features(str(cache / Path(run.features).name), "train", names)
    ...
    files.close()
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from shardserve.partitioner.runtime.file_transfer import recv_files, send_files
from shardserve.partitioner.runtime.rank import RankContext, before_hard_exit
from shardserve.training.config import RunInfo

logger = logging.getLogger(__name__)


class RunFiles:
    """One rank's access to the run directory (see module doc); ``close()`` removes its scratch."""

    def __init__(self, ctx: RankContext, run: RunInfo) -> None:
        self.rank = ctx.rank
        self.remote = tuple(sorted(run.remote_ranks))
        self.is_remote = ctx.rank in self.remote
        self.device = ctx.device if ctx.backend == "nccl" else torch.device("cpu")
        self.scratch = (
            Path(tempfile.mkdtemp(prefix=f"shardserve-rank{ctx.rank}-")) if self.is_remote else None
        )
        self._fetched = 0
        if self.scratch is not None:
            before_hard_exit(self.close)  # a rank whose driver is lost exits without its finally

    def fetch(self, root: Path, names_for: Callable[[int], list[str]]) -> Path:
        """Where this rank reads files of ``root`` (a directory of the run): ``root`` itself, or on
        a remote rank a scratch copy of the files ``names_for(rank)`` (relative to ``root``), which
        rank 0 sends (only rank 0 calls ``names_for``)."""
        if self.rank == 0:
            for rank in self.remote:
                names = names_for(rank)
                logger.info("sending %d file(s) of %s to rank %d", len(names), root, rank)
                send_files(root, names, dst=rank, device=self.device)
        if not self.is_remote:
            return root
        assert self.scratch is not None
        self._fetched += 1
        local = self.scratch / f"in-{self._fetched}"
        recv_files(local, src=0, device=self.device)
        return local

    def writable(self, root: Path) -> Path:
        """Where this rank writes files meant for ``root``: ``root``, or a fresh scratch directory
        that ``collect`` sends on."""
        if not self.is_remote:
            return root
        assert self.scratch is not None
        local = self.scratch / "out"
        shutil.rmtree(local, ignore_errors=True)
        local.mkdir(parents=True)
        return local

    def collect(self, root: Path, *, senders: list[int]) -> None:
        """Rank 0 receives into ``root`` what each remote rank of ``senders`` wrote with
        ``writable``; those ranks send it (and empty their scratch)."""
        remote_senders = [r for r in senders if r in self.remote]
        if self.rank == 0:
            for rank in remote_senders:
                got = recv_files(root, src=rank, device=self.device)
                logger.info("received %d file(s) from rank %d into %s", len(got), rank, root)
        elif self.rank in remote_senders:
            assert self.scratch is not None
            local = self.scratch / "out"
            names = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
            send_files(local, names, dst=0, device=self.device)
            shutil.rmtree(local, ignore_errors=True)

    def close(self) -> None:
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
