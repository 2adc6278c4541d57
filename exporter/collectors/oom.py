"""OOM kills from the kernel's reports (/dev/kmsg), as cAdvisor's utils/oomparser reads
them. Not the cgroup counters alone: v1 counts a kill only in the victim's memcg, gone
with its container; the kernel log names both cgroups of each kill (the one whose limit
was hit, the victim's) and outlives them. Serving starts at the ring's end (a restart
must not count its kills twice), check at its start."""

import errno
import os
import re
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional

from exporter.collectors.source import Context, RunInput, Source, register
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
MAX_PENDING = (
    64  # reports begun and kept for their "Killed process" line (it may be lost)
)
READ_BYTES = 8192  # one read: one record (~1 KiB + dict)
# /dev/kmsg writes a byte below ' ', above '~' and '\\' itself as \xNN (printk's devkmsg):
# a comm or cgroup is read back as its bytes, so it matches cgroupfs and is shown once.
_KMSG_ESCAPE = re.compile(r"\\x([0-9a-fA-F]{2})")


@dataclass(frozen=True)
class KmsgRecord:
    seq: int  # the kernel log's sequence number
    usec: int  # microseconds after boot (CLOCK_MONOTONIC)
    message: str  # its first line


@dataclass(frozen=True)
class PendingReport:
    """An OOM report's cgroups, kept until its "Killed process" line."""

    task_memcg: str  # the victim's cgroup
    oom_memcg: str  # the cgroup whose limit was hit ('' for a system-wide OOM)
    constraint: str  # CONSTRAINT_MEMCG, CONSTRAINT_NONE (system), ...


NO_REPORT = PendingReport(task_memcg="", oom_memcg="", constraint="")
# By the victim's pid; None: a pre-4.19 report, which names no pid.
Pending = Dict[Optional[int], PendingReport]


def unescape_kmsg(text: str) -> str:
    """A field of a /dev/kmsg message as the kernel had it: its \\xNN escapes made bytes
    again, decoded as the os module decodes names (undecodable bytes kept as surrogates)."""
    if "\\x" not in text:
        return text
    parts = _KMSG_ESCAPE.split(text)  # text, hex, text, hex, ..., text
    data = bytearray()
    for index, part in enumerate(parts):
        if index % 2:
            data.append(int(part, 16))
        else:
            data += part.encode("utf-8", "surrogateescape")
    return data.decode("utf-8", "surrogateescape")


def parse_kmsg_record(record: str) -> Optional[KmsgRecord]:
    """A record's sequence number, time and message's first line; None: not a record."""
    match = _RECORD.match(record)
    if match is None:
        return None
    return KmsgRecord(seq=int(match[1]), usec=int(match[2]), message=match[3])


def parse_oom_kills(
    records: Iterable[str], pending: Optional[Pending] = None
) -> List[OomKill]:
    """Every OOM report these /dev/kmsg records complete. `pending` (kept across calls): the
    reports begun, until their "Killed process" line, bounded (that line may be lost to an
    overrun)."""
    pending = {} if pending is None else pending
    kills = []
    for record in filter(None, map(parse_kmsg_record, records)):
        if not _begins_a_report(record.message, pending):
            kill = _killed(record, pending)
            if kill is not None:
                kills.append(kill)
    return kills


def _begins_a_report(message: str, pending: Pending) -> bool:
    """An oom-kill line (or a pre-4.19 "Task in ..."): its cgroups kept in `pending`."""
    if match := _OOM_KILL.search(message):
        if len(pending) > MAX_PENDING:
            pending.clear()
        pending[int(match["pid"])] = PendingReport(
            task_memcg=unescape_kmsg(match["task_memcg"]),
            oom_memcg=unescape_kmsg(match["oom_memcg"] or ""),
            constraint=match["constraint"],
        )
        return True
    if match := _LEGACY.search(message):
        pending[None] = PendingReport(
            task_memcg=unescape_kmsg(match["task_memcg"]),
            oom_memcg=unescape_kmsg(match["oom_memcg"]),
            constraint="",
        )
        return True
    return False


def _killed(record: KmsgRecord, pending: Pending) -> Optional[OomKill]:
    """The kill a "Killed process" line completes (the oom_reaper's line is not one)."""
    message = record.message
    match = _KILLED.search(message)
    if match is None or "reaped process" in message:
        return None
    pid = int(match["pid"])
    legacy = pending.pop(None, NO_REPORT)  # a pre-4.19 report has no pid
    report = pending.pop(pid, None) or legacy
    constraint = report.constraint
    if not constraint and message.startswith("Memory cgroup"):
        constraint = "CONSTRAINT_MEMCG"
    rss = {kind: int(kb) * 1024 for kind, kb in _RSS.findall(match["rest"])}
    return OomKill(
        seq=record.seq,
        boot_usec=record.usec,
        pid=pid,
        comm=unescape_kmsg(match["comm"]),
        task_memcg=report.task_memcg,
        oom_memcg=report.oom_memcg,
        constraint=constraint,
        anon_rss_bytes=rss.get("anon"),
        file_rss_bytes=rss.get("file"),
        shmem_rss_bytes=rss.get("shmem"),
    )


class OomCollector(Source):
    name = "oom"

    def __init__(self, kmsg_path: str = "/dev/kmsg", from_start: bool = False):
        self.kmsg_path = kmsg_path
        self.from_start = from_start
        self._fd: Optional[int] = None
        self._pending: Pending = {}  # reports begun, not yet complete

    def collect(self, run: RunInput = RunInput()) -> OomReports:
        fd = self._open() if self._fd is None else self._fd
        records, lost = [], 0
        while True:
            try:
                raw = os.read(fd, READ_BYTES)
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
        kills = tuple(parse_oom_kills(records, self._pending))
        return OomReports(new=kills, lost=lost)

    def _open(self) -> int:
        """The kernel log, at its end (serving: a restart must not count its kills twice)
        or its start (check)."""
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
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _oom_collector(c: Context) -> OomCollector:
    return OomCollector(c.cfg.kmsg, c.kmsg_from_start)


# Off by default in a sidecar: /dev/kmsg is not in a container unless given, and needs CAP_SYSLOG.
register("oom", _oom_collector, modes=("node",))
