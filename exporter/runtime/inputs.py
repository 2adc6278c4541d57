"""The facts every run is handed (`RunInput`), kept as the parts that own them publish them:
discovery's mount set and whether the kernel log counts every OOM kill (observations), and
whether inotify watches every mount (the watcher says so)."""

import threading
from typing import Sequence, Tuple

from exporter.collectors.source import NamesChanged, RunInput
from exporter.model.types import MountSet, Observation, OomReports


class RunInputs:
    """Written from the threads that publish (discovery's, the oom source's) and the
    watcher's; read by every source's thread as it begins a run. One lock."""

    def __init__(self, mounts: Sequence[str] = ()) -> None:
        """`mounts`: until discovery publishes a set (--shm.mount)."""
        self._lock = threading.Lock()
        self._mounts: Tuple[str, ...] = tuple(mounts)
        self._all_watched = False
        self._kill_log_complete = False

    def on_observation(self, obs: Observation) -> None:
        """A scheduler subscriber, first of them: a run that begins after a publication is
        handed what it said. A failed discovery run keeps the last set; a failed or lossy
        read of the kernel log makes it incomplete."""
        if obs.source == "discovery" and isinstance(obs.result, MountSet):
            with self._lock:
                self._mounts = tuple(obs.result.mounts())
        elif obs.source == "oom":
            complete = isinstance(obs.result, OomReports) and obs.result.lost == 0
            with self._lock:
                self._kill_log_complete = complete

    def watching(self, every_mount: bool) -> None:
        """The watcher: whether inotify watches every mount now."""
        with self._lock:
            self._all_watched = every_mount

    def make(self, changes: NamesChanged) -> RunInput:
        """A run's input, with the names inotify saw change that this run is handed."""
        with self._lock:
            return RunInput(
                mounts=self._mounts,
                changes=changes,
                all_watched=self._all_watched,
                kill_log_complete=self._kill_log_complete,
            )

    @property
    def mounts(self) -> Tuple[str, ...]:
        with self._lock:
            return self._mounts
