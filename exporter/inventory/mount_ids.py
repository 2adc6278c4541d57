"""Which mount IDs are the watched mounts, in every mount namespace a process is in: the
owner scan stats an fd only when fdinfo's mnt_id names one (a stat on a hung FUSE or NFS
mount blocks for good)."""

from __future__ import annotations

import errno
import os
from typing import Dict, Iterable, Optional, Set

from exporter.host.mountinfo import parse_mountinfo
from exporter.host.paths import Paths, read_text
from exporter.host.proctable import Process


def denied(err: OSError) -> bool:
    return err.errno in (errno.EACCES, errno.EPERM)


class WatchedMountIds:
    """Mount namespace -> mount IDs of watched devices in it, and each process's namespace,
    so that a namespace's IDs leave with its last process."""

    def __init__(self, paths: Paths):
        self.paths = paths
        self._ns_mounts: Dict[str, Optional[Set[int]]] = {}
        self._ns_of: Dict[int, str] = {}
        self.union: Set[int] = set()  # every namespace's IDs (learn)
        self.learned_devs: Set[int] = set()  # the watched devices they were learnt for

    def learn(
        self, processes: Iterable[Process], devs: Set[int], again: bool = True
    ) -> None:
        """Every namespace's watched mount IDs. An fd passed from another namespace is on a
        mount its holder's mountinfo does not list; IDs are unique across namespaces, so
        their union still tells. `again=False`: add `processes` to what was learnt."""
        if again:
            self._ns_mounts = {}
            self._ns_of = {}
            self.union = set()
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
        self.union = set().union(*(ids for ids in self._ns_mounts.values() if ids))

    def of(self, pid: int, devs: Set[int]) -> Optional[Set[int]]:
        """Watched mount IDs in the process's namespace; None when its mountinfo is denied."""
        try:
            namespace = os.readlink(self.paths.proc(pid, "ns", "mnt"))
        except OSError:
            namespace = f"pid:{pid}"  # its own entry, forgotten with it
        self._ns_of[pid] = namespace
        if namespace in self._ns_mounts:
            return self._ns_mounts[namespace]
        try:
            text = read_text(self.paths.proc(pid, "mountinfo"))
        except OSError as err:  # gone (or a fixture without one): no fds
            return None if denied(err) else set()
        wanted = {f"{os.major(dev)}:{os.minor(dev)}" for dev in devs}
        ids = {e.mount_id for e in parse_mountinfo(text) if e.device in wanted}
        self._ns_mounts[namespace] = ids
        return ids

    @staticmethod
    def holds_fd(fdinfo: str, mount_ids: Set[int]) -> bool:
        """Whether an fd is on a watched mount, from fdinfo's mnt_id (none before 3.15)."""
        try:
            with open(fdinfo, "rb", buffering=0) as handle:
                info = handle.read(4096)  # pos, flags, mnt_id and ino come first
        except OSError:
            return False  # closed since listdir
        at = info.find(b"mnt_id:")
        if at == -1:
            return True
        end = info.find(b"\n", at)
        try:
            return int(info[at + 7 : end if end != -1 else len(info)]) in mount_ids
        except ValueError:
            return False
