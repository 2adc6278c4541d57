"""Names inotify saw change, per mount: the quick inventory lstat()s these to patch the last
listing. One marked unknown (a change below the top directory, too many names): re-listed."""

import threading

from exporter.inventory.holdings import Changes


class ChangeLog:
    MAX_NAMES = 5000  # past this, one re-list is cheaper than name-by-name lstat

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._names: Changes = {}

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

    def peek(self) -> Changes:  # what drain() would return, left in place
        with self._lock:
            return {m: None if n is None else set(n) for m, n in self._names.items()}

    def drain(self) -> Changes:
        with self._lock:
            drained, self._names = self._names, {}
        return drained
