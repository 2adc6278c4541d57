"""Which mount IDs are the watched mounts, in every mount namespace a process is in: the
owner scan stats an fd only when fdinfo's mnt_id names one (a stat on a hung FUSE or NFS
mount blocks for good)."""

from __future__ import annotations

import errno
import os
from typing import Dict, Iterable, NamedTuple, Optional, Set

from exporter.host.mountinfo import parse_mountinfo
from exporter.host.paths import Paths, read_text
from exporter.host.proctable import Process


def denied(err: OSError) -> bool:
    return err.errno in (errno.EACCES, errno.EPERM)


class Namespace(NamedTuple):
    watched: Set[int]  # mount IDs of the watched devices
    ids: Set[int]  # every mount ID in it
    devs: Set[str]  # every mount's device, "major:minor"


class WatchedMountIds:
    """Mount namespace -> mount IDs of watched devices in it, and each process's namespace,
    so that a namespace's IDs leave with its last process."""

    def __init__(self, paths: Paths):
        self.paths = paths
        self._ns_mounts: Dict[str, Namespace] = {}
        self._ns_of: Dict[int, str] = {}
        self.union: Set[int] = set()  # every namespace's IDs (learn)
        self.learned_devs: Set[int] = set()  # the watched devices they were learnt for
        # Every mount ID and device of the namespaces read: a memfd's (the kernel's internal
        # shm mount) is none of them; a tenant's file at /memfd:x is on one.
        self.mounted_ids: Set[int] = set()
        self.mounted_devs: Set[str] = set()

    def learn(
        self, processes: Iterable[Process], devs: Set[int], again: bool = True
    ) -> None:
        """Every namespace's watched mount IDs. An fd passed from another namespace is on a
        mount its holder's mountinfo does not list; IDs are unique across namespaces, so
        their union still tells. `again=False`: add `processes` to what was learnt."""
        if again:
            self._ns_mounts = {}
            self._ns_of = {}
            self.union, self.mounted_ids, self.mounted_devs = set(), set(), set()
            self.learned_devs = set(devs)
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
            return None if denied(err) else set()
        wanted = {f"{os.major(dev)}:{os.minor(dev)}" for dev in devs}
        entries = parse_mountinfo(text)
        ns = Namespace(
            {e.mount_id for e in entries if e.device in wanted},
            {e.mount_id for e in entries},
            {e.device for e in entries},
        )
        self._ns_mounts[namespace] = ns
        self.mounted_ids |= ns.ids
        self.mounted_devs |= ns.devs
        return ns.watched

    @staticmethod
    def fd_mount(fdinfo: str) -> Optional[int]:
        """An fd's mount ID from fdinfo; NO_MNT_ID before Linux 3.15, None when it closed
        since listdir."""
        try:
            fd = os.open(fdinfo, os.O_RDONLY | os.O_CLOEXEC)
            try:
                info = os.read(fd, 4096)  # pos, flags, mnt_id and ino come first
            finally:
                os.close(fd)
        except OSError:
            return None
        at = info.find(b"mnt_id:")
        if at == -1:
            return NO_MNT_ID
        end = info.find(b"\n", at)
        try:
            return int(info[at + 7 : end if end != -1 else len(info)])
        except ValueError:
            return None


NO_MNT_ID = -1  # fdinfo without mnt_id: any fd could be on a watched mount
