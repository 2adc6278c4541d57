"""/proc/<pid>/maps, read for the lines on the watched devices only: only those are split."""

from __future__ import annotations

import os
import re
from typing import Dict, List, Optional, Set, Tuple

MapsLine = Tuple[int, int, str, int, str]  # dev, inode, path, extent, address range


def dev_token(dev: int) -> str:
    """st_dev -> ' 00:1a ' as /proc/<pid>/maps prints it (hex, at least two digits)."""
    return " %02x:%02x " % (os.major(dev), os.minor(dev))


class DeviceTokens(Dict[str, int]):
    """dev_token(dev) -> dev, and one search for them all, made once per scan: it runs in C
    past the lines of other devices (the anonymous mappings' " 00:00 ")."""

    def __init__(self, tokens: Dict[str, int]):
        super().__init__(tokens)
        self.find = re.compile("|".join(map(re.escape, tokens)) or "(?!)").search

    @classmethod
    def of(cls, devs: Set[int]) -> "DeviceTokens":
        return cls({dev_token(d): d for d in devs})


def parse_maps(text: str, tokens: Dict[str, int]) -> List[MapsLine]:
    """Lines of maps on the watched devices -> [(dev, inode, path, extent, address range)].
    A line's first token is its device field (none before it holds a ':'); one in a path
    is refused by the parse. Not splitlines(): "\x1e" or "\x85" may be in a path."""
    found: List[MapsLine] = []
    tokens = tokens if isinstance(tokens, DeviceTokens) else DeviceTokens(tokens)
    hit = tokens.find(text)
    while hit is not None:
        pos, token = hit.start(), hit.group()
        line_start = text.rfind("\n", 0, pos) + 1
        line_end = text.find("\n", pos)
        line = text[line_start : line_end if line_end != -1 else len(text)]
        if parsed := _parse_maps_line(line, tokens[token], token):
            found.append(parsed)
        hit = tokens.find(text, line_end) if line_end != -1 else None
    return found


def _parse_maps_line(line: str, dev: int, token: str) -> Optional[MapsLine]:
    parts = line.split(None, 5)
    # The token must be the device field, not text in a path on another device
    # ("/tmp/x 00:1a y (deleted)" would otherwise fake a hidden segment on 00:1a).
    if len(parts) < 6 or parts[3] != token.strip():
        return None
    try:
        start, end = (int(x, 16) for x in parts[0].split("-"))
        offset, inode = int(parts[2], 16), int(parts[4])
    except ValueError:
        return None
    # map_files/ names a mapping "%lx-%lx", without the zero padding maps uses.
    return dev, inode, parts[5], offset + end - start, f"{start:x}-{end:x}"


MEMFD, DELETED = "/memfd:", " (deleted)"


def memfd_name(path: str) -> Optional[str]:
    """'/memfd:<name> (deleted)' -> name; None for any other path. What is on a mount (a
    tenant's file at /memfd:x) is told by its device or mount ID, not here."""
    if path.startswith(MEMFD) and path.endswith(DELETED):
        return path[len(MEMFD) : -len(DELETED)]
    return None


def parse_memfd(text: str, mounted: Set[str]) -> List[MapsLine]:
    """Lines of maps mapping a memfd ('/memfd:<name> (deleted)'), on a device no mount in
    `mounted` ("major:minor") has: memfd pages are shmem that no mount shows (Mooncake, UCX,
    CUDA's host allocations)."""
    found: List[MapsLine] = []
    pos = text.find(MEMFD)
    while pos != -1:
        line_start = text.rfind("\n", 0, pos) + 1
        line_end = text.find("\n", pos)
        line = text[line_start : line_end if line_end != -1 else len(text)]
        parts = line.split(None, 5)
        if len(parts) == 6 and memfd_name(parts[5]) is not None and ":" in parts[3]:
            major, minor = parts[3].split(":", 1)
            try:
                dev = os.makedev(int(major, 16), int(minor, 16))
            except ValueError:
                dev = -1
            unmounted = dev != -1 and f"{os.major(dev)}:{os.minor(dev)}" not in mounted
            if unmounted and (parsed := _parse_maps_line(line, dev, parts[3])):
                found.append(parsed)
        pos = text.find(MEMFD, line_end) if line_end != -1 else -1
    return found
