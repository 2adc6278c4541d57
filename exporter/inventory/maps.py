"""/proc/<pid>/maps, read for the lines on the watched devices only: only those are split."""

from __future__ import annotations

import os
import re
from typing import Callable, Dict, Iterator, List, Optional, Set, Tuple

MapsLine = Tuple[int, int, str, int, str]  # dev, inode, path, extent, address range
MEMFD, DELETED = "/memfd:", " (deleted)"


def dev_token(dev: int) -> str:
    """st_dev -> ' 00:1a ' as /proc/<pid>/maps prints it (hex, at least two digits)."""
    return " %02x:%02x " % (os.major(dev), os.minor(dev))


class DeviceTokens(Dict[str, int]):
    """dev_token(dev) -> dev, and one search for them all, made once per scan: it runs in C
    past the lines of other devices (the anonymous mappings' " 00:00 ")."""

    def __init__(self, tokens: Dict[str, int]):
        super().__init__(tokens)
        self.find = re.compile("|".join(map(re.escape, tokens)) or "(?!)").search


def _fields(text: str, search: Callable) -> Iterator[Tuple[List[str], str]]:
    """(fields, match) of each line where `search` matches. Not splitlines(): "\x1e" or
    "\x85" may be in a path."""
    hit = search(text)
    while hit is not None:
        end = text.find("\n", hit.start())
        end = len(text) if end == -1 else end
        parts = text[text.rfind("\n", 0, hit.start()) + 1 : end].split(None, 5)
        if len(parts) == 6:
            yield parts, hit.group()
        hit = search(text, end)


def _entry(parts: List[str], dev: int) -> Optional[MapsLine]:
    try:
        start, end = (int(x, 16) for x in parts[0].split("-"))
        offset, inode = int(parts[2], 16), int(parts[4])
    except ValueError:
        return None
    # map_files/ names a mapping "%lx-%lx", without the zero padding maps uses.
    return dev, inode, parts[5], offset + end - start, f"{start:x}-{end:x}"


def parse_maps(text: str, tokens: Dict[str, int]) -> List[MapsLine]:
    """Lines of maps on the watched devices -> [(dev, inode, path, extent, address range)].
    The token must be the device field, not text in a path on another device ("/tmp/x
    00:1a y (deleted)" would otherwise fake a hidden segment on 00:1a)."""
    tokens = tokens if isinstance(tokens, DeviceTokens) else DeviceTokens(tokens)
    found = []
    for parts, token in _fields(text, tokens.find):
        if parts[3] == token.strip() and (entry := _entry(parts, tokens[token])):
            found.append(entry)
    return found


def memfd_name(path: str) -> Optional[str]:
    """'/memfd:<name> (deleted)' -> name; None for any other path. What is on a mount (a
    tenant's file at /memfd:x) is told by its device or mount ID, not here."""
    if path.startswith(MEMFD) and path.endswith(DELETED):
        return path[len(MEMFD) : -len(DELETED)]
    return None


def parse_memfd(text: str, mounted: Set[str]) -> List[MapsLine]:
    """Lines of maps mapping a memfd, on a device no mount in `mounted` ("major:minor")
    has: memfd pages are shmem that no mount shows (Mooncake, UCX, CUDA's host allocations)."""
    found = []
    for parts, _ in _fields(text, re.compile(re.escape(MEMFD)).search):
        major, _, minor = parts[3].partition(":")
        try:
            dev = os.makedev(int(major, 16), int(minor, 16))
        except ValueError:
            continue
        unmounted = f"{os.major(dev)}:{os.minor(dev)}" not in mounted
        if memfd_name(parts[5]) is not None and unmounted and (e := _entry(parts, dev)):
            found.append(e)
    return found
