"""/proc/<pid>/mountinfo: parsed once, looked up by mount point.

Shared by the shm_mount collector (type and source of each watched mount) and by
discovery (node mode: every pod's and container's shm on the host).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

from .paths import Paths, read_text


@dataclass(frozen=True)
class MountEntry:
    mount_point: str
    fstype: str
    source: str
    options: str  # per-mount and superblock options, comma-separated
    device: str = ""  # major:minor
    root: str = "/"  # the directory of the filesystem mounted here (a bind mount's or a cgroup namespace's root)


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
    for line in text.splitlines():
        fields = line.split(" ")
        try:
            sep = fields.index("-", 6)
            entries.append(MountEntry(
                mount_point=_unescape(fields[4]), fstype=fields[sep + 1], source=_unescape(fields[sep + 2]),
                options=fields[5] + "," + (fields[sep + 3] if len(fields) > sep + 3 else ""),
                device=fields[2], root=_unescape(fields[3])))
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
