# mypy: allow-untyped-calls
"""OOM kills from the kernel's log: each report's victim, its cgroups (the one whose limit was
hit, the victim's), its RSS by kind, across report shapes and kernels; and the collector that
reads the log from its end (a restart must not count old kills again) or, for check, its
start. A regular file stands in for /dev/kmsg, one record per read. Part of the mutation
selection."""

import os
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from exporter.collectors.oom import (
    KmsgRecord,
    OomCollector,
    PendingReport,
    parse_kmsg_record,
    parse_oom_kills,
    unescape_kmsg,
)
from exporter.model.types import OomKill
from tests.helpers import DENIED_FILE

POD = "3c1f5a2e-8b7d-4e6f-9a01-23456789abcd"
KiB = 1024
RECORD = (
    8192  # /dev/kmsg hands one record per read(); the collector reads 8 KiB at a time
)


def oom_line(
    seq: int, pid: int, task_memcg: str, oom_memcg: str = "", comm: str = "python3"
) -> str:
    limit = f"oom_memcg={oom_memcg}" if oom_memcg else "global_oom"
    return (
        f"6,{seq},{seq * 1000},-;oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=a,b,"
        f"mems_allowed=0,{limit},task_memcg={task_memcg},task={comm},pid={pid},uid=1000"
    )


def killed_line(
    seq: int,
    pid: int,
    comm: str = "python3",
    rss: str = "anon-rss:8kB, file-rss:4kB, shmem-rss:2kB",
) -> str:
    return f"3,{seq},{seq * 1000},-;Memory cgroup out of memory: Killed process {pid} ({comm}) total-vm:9kB, {rss}, UID:1000"


def test_a_report_and_its_killed_line_make_one_kill() -> None:
    ctr = f"/kubepods/burstable/pod{POD}/ctr"
    [kill] = parse_oom_kills(
        [oom_line(10, 42, ctr, ctr.rsplit("/", 1)[0]), killed_line(11, 42)]
    )
    assert kill == OomKill(
        11,
        11000,
        42,
        "python3",
        ctr,
        f"/kubepods/burstable/pod{POD}",
        "CONSTRAINT_MEMCG",
        8 * KiB,
        4 * KiB,
        2 * KiB,
    )
    assert kill.pod_uid == POD


def test_a_system_wide_oom_names_no_limit_and_a_legacy_one_its_constraint() -> None:
    [system] = parse_oom_kills(
        [
            oom_line(1, 7, "/system.slice/x.service"),
            killed_line(2, 7).replace("Memory cgroup out of memory", "Out of memory"),
        ]
    )
    assert (system.oom_memcg, system.task_memcg) == ("", "/system.slice/x.service")
    legacy = [
        f"4,3,3000,-;Task in /kubepods/pod{POD}/c killed as a result of limit of /kubepods/pod{POD}",
        "3,4,4000,-;Memory cgroup out of memory: Kill process 9 (java) score 1000 or sacrifice child",
        "3,5,5000,-;Killed process 9 (java) total-vm:1kB, anon-rss:64kB, file-rss:0kB, shmem-rss:0kB",
    ]
    [kill] = parse_oom_kills(legacy)
    assert (kill.task_memcg, kill.oom_memcg, kill.constraint, kill.anon_rss_bytes) == (
        f"/kubepods/pod{POD}/c",
        f"/kubepods/pod{POD}",
        "",
        64 * KiB,
    )
    [alone] = parse_oom_kills(
        [killed_line(6, 11)]
    )  # its report lost: a memcg kill, cgroups unknown
    assert (alone.task_memcg, alone.oom_memcg, alone.constraint) == (
        "",
        "",
        "CONSTRAINT_MEMCG",
    )


