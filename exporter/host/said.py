"""A lasting condition about a key (a mount not measured, over the segment cap) logged when
it begins or changes, not on every run."""

import logging
from typing import Dict, Iterable


class SaidOnce:
    def __init__(self, log: logging.Logger, prefix: str = "mount {}: ") -> None:
        self.log, self.prefix = log, prefix
        self._said: Dict[object, object] = {}

    def say(self, key, message, level=logging.WARNING, back="", same=None) -> None:
        """Log `message` unless it (or `same`, compared instead) was the last said about `key`.
        None: the condition ended, and `back` is logged (INFO) if something had been said."""
        if message is None:
            if self._said.pop(key, None) is not None and back:
                self.log.info(self.prefix.format(key) + back)
            return
        seen = message if same is None else same
        if self._said.get(key) != seen:
            self._said[key] = seen
            self.log.log(level, self.prefix.format(key) + message)

    def keep(self, keys: Iterable[object]) -> None:  # pods come and go
        for gone in self._said.keys() - set(keys):
            del self._said[gone]
