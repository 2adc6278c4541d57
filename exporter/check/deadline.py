"""The deadline `shmwatch check --timeout` keeps: every read that can block (a log on a hung
filesystem, a server that trickles a byte at a time, a name that does not resolve) runs on a
daemon thread whose answer is awaited only until the deadline; a read still blocked then is
left behind and ends with the process."""

from __future__ import annotations

import threading
import time
from typing import Callable, List


def left(deadline: float) -> float:
    """Seconds until `deadline` (a time.monotonic() value), never below 0; no deadline
    (math.inf) is the longest wait a socket or a lock takes (an infinite one overflows)."""
    return min(threading.TIMEOUT_MAX, max(0.0, deadline - time.monotonic()))


class Bounded:
    """fn() started on a daemon thread; `result(deadline)` is its answer, its exception, or
    TimeoutError when it has none by then."""

    def __init__(self, fn: Callable) -> None:
        self._answer: List[tuple] = []

        def run() -> None:
            try:
                self._answer.append((fn(), None))
            except BaseException as err:  # raised to whoever waits for the answer
                self._answer.append((None, err))

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def result(self, deadline: float):
        self._thread.join(left(deadline))
        if not self._answer:
            raise TimeoutError("no complete answer within --timeout")
        value, error = self._answer[0]
        if error is not None:
            raise error
        return value