def test_a_report_may_end_in_the_next_read_and_a_reaped_line_is_no_kill() -> None:
    pending: Dict[Optional[int], PendingReport] = {}
    assert parse_oom_kills([oom_line(1, 5, "/a", "/a")], pending) == []
    reaped = "6,2,2000,-;oom_reaper: reaped process 5 (python3), now anon-rss:0kB, file-rss:0kB, shmem-rss:0kB"
    assert parse_oom_kills([reaped, "not a record", "6,x,1,-;no"], pending) == []
    [kill] = parse_oom_kills(
        [killed_line(3, 5, "a (b) c", rss="anon-rss:1kB")], pending
    )
    assert (
        kill.task_memcg,
        kill.comm,
        kill.anon_rss_bytes,
        kill.file_rss_bytes,
        kill.shmem_rss_bytes,
    ) == (
        "/a",
        "a (b) c",
        KiB,
        None,
        None,
    )
    assert pending == {}


def test_reports_whose_killed_line_never_came_are_bounded() -> None:
    pending: Dict[Optional[int], PendingReport] = {}
    parse_oom_kills(
        [oom_line(i, 1000 + i, f"/pod/{i}", "/pod") for i in range(65)], pending
    )
    assert len(pending) == 65
    [kill] = parse_oom_kills(
        [oom_line(100, 5000, "/last", "/last"), killed_line(101, 1000)], pending
    )
    assert kill.task_memcg == ""  # its report was dropped with the others
    assert list(pending) == [5000]
    [kept] = parse_oom_kills([killed_line(102, 5000)], pending)
    assert kept.task_memcg == "/last"


def test_what_is_a_kmsg_record() -> None:
    assert parse_kmsg_record("6,12,345,-;hello\n SUBSYSTEM=net") == KmsgRecord(
        seq=12, usec=345, message="hello"
    )
    assert parse_kmsg_record("6,12,345;x") == KmsgRecord(seq=12, usec=345, message="x")
    assert parse_kmsg_record("no record") is None


def records(path: Path, lines: List[str]) -> None:
    """Appends each line as one record, padded to one read."""
    with open(path, "ab") as f:
        for line in lines:
            data = (line + "\n").encode()
            f.write(data + b" " * (RECORD - len(data)))


