"""The console script's error policy: a user's mistake is one line on stderr, never a traceback.

``USER_ERRORS`` are the exceptions (of every package) that mean the user asked for something that
cannot be (an unknown model, a layout that does not fit, a precision the device lacks, a gang that
cannot be joined): ``main_guard`` prints them as ``error: <message>`` and exits 2; Ctrl-C is
``interrupted``, exit 130. Anything else is a bug and keeps its traceback.

    sys.exit(main_guard(command.run, settings))
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

from shardserve.models.config import ModelConfigError
from shardserve.models.hf_weights import CheckpointError
from shardserve.partitioner.cost import InfeasiblePlanError
from shardserve.partitioner.int8 import CalibrationMissing
from shardserve.partitioner.placement.latency import PlacementError
from shardserve.partitioner.placement.workload import WorkloadError
from shardserve.partitioner.precision import PrecisionError
from shardserve.partitioner.runtime.remote import JoinError

logger = logging.getLogger(__name__)

USER_ERRORS: tuple[type[Exception], ...] = (
    ModelConfigError,
    CheckpointError,
    InfeasiblePlanError,
    PlacementError,
    WorkloadError,
    PrecisionError,
    JoinError,
    CalibrationMissing,
)


def print_error(message: str) -> int:
    """``error: <message>`` on stderr; the exit status of a user's mistake (2)."""
    print(f"error: {message}", file=sys.stderr)
    return 2


def main_guard(run: Callable[[Any], int], settings: Any) -> int:
    """``run(settings)``, with a user's mistake (``USER_ERRORS``) as one line and exit 2, and
    Ctrl-C (the gangs were killed on the way out) as ``interrupted`` and exit 130."""
    try:
        return run(settings)
    except USER_ERRORS as exc:
        return print_error(str(exc))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
