"""/proc/<pid>/mountinfo: parsed, looked up by mount point, read again when it changed."""

import posixpath
import re
import select
from contextlib import suppress
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, List, Optional, Sequence, TextIO, Union

from exporter.host.paths import Paths


@dataclass(frozen=True)
class MountEntry:
    mount_point: str
    fstype: str
    source: str
    options: str  # per-mount and superblock options, comma-separated
    device: str = ""  # major:minor
    root: str = "/"  # in its filesystem (a bind mount's or a cgroup namespace's root)
    mount_id: int = field(default=0, compare=False)  # IDs are per boot, not the mount


_OCTAL_ESCAPE = re.compile(r"\\(\d{3})")


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (\\040 ...)."""
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m[1], 8)), field)


def parse_mountinfo(text: str) -> List[MountEntry]:
    """/proc/<pid>/mountinfo -> entries in file order. Malformed lines are skipped."""
    entries = []
    # Not splitlines(): the kernel escapes "\n" in paths, not "\r", "\x85" or "\u2028".
    for line in text.split("\n"):
        fields = line.split(" ")
        with suppress(ValueError, IndexError):
            sep = fields.index("-", 6)
            mount_id, _, device, root, point, options = fields[:6]
            fstype, source, *super_options = fields[sep + 1 :]
            options += "," + (super_options[0] if super_options else "")
            entry = MountEntry(
                mount_point=_unescape(point),
                fstype=fstype,
                source=_unescape(source),
                options=options,
                device=device,
                root=_unescape(root),
                mount_id=int(mount_id),
            )
            entries.append(entry)
    return entries


def strip_rootfs(entries: Sequence[MountEntry], rootfs: str) -> List[MountEntry]:
    """Mount points as the host names them: our own mountinfo (told by the mount of the
    rootfs itself) names them under --path.rootfs; its mounts outside it are not the host's."""
    root = rootfs.rstrip("/")
    if not root:
        return list(entries)
    ours = any(e.mount_point == root for e in entries)
    return [
        replace(e, mount_point=e.mount_point[len(root) :] or "/") if under else e
        for e in entries
        if (under := (e.mount_point + "/").startswith(root + "/")) or not ours
    ]


@dataclass(frozen=True)
class _OpenMountinfo:
    """A mountinfo kept open, to be polled for POLLPRI (the kernel's "the table changed")."""

    pid: str
    handle: TextIO
    poller: "select.poll"


class MountTable:
    """The first readable mountinfo of `order` ('1': the host's, first under
    --path.rootfs; 'self': ours), --path.rootfs stripped; a path's mount in O(depth).
    Reread only on POLLPRI, as libmount's monitor does (2,000 mounts: ~10 ms a read)."""

    def __init__(
        self,
        paths: Paths,
        order: Sequence[str] = (),
        entries: Sequence[MountEntry] = (),
    ) -> None:
        self.paths = paths
        host_first = paths.rootfs not in ("", "/")
        self.order = tuple(order or (("1", "self") if host_first else ("self", "1")))
        self._open: Optional[_OpenMountinfo] = None  # what the entries are from
        self._index(entries)  # none until read: nothing is known

    def _index(self, entries: Sequence[MountEntry]) -> None:
        # the last (topmost) entry on a mount point wins
        self.by_point = {e.mount_point.rstrip("/") or "/": e for e in entries}

    def read(self) -> Optional[List[MountEntry]]:
        """The entries; None when unchanged. OSError naming each file when none can be read."""
        errors = []
        for pid in self.order:
            path = self.paths.proc(pid, "mountinfo")
            try:
                text = self._text(pid, path)
            except OSError as err:
                errors.append(f"{path}: {err.strerror or err}")
                continue
            if text is None:
                return None
            return strip_rootfs(parse_mountinfo(text), self.paths.rootfs)
        self.close()  # none read: whichever answers next is read, changed or not
        raise OSError("; ".join(errors))

    def _text(self, pid: str, path: str) -> Optional[str]:
        """pid's mountinfo; None when the entries are from it and it has not changed since."""
        kept = self._open
        if kept is not None and kept.pid == pid:
            events = kept.poller.poll(0)
            if not events:
                return None
            if not events[0][1] & select.POLLNVAL:  # else the fd went bad: open afresh
                kept.handle.seek(0)
                return kept.handle.read()
        handle = open(path, "r", encoding="utf-8", errors="surrogateescape", newline="")
        self.close()
        poller = select.poll()
        # POLLOUT asked too: a regular file reports it (and never POLLPRI); mountinfo never does.
        poller.register(handle.fileno(), select.POLLPRI | select.POLLOUT)
        if any(mask & select.POLLOUT for _, mask in poller.poll(0)):
            with handle:  # a regular file: nothing to wait for, read it every time
                return handle.read()
        self._open = _OpenMountinfo(pid=pid, handle=handle, poller=poller)
        return handle.read()

    def close(self) -> None:
        if self._open is not None:
            self._open.handle.close()
        self._open = None

    def refresh(self) -> bool:
        """Whether the table changed (or could not be read) since the last refresh."""
        try:
            entries = self.read()  # None: unchanged
        except OSError:
            entries = []
        if entries is not None:
            self._index(entries)
        return entries is not None

    def find(self, path: str) -> Optional[MountEntry]:
        point = path.rstrip("/") or "/"
        while True:
            entry = self.by_point.get(point)
            if entry is not None or point == "/" or not point.startswith("/"):
                return entry
            point = posixpath.dirname(point)

    def mounted_at(self, path: str) -> Optional[MountEntry]:
        """The entry whose mount point `path` is; None when only a mount above holds it."""
        return self.by_point.get(path.rstrip("/") or "/")

    def gone(self, path: str) -> bool:
        """`path` is no mount point in a table we could read (an unreadable or empty one
        proves nothing): the root disk's directory beneath is neither measured nor walked."""
        return bool(self.by_point) and self.mounted_at(path) is None


def live_mounts(
    mounts: Union[Callable[[], List[str]], Iterable[str]],
) -> Callable[[], List[str]]:
    """What collectors take: discovery's `mounts` callable, or (tests, benchmarks) a fixed list."""
    if callable(mounts):
        return mounts
    fixed = list(mounts)
    return lambda: fixed
