"""Closed-loop clients for tests under load: threads that each repeat one call until the block ends,
however it ends (a failed wait inside must not leave them running: the pool, and at exit the
interpreter, would wait for them for ever).

from tests.clients import closed_loop
with closed_loop(lambda i: statuses.append(post(i).status_code), n=4):
    wait_until(lambda: len(statuses) > 10, what="traffic")
    ...                                  # the fault; the clients stop when the block ends
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor


@contextlib.contextmanager
def closed_loop(call: Callable[[int], object], *, n: int) -> Iterator[None]:
    """``n`` threads calling ``call(i)`` (``i`` the client's number) back to back while the block
    runs; after a block that ended normally, an exception a client raised (its assertion) is raised."""
    stop = threading.Event()

    def loop(i: int) -> None:
        while not stop.is_set():
            call(i)

    with ThreadPoolExecutor(n) as pool:
        loops = [pool.submit(loop, i) for i in range(n)]
        try:
            yield
        finally:
            stop.set()
    for f in loops:
        f.result()
