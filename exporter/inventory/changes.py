"""Names inotify saw change, per mount, until a run takes them: the scheduler keeps one for
each event-driven source (written from the watcher's thread, taken on the source's). A quick
inventory lstat()s these to patch the last listing; one marked unknown (a change below the
top directory, too many names) is listed again."""

import threading
from typing import Dict, Mapping, Optional, Set

from exporter.inventory.holdings import Names


class ChangeLog:
    MAX_NAMES = 5000  # past this, one re-list is cheaper than name-by-name lstat

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._names: Dict[str, Optional[Set[str]]] = {}

    def add(self, mount: str, name: str) -> None:
        with self._lock:
            names = self._names.setdefault(mount, set())
            if names is not None:
                names.add(name)
                if len(names) > self.MAX_NAMES:
                    self._names[mount] = None

    def unknown(self, mount: str) -> None:
        with self._lock:
            self._names[mount] = None

    def peek(self) -> Mapping[str, Names]:
        """What drain() would return, left in place (a copy: the log goes on changing)."""
        with self._lock:
            return {m: None if n is None else set(n) for m, n in self._names.items()}

    def drain(self) -> Mapping[str, Names]:
        """The names, taken: the log starts empty again."""
        with self._lock:
            drained, self._names = self._names, {}
        return drained
