"""The segment inventory under a storm and short of resources: what a run keeps between runs
stays bounded (the names called leaked are the last inventory's), and a /proc read that
fails for want of fds or memory fails the scan instead of calling anything leaked. Part of
the mutation selection."""

import errno
import os
from pathlib import Path
from typing import Any, List

import pytest

from exporter.collectors.segments import MountsSeen, SegmentRun
from exporter.host.proctable import ProcessTable
from tests.unit.collectors.test_segments import MNT_ID, Host, states


@pytest.fixture
def host(tmp_path: Path) -> Host:
    return Host(tmp_path, ["shm"])


def test_the_names_called_leaked_are_the_last_inventorys_and_no_set_beside_it(host: Host) -> None:
    """What the next runs compare changes with (a write to a leaked file doubts it) is read
    from the last inventory's states: a set of a storm's 100,000 names beside it cost a 4 MiB
    table. Held since, deleted since or no longer provable, a name is called leaked no more;
    a failed full run's mounts keep what they called leaked until assembled again."""
    names = [f"psm_{i:04d}" for i in range(2000)]
    for name in names:
        host.file(0, name, 0)
    runs = host.collector()
    [shm] = host.mounts
    runs.collect()
    assert sorted(runs.source._called_leaked(shm)) == names
    assert not any(isinstance(v, (set, dict)) and len(v) >= 2000 for v in vars(runs.source).values())
    host.holder(100, host.maps(0, "psm_0000"))  # held now
    os.unlink(os.path.join(shm, "psm_0001"))  # gone
    host.file(0, "psm_new", 0)
    inv = runs.collect()
    leaked = {n for n, (_, state, _) in states(inv, shm).items() if state == "orphan"}
    assert leaked == set(names[2:]) | {"psm_new"} and set(runs.source._called_leaked(shm)) == leaked
    runs.source._abandon(SegmentRun(full=True, mounts=(shm,), devs={shm: 1}, errors={}, seen=MountsSeen({}, {})))
    assert set(runs.source._called_leaked(shm)) == leaked  # a failed full run's: as they were
    host.holder(101, comm="ghost")
    host.proc.deny(101, "maps")  # nothing provable now: none leaked
    runs.collect()
    assert runs.source._called_leaked(shm) == [] and not runs.source._abandoned


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
