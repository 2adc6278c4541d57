"""Usage of each monitored tmpfs mount: statvfs, plus its type from mountinfo.

Why not leave this to node_exporter: its default mount-points-exclude matches ^/(dev|...)
so /dev/shm is never reported, and kube-prometheus drops the kubelet's emptyDir paths.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from ..paths import Paths, read_text

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MountEntry:
    mount_point: str
    fstype: str
    source: str
    options: str  # per-mount and superblock options, comma-separated
    device: str = ""  # major:minor


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal (\040 ...).
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 4 <= len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> List[MountEntry]:
    """/proc/<pid>/mountinfo -> entries in file order. Malformed lines are skipped."""
    entries = []
    # "\n" only: the kernel escapes it in paths, but not "\r", "\x85" or "\u2028", which
    # splitlines() would also break a line at.
    for line in text.split("\n"):
        fields = line.split(" ")
        try:
            sep = fields.index("-", 6)
            entries.append(MountEntry(
                mount_point=_unescape(fields[4]), fstype=fields[sep + 1], source=_unescape(fields[sep + 2]),
                options=fields[5] + "," + (fields[sep + 3] if len(fields) > sep + 3 else ""),
                device=fields[2]))
        except (ValueError, IndexError):
            continue
    return entries


def size_option(options: str) -> Optional[int]:
    """'rw,size=65536k' -> 67108864: the tmpfs size the mount was asked for."""
    for option in options.split(","):
        if option.startswith("size="):
            value = option[5:]
            units = {"k": 1024, "m": 1024 ** 2, "g": 1024 ** 3}
            try:
                if value and value[-1].lower() in units:
                    return int(value[:-1]) * units[value[-1].lower()]
                return int(value)
            except ValueError:
                return None
    return None


def find_mount(entries: Sequence[MountEntry], path: str) -> Optional[MountEntry]:
    """The mount that holds `path`: the last (topmost) entry with the longest matching prefix."""
    best: Optional[MountEntry] = None
    for entry in entries:
        point = entry.mount_point.rstrip("/") or "/"
        if path == point or path.startswith(point.rstrip("/") + "/") or point == "/":
            if best is None or len(point) >= len(best.mount_point.rstrip("/") or "/"):
                best = entry
    return best


def read_mountinfo(paths: Paths, host_first: bool) -> List[MountEntry]:
    """Our own mountinfo or pid 1's (the host's), whichever is asked for first; hidepid
    may hide pid 1's, and then ours is what there is."""
    for pid in ("1", "self") if host_first else ("self", "1"):
        try:
            return parse_mountinfo(read_text(paths.proc(pid, "mountinfo")))
        except OSError:
            continue
    return []


@dataclass(frozen=True)
class MountUsage:
    mount: str  # as configured (the path the workload sees)
    fstype: str
    source: str
    is_mount_point: bool
    error: Optional[str] = None
    size_bytes: int = 0
    used_bytes: int = 0
    available_bytes: int = 0
    inodes: int = 0
    inodes_free: int = 0

    @property
    def usage_ratio(self) -> float:
        return self.used_bytes / self.size_bytes if self.size_bytes else 0.0


def measure(path: str, statvfs: Callable[[str], os.statvfs_result] = os.statvfs) -> Dict[str, int]:
    st = statvfs(path)
    return {
        "size_bytes": st.f_blocks * st.f_frsize,
        "used_bytes": (st.f_blocks - st.f_bfree) * st.f_frsize,
        "available_bytes": st.f_bavail * st.f_frsize,
        "inodes": st.f_files,
        "inodes_free": st.f_ffree,
    }


class ShmMountCollector:
    name = "shm_mount"
    schedule = "poll"

    def __init__(self, paths: Paths, mounts: Sequence[str],
                 statvfs: Callable[[str], os.statvfs_result] = os.statvfs, discovery=None):
        self.paths = paths
        self.mounts = list(mounts)
        self.statvfs = statvfs
        self.discovery = discovery  # node mode: the mounts are re-discovered on every poll
        self._warned: Dict[str, str] = {}

    def mountinfo(self) -> List[MountEntry]:
        # In a container our own mountinfo is the workload's view; with a host at --path.rootfs,
        # pid 1's is the host's.
        return read_mountinfo(self.paths, host_first=self.paths.rootfs not in ("", "/"))

    def _warn_once(self, mount: str, message: str) -> None:
        if self._warned.get(mount) != message:
            self._warned[mount] = message
            log.warning("mount %s: %s", mount, message)

    def measure_one(self, mount: str, entries: Sequence[MountEntry]) -> MountUsage:
        entry = find_mount(entries, mount)
        fstype = entry.fstype if entry else "unknown"
        source = entry.source if entry else ""
        is_point = bool(entry and (entry.mount_point.rstrip("/") or "/") == mount)
        try:
            values = measure(self.paths.host(mount), self.statvfs)
        except OSError as err:
            reason = err.strerror or str(err)
            self._warn_once(mount, f"cannot be measured: {reason}")
            return MountUsage(mount, fstype, source, is_point, error=reason)
        if fstype != "tmpfs" or not is_point:
            where = "is not a mount point" if not is_point else f"is {fstype}, not tmpfs"
            self._warn_once(mount, f"{where}; reporting the filesystem that holds it")
        else:
            self._warned.pop(mount, None)
        return MountUsage(mount, fstype, source, is_point, **values)

    def collect(self) -> List[MountUsage]:
        entries = self.mountinfo()
        mounts = self.mounts
        if self.discovery is not None:
            mounts = [t.mount for t in self.discovery.refresh(entries)]
        return [self.measure_one(mount, entries) for mount in mounts]