def test_serving_reads_kills_from_now_on(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    records(
        kmsg, [oom_line(1, 5, "/old", "/old"), killed_line(2, 5)]
    )  # before shmwatch started
    collector = OomCollector(str(kmsg))
    first = collector.collect()
    assert (first.new, first.lost) == ((), 0)
    records(
        kmsg,
        ["6,3,3000,-;eth0: link up", oom_line(4, 6, "/new", "/new"), killed_line(5, 6)],
    )
    got = collector.collect()
    assert [(k.seq, k.pid, k.task_memcg) for k in got.new] == [
        (5, 6, "/new")
    ] and got.lost == 0
    assert collector.collect().new == ()
    collector.close()
    collector.close()


def test_check_reads_the_log_from_its_start(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    records(
        kmsg,
        [oom_line(1, 5, "/old", "/old"), killed_line(2, 5), oom_line(3, 6, "/b", "/b")],
    )
    collector = OomCollector(str(kmsg), from_start=True)
    assert [k.pid for k in collector.collect().new] == [5]
    records(kmsg, [killed_line(4, 6)])  # the report begun in the last read
    assert [(k.pid, k.task_memcg) for k in collector.collect().new] == [(6, "/b")]
    collector.close()


def test_a_kernel_log_that_may_not_be_read_says_what_it_needs(tmp_path: Path) -> None:
    link = tmp_path / "kmsg"
    os.symlink(DENIED_FILE, link)
    with pytest.raises(PermissionError) as raised:
        OomCollector(str(link)).collect()
    assert str(raised.value) == (
        f"{link}: Permission denied (needs CAP_SYSLOG when kernel.dmesg_restrict=1, and the device in a container)"
    )
    with pytest.raises(FileNotFoundError):
        OomCollector(str(tmp_path / "none")).collect()


def test_a_collector_closed_opens_the_log_again_at_its_end(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    records(kmsg, [oom_line(1, 5, "/a", "/a")])
    collector = OomCollector(str(kmsg))
    collector.collect()
    collector.close()
    records(kmsg, [killed_line(2, 5)])
    assert (
        collector.collect().new == ()
    )  # reopened at the end: that record was before it
    collector.close()


def test_the_log_is_read_without_waiting_for_more(tmp_path: Path) -> None:
    """/dev/kmsg blocks a read until a record comes: the collector never waits for one (a FIFO,
    whose read blocks alike, holds a record at a time)."""
    fifo = tmp_path / "kmsg"
    os.mkfifo(fifo)
    keep = os.open(
        fifo, os.O_RDWR | os.O_NONBLOCK
    )  # a writer, so an open for reading returns
    try:
        collector = OomCollector(str(fifo), from_start=True)
        assert collector.collect().new == ()  # nothing yet: at once
        os.write(keep, (oom_line(1, 5, "/a", "/a") + "\n").encode())
        assert collector.collect().new == ()
        os.write(keep, (killed_line(2, 5) + "\n").encode())
        assert [k.pid for k in collector.collect().new] == [5]
        collector.close()
    finally:
        os.close(keep)


def test_a_record_that_is_not_utf8_is_read_with_replacements(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    with open(kmsg, "wb") as f:
        for line in (
            oom_line(1, 5, "/a", "/a", comm="x"),
            killed_line(2, 5, comm="py\udcff"),
        ):
            data = line.encode("utf-8", "surrogateescape") + b"\n"
            f.write(data + b" " * (RECORD - len(data)))
    [kill] = OomCollector(str(kmsg), from_start=True).collect().new
    assert kill.comm == "py\ufffd"


@pytest.mark.parametrize(
    "logged, meant",
    [
        ("plain", "plain"),
        (r"a\x5cb", "a\\b"),  # a backslash is escaped too
        (r"caf\xc3\xa9", "café"),  # UTF-8, byte by byte
        (r"\xC3\xA9", "é"),  # upper-case hex
        (r"tab\x09nl\x0a", "tab\tnl\n"),
        (r"bad\xff", "bad\udcff"),  # not UTF-8: kept as the os module keeps it
        (r"\x41\x42", "AB"),  # escapes side by side
        (r"x\x4", r"x\x4"),  # not an escape: two hex digits or none
        (r"x\xzz", r"x\xzz"),
        ("x\\y", "x\\y"),  # a lone backslash (the kernel never writes one) stays
    ],
)
def test_the_kernel_logs_escapes_are_made_bytes_again(logged: str, meant: str) -> None:
    assert unescape_kmsg(logged) == meant


def test_a_kill_names_its_process_and_cgroups_unescaped() -> None:
    ctr = f"/kubepods/pod{POD}/caf\\xc3\\xa9"
    [kill] = parse_oom_kills(
        [
            oom_line(1, 42, ctr, f"/kubepods/pod{POD}\\x5c", comm=r"a\x01b"),
            killed_line(2, 42, comm=r"a\x01b"),
        ]
    )
    assert (kill.comm, kill.task_memcg, kill.oom_memcg) == (
        "a\x01b",
        f"/kubepods/pod{POD}/café",
        f"/kubepods/pod{POD}\\",
    )


def test_a_legacy_reports_cgroups_are_unescaped() -> None:
    [kill] = parse_oom_kills(
        [
            r"6,1,1000,-;Task in /a\xc3\xa9 killed as a result of limit of /b\x5c",
            killed_line(2, 7),
        ]
    )
    assert (kill.task_memcg, kill.oom_memcg) == ("/aé", "/b\\")


def test_the_kill_log_is_complete_only_when_read_and_nothing_was_lost():
    """Runs are handed whether the kernel log counts every OOM kill (node mode's cgroups
    stretch only then): from the oom source's last run."""
    from exporter.model.types import Observation, OomReports
    from exporter.runtime.inputs import RunInputs

    inputs = RunInputs()
    assert not inputs.make({}).kill_log_complete  # never read
    inputs.on_observation(Observation("oom", OomReports((), 0), None, 0.0))
    assert inputs.make({}).kill_log_complete
    inputs.on_observation(Observation("oom", OomReports((), 3), None, 0.0))  # records overwritten
    assert not inputs.make({}).kill_log_complete
    inputs.on_observation(Observation("oom", OomReports((), 0), None, 0.0))
    inputs.on_observation(Observation("oom", None, "PermissionError: /dev/kmsg", 0.0))
    assert not inputs.make({}).kill_log_complete
