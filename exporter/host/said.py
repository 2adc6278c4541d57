"""A lasting condition about a key (a mount not measured, over the segment cap, a collector
failing) logged when it begins, changes or ends, not on every run.

Each run begins by naming the keys that exist now, `SaidOnce.run(live)`, and says through the
run it gets back: what was said about any other key is forgotten with it. So what is kept
follows the live keys (node mode's pods come and go), and a key that comes back is told
about afresh. A run need not say something about every live key (a quick run measures a few
mounts): a key it does not mention keeps what was said about it."""

import logging
from typing import Dict, Hashable, Iterable, Optional


class SaidOnce:
    """What was last said about each key. Not thread-safe: a caller on several threads locks."""

    def __init__(self, log: logging.Logger, prefix: str = "mount {}: ") -> None:
        self.log, self.prefix = log, prefix
        self._said: Dict[Hashable, object] = {}

    def run(self, live: Iterable[Hashable]) -> "SaidRun":
        """A run over the keys that exist now; what was said about any other is forgotten."""
        keys = set(live)
        for gone in self._said.keys() - keys:
            del self._said[gone]
        return SaidRun(self)

    def _say(
        self, key: Hashable, message: Optional[str], level: int, back: str, same: object
    ) -> None:
        if message is None:
            if self._said.pop(key, None) is not None and back:
                self.log.info(self.prefix.format(key) + back)
            return
        seen = message if same is None else same
        if self._said.get(key) != seen:
            self._said[key] = seen
            self.log.log(level, self.prefix.format(key) + message)


class SaidRun:
    """One run's voice: made by `SaidOnce.run`, which has forgotten the keys gone."""

    def __init__(self, said: SaidOnce) -> None:
        self._said = said

    def say(
        self,
        key: Hashable,
        message: Optional[str],
        level: int = logging.WARNING,
        back: str = "",
        same: object = None,
    ) -> None:
        """Logs `message` unless it (or `same`, compared instead) was the last said about `key`.
        None: the condition has ended; `back` is logged (INFO) if something had been said. A
        condition never said to have ended is never said again while its key lives."""
        self._said._say(key, message, level, back, same)
