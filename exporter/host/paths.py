"""Every file the exporter reads is found through one Paths object (--path.*: a fixture
tree in tests, /host/... in a DaemonSet)."""

import errno
import os
from dataclasses import dataclass

# A read that failed for want of file descriptors or memory: that says nothing of what was
# read (any other error may say it is gone, as ENOENT for an exited process or pod).
OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)


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
    """The file's text, with no newline translation (a "\r" in a path stays in its line); at a
    third of open()'s cost (a pass reads 1,000s of /proc and cgroup files)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = b"".join(iter(lambda: os.read(fd, 65536), b""))
    finally:
        os.close(fd)
    return data.decode("utf-8", "surrogateescape")
