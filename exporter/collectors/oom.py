"""OOM kills from the kernel's own reports (/dev/kmsg), as cAdvisor's utils/oomparser reads them.

Why not the cgroup counters alone: v1 counts a kill only in the victim's own memcg, which
goes with its container; the kernel log names both cgroups of every kill (the one whose limit
was hit, the victim's) and outlives them: "oom-kill:...,oom_memcg=...,task_memcg=..." then
"Killed process <pid> (<comm>) ... shmem-rss:..kB" (before 4.19: "Task in <memcg> killed as a
result of limit of <memcg>"). Serving seeks to the end first (a restart must not count the
ring's kills twice); check reads the ring from its start. Needs CAP_SYSLOG (dmesg_restrict).
"""

import errno
import os
import re
from typing import Dict, Iterable, List, Optional, Tuple

from exporter.collectors.source import BaseSource, register
from exporter.model.types import OomKill, OomReports

# A /dev/kmsg record: 'prio,seq,usec,flags[,...];message', then ' KEY=value' lines.
_RECORD = re.compile(r"[^,;]*,(\d+),(\d+)(?:,[^;]*)?;(.*)")
# cAdvisor's containerRegexp, with the cgroup fields taken from the end: cpuset and
# nodemask may hold commas, task and the memcg paths come last in a fixed order.
# A system-wide OOM says global_oom where a memcg OOM names its oom_memcg.
_OOM_KILL = re.compile(
    r"oom-kill:constraint=(?P<constraint>[^,]*),.*?(?:oom_memcg=(?P<oom_memcg>.*)|global_oom),"
    r"task_memcg=(?P<task_memcg>.*),task=(?P<task>.*),pid=(?P<pid>\d+),uid=(?P<uid>\d+)"
)
# Before 4.19 (cAdvisor's legacyContainerRegexp).
_LEGACY = re.compile(
    r"Task in (?P<task_memcg>\S+) killed as a result of limit of (?P<oom_memcg>\S+)"
)
# cAdvisor's lastLineRegexp, and the victim's RSS by kind (mm/oom_kill.c).
# comm may hold spaces and parentheses: it ends at the last ')' (nothing after it has one).
_KILLED = re.compile(r"Killed process (?P<pid>\d+) \((?P<comm>.*)\)(?P<rest>[^()]*)$")
_RSS = re.compile(r"(anon|file|shmem)-rss:(\d+)kB")

# One read() returns one record; the kernel's limit is about 1 KiB + dict.
KMSG_RECORD_MAX = 8192


def parse_kmsg_record(record: str) -> Optional[Tuple[int, int, str]]:
    """-> (seq, usec, message's first line); None: not a record."""
    match = _RECORD.match(record)
    return (int(match[1]), int(match[2]), match[3]) if match else None


class OomParser:
    """Kernel log messages in order -> an OomKill when a report completes. A cgroup line is
    kept by pid until its "Killed process" line (bounded: that line may be lost to an overrun)."""

    def __init__(self) -> None:
        # pid -> (task_memcg, oom_memcg, constraint)
        self._pending: Dict[int, Tuple[str, str, str]] = {}
        self._legacy: Optional[Tuple[str, str]] = None

    def feed(self, seq: int, usec: int, message: str) -> Optional[OomKill]:
        if match := _OOM_KILL.search(message):
            if len(self._pending) > 64:
                self._pending.clear()
            cgroups = match["task_memcg"], match["oom_memcg"] or "", match["constraint"]
            self._pending[int(match["pid"])] = cgroups
        elif match := _LEGACY.search(message):
            self._legacy = (match["task_memcg"], match["oom_memcg"])
        elif (match := _KILLED.search(message)) and "reaped process" not in message:
            pid = int(match["pid"])
            legacy = (*(self._legacy or ("", "")), "")
            self._legacy = None
            task_memcg, oom_memcg, constraint = self._pending.pop(pid, None) or legacy
            if not constraint and message.startswith("Memory cgroup"):
                constraint = "CONSTRAINT_MEMCG"
            rss = {kind: int(kb) * 1024 for kind, kb in _RSS.findall(match["rest"])}
            rss_bytes = map(rss.get, ("anon", "file", "shmem"))
            cgroups = (task_memcg, oom_memcg, constraint)
            return OomKill(seq, usec, pid, match["comm"], *cgroups, *rss_bytes)
        return None


def parse_oom_kills(records: Iterable[str], parser=None) -> List[OomKill]:
    """Every OOM report completed by these /dev/kmsg records (`parser`: holding reports
    begun in earlier records)."""
    parser = parser or OomParser()
    kills = [parser.feed(*m) for m in map(parse_kmsg_record, records) if m]
    return [kill for kill in kills if kill is not None]


class OomCollector(BaseSource):
    """Drains /dev/kmsg on each poll; the model counts the kills. Keeps only its position."""

    name = "oom"

    def __init__(self, kmsg_path: str = "/dev/kmsg", from_start: bool = False):
        self.kmsg_path = kmsg_path
        self.from_start = from_start
        self._fd: Optional[int] = None
        self._parser = OomParser()

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
                raw = os.read(self._fd, KMSG_RECORD_MAX)
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
        return OomReports(tuple(parse_oom_kills(records, self._parser)), lost)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# serve: kills from now on; check: the kernel log ring from its start (recent kills). Off by
# default in a sidecar: /dev/kmsg is not in a container unless given, and needs CAP_SYSLOG.
register("oom", lambda c: OomCollector(c.cfg.kmsg, c.kmsg_from_start), modes=("node",))
