"""The deadline `shmwatch check --timeout` keeps: every read that can block (a log on a hung
filesystem, a server that trickles a byte at a time, a name that does not resolve) runs on a
daemon thread whose answer is awaited only until the deadline; a read still blocked then is
left behind and ends with the process."""

from __future__ import annotations

import threading
import time
from typing import Callable, Generic, List, Tuple, TypeVar

T = TypeVar("T")


def left(deadline: float) -> float:
    """Seconds until `deadline` (a time.monotonic() value), never below 0."""
    return max(0.0, deadline - time.monotonic())


class Bounded(Generic[T]):
    """fn() started on a daemon thread now; `result(deadline)` is its answer (or its
    exception), or TimeoutError when it has none by then."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self._answer: List[Tuple[bool, object]] = []
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], T]) -> None:
        try:
            self._answer.append((True, fn()))
        except BaseException as err:  # handed to whoever waits for the answer
            self._answer.append((False, err))

    def result(self, deadline: float) -> T:
        self._thread.join(left(deadline))
        if not self._answer:
            raise TimeoutError("no complete answer within --timeout")
        ok, value = self._answer[0]
        if not ok:
            raise value  # type: ignore[misc]
        return value  # type: ignore[return-value]
