"""The device pool: the slots a gang's ranks occupy, CPU slots or CUDA devices.

pool = DevicePool.for_device("cpu", cpu_slots=4)
slots = pool.acquire(2); pool.devices(slots)      # ("cpu", "cpu"); pool.release(slots)
"""

from __future__ import annotations

import torch


class DevicePool:
    """Slots a gang's ranks occupy: ``cpu`` slots (a count) or CUDA devices, ``ranks_per_gpu`` slots each.

    CUDA slots are dealt round-robin (slot s is ``cuda:{s % gpus}``) and taken lowest first, so a
    gang's ranks land on different GPUs while there are enough (NCCL), and share them beyond.
    """

    def __init__(self, labels: list[str]) -> None:
        if not labels:
            raise ValueError("a device pool needs at least one slot, got 0")
        self.labels = list(labels)
        self._free = set(range(len(labels)))

    @classmethod
    def for_device(cls, device: str, *, cpu_slots: int, ranks_per_gpu: int = 1) -> DevicePool:
        if device == "cuda":
            n = torch.cuda.device_count()
            if n == 0:
                raise ValueError("device=cuda but torch.cuda.device_count() is 0")
            return cls([f"cuda:{s % n}" for s in range(n * ranks_per_gpu)])
        return cls(["cpu"] * cpu_slots)

    @property
    def capacity(self) -> int:
        return len(self.labels)

    @property
    def free(self) -> int:
        return len(self._free)

    def gangs_that_fit(self, world_size: int) -> int:
        """Gangs of ``world_size`` ranks the whole pool holds (the autoscaler's upper bound)."""
        return self.capacity // world_size

    def acquire(self, n: int) -> list[int] | None:
        """Take ``n`` slots (lowest first), or None when fewer are free."""
        if n > len(self._free):
            return None
        got = sorted(self._free)[:n]
        self._free.difference_update(got)
        return got

    def release(self, slots: list[int]) -> None:
        self._free.update(slots)

    def devices(self, slots: list[int]) -> tuple[str, ...]:
        return tuple(self.labels[s] for s in slots)
