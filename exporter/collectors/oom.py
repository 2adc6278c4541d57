"""OOM kills from the kernel's reports (/dev/kmsg), as cAdvisor's utils/oomparser reads
them. Not the cgroup counters alone: v1 counts a kill only in the victim's memcg, gone
with its container; the kernel log names both cgroups of each kill (the one whose limit
was hit, the victim's) and outlives them. Serving starts at the ring's end (a restart
must not count its kills twice), check at its start."""

import errno
import os
import re
from typing import Iterable, List, Optional, Tuple

from exporter.collectors.source import Source, register
from exporter.model.types import OomKill, OomReports

# A /dev/kmsg record: 'prio,seq,usec,flags[,...];message', then ' KEY=value' lines.
_RECORD = re.compile(r"[^,;]*,(\d+),(\d+)(?:,[^;]*)?;(.*)")
# cAdvisor's containerRegexp; cpuset and nodemask may hold commas: cgroups from the end.
_OOM_KILL = re.compile(  # global_oom: a system-wide OOM; a memcg OOM names oom_memcg
    r"oom-kill:constraint=(?P<constraint>[^,]*),.*?(?:oom_memcg=(?P<oom_memcg>.*)|global_oom),"
    r"task_memcg=(?P<task_memcg>.*),task=(?P<task>.*),pid=(?P<pid>\d+),uid=(?P<uid>\d+)"
)
_LEGACY = re.compile(  # before 4.19 (cAdvisor's legacyContainerRegexp)
    r"Task in (?P<task_memcg>\S+) killed as a result of limit of (?P<oom_memcg>\S+)"
)
# cAdvisor's lastLineRegexp; comm may hold spaces and '()': it ends at the last ')'.
_KILLED = re.compile(r"Killed process (?P<pid>\d+) \((?P<comm>.*)\)(?P<rest>[^()]*)$")
_RSS = re.compile(r"(anon|file|shmem)-rss:(\d+)kB")  # the victim's (mm/oom_kill.c)


def parse_kmsg_record(record: str) -> Optional[Tuple[int, int, str]]:
    """-> (seq, usec, message's first line); None: not a record."""
    match = _RECORD.match(record)
    return (int(match[1]), int(match[2]), match[3]) if match else None


def parse_oom_kills(records: Iterable[str], pending=None) -> List[OomKill]:
    """Every OOM report these /dev/kmsg records complete. `pending` (kept across calls): by pid,
    a report's (task_memcg, oom_memcg, constraint) until its "Killed process" line, bounded (that
    line may be lost to an overrun)."""
    pending = {} if pending is None else pending
    kills = []
    for seq, usec, message in filter(None, map(parse_kmsg_record, records)):
        if match := _OOM_KILL.search(message):
            if len(pending) > 64:
                pending.clear()
            cgroups = match["task_memcg"], match["oom_memcg"] or "", match["constraint"]
            pending[int(match["pid"])] = cgroups
        elif match := _LEGACY.search(message):
            pending[None] = (match["task_memcg"], match["oom_memcg"], "")
        elif (match := _KILLED.search(message)) and "reaped process" not in message:
            pid = int(match["pid"])
            legacy = pending.pop(None, ("", "", ""))  # a pre-4.19 report has no pid
            task_memcg, oom_memcg, constraint = pending.pop(pid, None) or legacy
            if not constraint and message.startswith("Memory cgroup"):
                constraint = "CONSTRAINT_MEMCG"
            rss = {kind: int(kb) * 1024 for kind, kb in _RSS.findall(match["rest"])}
            rss_bytes = map(rss.get, ("anon", "file", "shmem"))
            cgroups = (task_memcg, oom_memcg, constraint)
            kills.append(OomKill(seq, usec, pid, match["comm"], *cgroups, *rss_bytes))
    return kills


class OomCollector(Source):
    name = "oom"

    def __init__(self, kmsg_path: str = "/dev/kmsg", from_start: bool = False):
        self.kmsg_path = kmsg_path
        self.from_start = from_start
        self._fd: Optional[int] = None
        self._pending: dict = {}  # reports begun, not yet complete

    def collect(self) -> OomReports:
        if self._fd is None:
            try:
                flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
                self._fd = os.open(self.kmsg_path, flags)
            except PermissionError as err:
                raise PermissionError(
                    f"{self.kmsg_path}: {err.strerror} (needs CAP_SYSLOG when "
                    f"kernel.dmesg_restrict=1, and the device in a container)"
                ) from None
            if not self.from_start:  # the next record written from now on
                os.lseek(self._fd, 0, os.SEEK_END)
        records, lost = [], 0
        while True:
            try:
                raw = os.read(self._fd, 8192)  # one read: one record (~1 KiB + dict)
            except BlockingIOError:
                break  # EAGAIN: nothing more for now
            except OSError as err:
                # EPIPE: the ring wrapped past us; reading goes on from the oldest record
                # left. EINVAL: a record larger than our buffer (never an OOM report line).
                if err.errno not in (errno.EPIPE, errno.EINVAL):
                    raise
                lost += err.errno == errno.EPIPE
                continue
            if not raw:
                break
            records.append(raw.decode("utf-8", "replace"))
        return OomReports(tuple(parse_oom_kills(records, self._pending)), lost)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# Off by default in a sidecar: /dev/kmsg is not in a container unless given, and needs CAP_SYSLOG.
register("oom", lambda c: OomCollector(c.cfg.kmsg, c.kmsg_from_start), modes=("node",))
