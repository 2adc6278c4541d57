"""Names are data: how `check` shows what others named (files, processes, cgroups, mounts, log
lines), the shell commands it advises, and every name of a leaked file with hard links.

`shown` writes each character that is not printable (C0 and C1 controls, DEL, ESC, bidi
overrides such as U+202E) as an escape, a byte that is not UTF-8 as `\\xff`, a backslash as
two: a name can neither drive the terminal nor pass for another. `shell` writes one command,
each argument quoted: `shlex.quote`, or bash's `$'...'` for one holding any other character
than printable ASCII (the command is one line of printable ASCII: exact in any terminal)."""

import os
import shlex
import time
from dataclasses import dataclass, field
from stat import S_ISDIR
from typing import Dict, List, Optional, Set, Tuple

from exporter.host.paths import Paths
from exporter.model.step import Model
from exporter.model.types import Segment

Key = Tuple[int, int]  # (st_dev, st_ino)
Links = Optional[Dict[Key, "Names"]]  # leaked_names's answer; None: not looked up
# the inventory's bounds on a walk of a hostile mount
MAX_DEPTH, MAX_ENTRIES = 8, 250_000
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def shown(text: object, limit: int = 0) -> str:
    """A name, or another program's words, as `check` prints it (the module's docstring);
    with a `limit`, at most that many of its characters, and "..." for the rest."""
    text = str(text)
    text = text[:limit] + "..." if 0 < limit < len(text) else text
    return printable(text.replace("\\", "\\\\"))


def printable(text: str) -> str:
    """`text`, every character that is not printable escaped, backslashes as they are: the
    last guard of what check composed around shown names."""
    return "".join(c if c.isprintable() else _escape(c) for c in text)


def _escape(char: str) -> str:
    code = ord(char)
    if code < 0x80 or 0xDC80 <= code <= 0xDCFF:  # a byte (not UTF-8: surrogateescape's)
        return f"\\x{code & 0xFF:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def shell(*argv: str) -> str:
    """One command line to paste, each argument quoted (the module's docstring)."""
    return " ".join(shlex.quote(a) if _plain(a) else _ansi_c(a) for a in argv)


def _plain(arg: str) -> bool:
    return arg.isascii() and arg.isprintable()


def _ansi_c(arg: str) -> str:
    """$'...': printable ASCII as itself (\\ ' ! escaped), every other byte as \\xHH."""
    data = arg.encode("utf-8", "surrogateescape")
    return "$'" + "".join(_BYTES[b] for b in data) + "'"


_BYTES = [chr(b) if 0x20 <= b < 0x7F else f"\\x{b:02x}" for b in range(256)]
_BYTES[ord("\\")], _BYTES[ord("'")], _BYTES[ord("!")] = "\\\\", "\\'", "\\x21"


@dataclass(frozen=True)
class Names:
    """A leaked file's names below its mount, of the `links` (st_nlink) it has; 0 links:
    gone, or another file, when looked at after the inventory."""

    found: Tuple[str, ...]
    links: int


GONE = Names(found=(), links=0)


@dataclass
class _Walk:
    found: Dict[Key, List[str]]
    deadline: float
    # each directory read once: a bind mount of one below the mount shows it again
    dirs: Set[Key] = field(default_factory=set)
    entries: int = 0


def leaked_names(model: Model, paths: Paths, deadline: float) -> Dict[Key, Names]:
    """Each leaked file's names, by (dev, inode): its listed name's lstat, and a walk of its
    mount when it has several (not all found by `deadline`: fewer found than it has)."""
    out: Dict[Key, Names] = {}
    for view in model.mounts:
        if view.summary is not None:
            out.update(_names(paths.host(view.mount), view.summary.leaked, deadline))
    return out


def _names(root: str, leaked: List[Segment], deadline: float) -> Dict[Key, Names]:
    out: Dict[Key, Names] = {}
    several: Dict[Key, int] = {}  # -> links, of the files with more than one
    for seg in leaked:
        links = _links(os.path.join(root, seg.name), seg.key)
        if links > 1:
            several[seg.key] = links
        else:
            out[seg.key] = Names(found=(seg.name,), links=1) if links else GONE
    walk = _Walk(found={key: [] for key in several}, deadline=deadline)
    if several:
        _read(root, "", 0, walk)
    for key, links in several.items():
        out[key] = Names(found=tuple(sorted(walk.found[key])), links=links)
    return out


def _links(path: str, key: Key) -> int:
    """The file's link count; 0 when it is gone or another file than `key`."""
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    return st.st_nlink if (st.st_dev, st.st_ino) == key else 0


def _read(
    directory: str, below: str, depth: int, walk: _Walk, at: Optional[int] = None
) -> None:
    """Adds the names of the sought inodes below `directory` (opened relative to `at`, never
    through a symlink): lstat only, no other filesystem, each directory once, within bounds."""
    try:
        fd = os.open(directory, _DIR, dir_fd=at)
    except OSError:
        return
    try:
        st = os.fstat(fd)
        if depth > MAX_DEPTH or (st.st_dev, st.st_ino) in walk.dirs:
            return
        walk.dirs.add((st.st_dev, st.st_ino))
        with os.scandir(fd) as entries:
            for entry in entries:
                walk.entries += 1
                if walk.entries > MAX_ENTRIES or time.monotonic() > walk.deadline:
                    return
                try:
                    found = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                key = (found.st_dev, found.st_ino)
                if key in walk.found:
                    walk.found[key].append(below + entry.name)
                elif S_ISDIR(found.st_mode) and found.st_dev == st.st_dev:
                    _read(entry.name, f"{below}{entry.name}/", depth + 1, walk, fd)
    finally:
        os.close(fd)
