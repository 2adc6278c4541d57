"""What the owner scan reads of a process: its /proc/<pid>/maps lines on the watched devices
(only those are split), and the watched mounts' IDs in its mount namespace (an fd is stat'ed
only if fdinfo's mnt_id names one: a stat on a hung FUSE or NFS mount blocks for good)."""

import errno
import os
import re
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple
from typing import TypeVar

from exporter.host.mountinfo import parse_mountinfo
from exporter.host.paths import OUT_OF_RESOURCES, Paths, read_text
from exporter.host.proctable import Process


@dataclass(frozen=True, slots=True)
class MapsLine:
    """A line of /proc/<pid>/maps that maps a file of interest."""

    dev: int
    inode: int
    path: str  # as maps prints it: "... (deleted)" when unlinked
    extent: int  # bytes the mapping reaches into the file (offset + length)
    map_range: str  # "start-end" as map_files/ names the mapping

    @property
    def key(self) -> Tuple[int, int]:
        return self.dev, self.inode


Search = Callable[..., Optional["re.Match[str]"]]  # a compiled pattern's search
MEMFD, DELETED = "/memfd:", " (deleted)"
NO_MNT_ID = -1  # fdinfo without mnt_id: any fd could be on a watched mount
DENIED = (errno.EACCES, errno.EPERM)
R = TypeVar("R")


def unread(err: OSError, gone: R) -> Optional[R]:
    """A process's /proc read that failed: None when denied, raised when out of fds or
    memory (failing the scan: taken for gone, what the process holds would be called
    leaked), else `gone` (it exited since it was listed)."""
    if err.errno in DENIED:
        return None
    if err.errno in OUT_OF_RESOURCES:
        raise err
    return gone


_MNT_ID = re.compile(rb"mnt_id:[ \t]*(\d+)[ \t]*(?:\n|$)").search


def dev_token(dev: int) -> str:
    """st_dev -> ' 00:1a ' as /proc/<pid>/maps prints it (hex, at least two digits)."""
    return " %02x:%02x " % (os.major(dev), os.minor(dev))


class DeviceTokens(Dict[str, int]):
    """dev_token(dev) -> dev, and one search for them all, made once per scan: it runs in C
    past the lines of other devices (the anonymous mappings' " 00:00 ")."""

    def __init__(self, tokens: Dict[str, int]):
        super().__init__(tokens)
        self.find = re.compile("|".join(map(re.escape, tokens)) or "(?!)").search


def _fields(text: str, search: Search) -> Iterator[Tuple[List[str], str]]:
    """(fields, match) per `search` hit. Not splitlines(): "\x1e" or "\x85" may be in a path."""
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
    return MapsLine(
        dev=dev,
        inode=inode,
        path=parts[5],
        extent=offset + end - start,
        map_range=f"{start:x}-{end:x}",
    )


def parse_maps(text: str, tokens: Dict[str, int]) -> List[MapsLine]:
    """Lines of maps on the watched devices. The token must be the device field, not path text
    ("/tmp/x 00:1a y (deleted)" on another device would fake a hidden segment on 00:1a)."""
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


@dataclass(frozen=True)
class Namespace:
    """What the owner scan knows of one mount namespace."""

    watched: Set[int]  # mount IDs of the watched devices
    ids: Set[int]  # every mount ID in it
    devs: Set[str]  # every mount's device, "major:minor"


class WatchedMountIds:
    """Mount namespace -> mount IDs of watched devices in it, and each process's namespace,
    so that a namespace's IDs leave with its last process."""

    def __init__(self, paths: Paths) -> None:
        self.paths = paths
        self._ns_mounts: Dict[str, Namespace] = {}
        self._ns_of: Dict[int, str] = {}  # pid -> its mount namespace
        self.learned_devs: Set[int] = (
            set()
        )  # the watched devices the IDs were learnt for
        self.union: Set[int] = set()  # every namespace's watched mount IDs
        # And every mount ID and device of the namespaces read (a memfd is on none).
        self.mounted_ids: Set[int] = set()
        self.mounted_devs: Set[str] = set()

    def learn(
        self, processes: Iterable[Process], devs: Set[int], again: bool = True
    ) -> None:
        """Every namespace's watched mount IDs (`union`). An fd passed from another namespace
        is on a mount its holder's mountinfo does not list; IDs are unique across namespaces,
        so their union still tells. `again=False`: add `processes` to what was learnt."""
        if again:
            self._ns_mounts, self._ns_of = {}, {}
            self.learned_devs = set(devs)
            self.union, self.mounted_ids, self.mounted_devs = set(), set(), set()
        for proc in processes:
            self.union |= self.of(proc.pid, devs) or set()

    def forget(self, gone: Set[int]) -> None:
        """Drop the namespaces no process is left in: a stale (reused) mount ID could name a
        FUSE mount whose files must never be stat'ed."""
        left = {self._ns_of.pop(pid) for pid in gone if pid in self._ns_of}
        left -= set(self._ns_of.values())
        if not left:
            return
        for namespace in left:
            self._ns_mounts.pop(namespace, None)
        spaces = self._ns_mounts.values()
        self.union = set().union(*(ns.watched for ns in spaces))
        self.mounted_ids = set().union(*(ns.ids for ns in spaces))
        self.mounted_devs = set().union(*(ns.devs for ns in spaces))

    def of(self, pid: int, devs: Set[int]) -> Optional[Set[int]]:
        """Watched mount IDs in the process's namespace; None when its mountinfo is denied."""
        try:
            namespace = os.readlink(self.paths.proc(pid, "ns", "mnt"))
        except OSError:
            namespace = f"pid:{pid}"  # its own entry, forgotten with it
        self._ns_of[pid] = namespace
        if namespace in self._ns_mounts:
            return self._ns_mounts[namespace].watched
        try:
            text = read_text(self.paths.proc(pid, "mountinfo"))
        except OSError as err:  # gone (or a fixture without one): no fds
            return unread(err, gone=set())
        wanted = {f"{os.major(dev)}:{os.minor(dev)}" for dev in devs}
        devices = {e.mount_id: e.device for e in parse_mountinfo(text)}
        watched = {i for i, device in devices.items() if device in wanted}
        ns = Namespace(watched=watched, ids=set(devices), devs=set(devices.values()))
        self._ns_mounts[namespace] = ns
        self.mounted_ids |= ns.ids
        self.mounted_devs |= ns.devs
        return ns.watched

    @staticmethod
    def fd_mount(fdinfo: str) -> Optional[int]:
        """fdinfo's mnt_id; NO_MNT_ID before Linux 3.15; None: fd closed since listdir (or
        denied); out of fds or memory raised, as `unread` says."""
        try:
            fd = os.open(fdinfo, os.O_RDONLY | os.O_CLOEXEC)
            try:
                info = os.read(fd, 4096)  # pos, flags, mnt_id and ino come first
            finally:
                os.close(fd)
        except OSError as err:
            if err.errno in OUT_OF_RESOURCES:
                raise  # it says nothing of the fd
            return None
        if b"mnt_id:" not in info:
            return NO_MNT_ID
        found = _MNT_ID(info)
        return int(found[1]) if found else None
