"""The segment inventory under a storm and short of resources: what a run keeps between runs
stays bounded (the names called leaked), and a /proc read that fails for want of fds or
memory fails the scan instead of calling anything leaked. Part of the mutation selection."""

import errno
import os
import sys
from pathlib import Path
from typing import Any, List

import pytest

from exporter.host.proctable import ProcessTable
from tests.unit.collectors.test_segments import MNT_ID, Host, states


@pytest.fixture
def host(tmp_path: Path) -> Host:
    return Host(tmp_path, ["shm"])


def test_the_names_called_leaked_are_kept_in_one_set_brought_up_to_date(host: Host) -> None:
    """What the next runs compare changes with (a write to a leaked file doubts it): each run
    updates the last run's set in place (a storm's 100,000 names made a new 4 MiB table per
    run, beside the last): held since, deleted since or no longer leaked, a name leaves it;
    when far fewer are left, the set is made anew (a set keeps its table when emptied)."""
    names = [f"psm_{i:04d}" for i in range(2000)]
    for name in names:
        host.file(0, name, 0)
    runs = host.collector()
    [shm] = host.mounts
    runs.collect()
    kept = runs.source._orphans[shm]
    assert kept == set(names)
    host.holder(100, host.maps(0, "psm_0000"))  # held now
    os.unlink(os.path.join(shm, "psm_0001"))  # gone
    host.file(0, "psm_new", 0)
    inv = runs.collect()
    assert runs.source._orphans[shm] is kept and kept == set(names[2:]) | {"psm_new"}
    assert {n for n, (_, state, _) in states(inv, shm).items() if state == "orphan"} == kept
    for name in names[2:1500]:
        os.unlink(os.path.join(shm, name))
    runs.collect()  # 501 of 1,999 left: kept, taken out of the same set
    assert runs.source._orphans[shm] is kept and len(kept) == 501
    host.holder(101, comm="ghost")
    host.proc.deny(101, "maps")  # nothing provable now: none leaked
    runs.collect()
    assert runs.source._orphans[shm] == set()
    assert sys.getsizeof(runs.source._orphans[shm]) == sys.getsizeof(set())


@pytest.mark.parametrize("read", ["maps", "fds"])
def test_a_proc_read_out_of_fds_fails_the_scan_and_calls_nothing_leaked(
    host: Host, monkeypatch: pytest.MonkeyPatch, read: str
) -> None:
    """EMFILE (or ENOMEM) reading a holder's maps or fds says nothing of it: taken for gone,
    as it was, the segment it holds was called leaked. The scan fails instead (the run's
    error), as a scan that could not run."""
    host.file(0, "psm_held")
    host.holder(100, host.maps(0, "psm_held"))
    table = ProcessTable(host.proc.paths)
    out_of_fds = OSError(errno.EMFILE, "Too many open files")
    if read == "maps":
        real_maps = table.maps

        def maps(pid: int) -> str:
            if pid == 100:
                raise out_of_fds
            return real_maps(pid)

        monkeypatch.setattr(table, "maps", maps)
    else:
        real_listdir = os.listdir

        def listdir(path: Any = ".") -> List[str]:
            if str(path).endswith("/100/fd"):
                raise out_of_fds
            return real_listdir(path)

        monkeypatch.setattr(os, "listdir", listdir)
    runs = host.collector(table)
    with pytest.raises(OSError, match="Too many open files"):
        runs.collect()


@pytest.mark.parametrize("entry", ["mountinfo", "fdinfo"])
def test_out_of_fds_reading_a_holders_mountinfo_or_fdinfo_fails_the_scan(
    host: Host, monkeypatch: pytest.MonkeyPatch, entry: str
) -> None:
    """A segment held by an fd only: EMFILE on its holder's mountinfo or on the fd's fdinfo
    was taken for gone (no fds to read, or the fd closed since), and the segment was called
    leaked. The scan fails instead."""
    host.file(0, "psm_fd")
    host.holder(100, fds={5: os.path.join(host.mounts[0], "psm_fd")}, mnt_ids={5: MNT_ID})
    assert states(host.collector().collect(), host.mounts[0])["psm_fd"][1] == "linked"
    import exporter.inventory.maps as maps_module

    real_open, real_read = os.open, maps_module.read_text

    def open_(path: Any, *args: Any, **kwargs: Any) -> int:
        if entry == "fdinfo" and "/100/fdinfo/" in str(path):
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(path, *args, **kwargs)

    def read_text(path: str) -> str:
        if entry == "mountinfo" and path.endswith("/100/mountinfo"):
            raise OSError(errno.EMFILE, "Too many open files")
        return real_read(path)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(maps_module, "read_text", read_text)
    with pytest.raises(OSError, match="Too many open files"):
        host.collector().collect()


def test_a_leak_written_after_a_failed_full_run_is_doubted_as_ever(host: Host) -> None:
    """A full run whose scan never ran (no thread) takes the mount's last inventory away;
    a write to a file called leaked was then not doubted, and the next quick run called it
    leaked still. It is unverified until a full scan reads who wrote it."""
    host.file(0, "psm_x")
    runs = host.collector()
    [shm] = host.mounts
    assert states(runs.collect(), shm)["psm_x"][1] == "orphan"
    runs.source.begin_full(runs.input(take=False)).abandon()
    host.changes.add(shm, "psm_x")  # written, or mapped: someone holds it, perhaps
    assert states(runs.collect_quick(), shm)["psm_x"][1] == "unverified"
