"""Every file the exporter reads is found through one Paths object (--path.*: a fixture
tree in tests, /host/... in a DaemonSet)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Paths:
    procfs: str = "/proc"
    sysfs: str = "/sys"
    rootfs: str = "/"

    def proc(self, *parts: object) -> str:
        # Not os.path.join: the owner scan builds thousands (parts are never absolute).
        return "/".join((self.procfs.rstrip("/"), *map(str, parts)))

    def sys(self, *parts: object) -> str:
        return os.path.join(self.sysfs, *map(str, parts))

    def host(self, path: str) -> str:
        """A path as the monitored host/container sees it -> where we can read it."""
        if self.rootfs in ("", "/"):
            return path
        return os.path.join(self.rootfs, path.lstrip("/"))


def read_text(path: str) -> str:
    # newline="": no universal-newline translation, so a "\r" in a path stays in its line.
    with open(path, encoding="utf-8", errors="surrogateescape", newline="") as f:
        return f.read()
