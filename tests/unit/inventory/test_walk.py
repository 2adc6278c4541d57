"""inventory/walk.py: what a listing keeps once a walk finds most of its files gone."""

import errno
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Tuple

import pytest

from exporter.inventory.holdings import unheld_state
from exporter.inventory.walk import Listing, _update, walk
from exporter.model.classes import CLASS_NAMES
from tests.conftest import REPO, mounted_tmpfs, needs_root
from tests.helpers import DEV, INO, KEY, KNOWN, KNOWN_ROW, make_files, pack, unpack


def test_a_walk_that_drops_most_rows_leaves_no_storm_table_to_the_inventories_before(
    tmp_path: Path,
) -> None:
    """The listing gets a table its size, and the one before is emptied at once: the
    inventories of earlier runs share it (MountInventory.listed), and one is held a while
    (the scheduler's last full run until the next, the model's until a scrape), past the
    memory's give-back, with the storm's table."""
    root, names = str(tmp_path), [f"psm_{i:05d}" for i in range(20_000)]
    make_files(root, names)
    dev, listing = os.stat(root).st_dev, Listing()
    walk(root, dev, listing, 100_000)
    shared = listing.rows  # as that run's inventory holds it
    storm = sys.getsizeof(shared)
    for name in names[10:]:
        os.unlink(os.path.join(root, name))
    walk(root, dev, listing, 100_000)
    assert sorted(listing.rows) == names[:10]
    assert sys.getsizeof(listing.rows) * 100 < storm
    assert not shared and sys.getsizeof(shared) * 100 < storm


@needs_root
def test_a_file_of_two_names_is_listed_under_the_smaller_whatever_the_directory_order(
    tmpfs: str,
) -> None:
    """A hard-linked file is listed once, under the smaller of its names: its class (and so
    `check`'s rm advice) does not depend on the order the directory is read in. (It was the
    first name the walk met: tmpfs lists the newest entry first, so the link made last.)"""
    from exporter.model.types import Row

    for order in (("psm_data", "zz_link"), ("zz_link", "psm_data")):
        root = Path(tmpfs) / order[0]
        root.mkdir()
        first, second = (str(root / name) for name in order)
        with open(first, "wb") as f:
            f.write(b"x" * 4096)
        os.link(first, second)
        listing = Listing()
        walk(str(root), os.stat(root).st_dev, listing, 100)
        assert list(listing.rows) == ["psm_data"], order
        assert Row.class_name(listing.rows["psm_data"]) == "python_shm"
        assert Row.inode(listing.rows["psm_data"]) == os.stat(first).st_ino


def test_a_patch_lists_a_file_of_two_names_under_the_smaller(tmp_path: Path) -> None:
    """inotify names a link made to a listed file: the smaller name takes its row (a rename's
    events), a greater one is not listed."""
    from exporter.inventory.walk import patch_listing

    root = str(tmp_path)
    dev = os.stat(root).st_dev
    with open(os.path.join(root, "zz_first"), "wb") as f:
        f.write(b"x" * 4096)
    listing = Listing()
    walk(root, dev, listing, 100)
    os.link(os.path.join(root, "zz_first"), os.path.join(root, "zz_later"))
    assert patch_listing(root, dev, listing, ["zz_later"]) == {}
    assert list(listing.rows) == ["zz_first"]
    os.link(os.path.join(root, "zz_first"), os.path.join(root, "psm_named"))
    events = patch_listing(root, dev, listing, ["psm_named"])
    assert list(listing.rows) == ["psm_named"]
    assert events == {("other", "deleted"): 1, ("python_shm", "created"): 1}
    walk(root, dev, listing, 100)  # and a walk agrees
    assert list(listing.rows) == ["psm_named"]


class _GoneAtLstat:
    """A directory entry whose file is deleted, and made again under its name, between
    readdir and its lstat (`recreate`): the lstat fails, as on the old inode."""

    def __init__(self, entry: "os.DirEntry[str]", recreate: Callable[[], None]) -> None:
        self.entry, self.recreate, self.name = entry, recreate, entry.name

    def stat(self, follow_symlinks: bool = True) -> os.stat_result:
        self.recreate()
        raise FileNotFoundError(2, "deleted between readdir and lstat")

    def is_file(self, follow_symlinks: bool = True) -> bool:
        return self.entry.is_file(follow_symlinks=follow_symlinks)


class _Entries:
    """A directory's scandir, the entries named in `hooks` (once each) as _GoneAtLstat."""

    def __init__(self, entries: Any, hooks: Dict[str, Callable[[], None]]) -> None:
        self.entries, self.hooks = entries, hooks

    def __enter__(self) -> "_Entries":
        self.entries.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.entries.__exit__(*exc)

    def __iter__(self) -> Iterator[Any]:
        for entry in self.entries:
            hook = self.hooks.pop(entry.name, None)
            yield entry if hook is None else _GoneAtLstat(entry, hook)


def test_a_file_made_again_under_its_name_during_a_walk_keeps_no_row_of_the_old_inode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The walk skips a name whose lstat fails, then reads the directory again to drop the
    rows it did not meet: the name is there again, on a new file. The old inode's row must
    not stay: the new file's holders would be looked up under the old inode, and the next
    settled full scan would call a live file orphan (rm advice)."""
    from exporter.inventory import walk as walk_module
    from exporter.model.types import Row

    root = str(tmp_path)
    path = os.path.join(root, "psm_x")
    make_files(root, ["psm_x", "psm_y"])
    dev, listing = os.stat(root).st_dev, Listing()
    walk(root, dev, listing, 100)
    old = os.open(path, os.O_RDONLY)  # kept open: tmpfs does not reuse its inode

    def recreate() -> None:  # the writer: unlink, and create anew
        os.unlink(path)
        make_files(root, ["psm_x"])

    hooks = {"psm_x": recreate}
    real_open_below = walk_module._open_below

    def open_below(root: str, names: Tuple[str, ...], dev: int) -> Any:
        opened = real_open_below(root, names, dev)
        return None if opened is None else (opened[0], _Entries(opened[1], hooks))

    monkeypatch.setattr(walk_module, "_open_below", open_below)
    try:
        events = walk(root, dev, listing, 100)
    finally:
        os.close(old)
    assert hooks == {}  # the lstat failed, after the file was made again
    live = os.stat(path).st_ino
    assert "psm_x" not in listing.rows or Row.inode(listing.rows["psm_x"]) == live
    assert events[("python_shm", "deleted")] == 1
    monkeypatch.undo()
    walk(root, dev, listing, 100)  # and the next walk lists the new file
    assert Row.inode(listing.rows["psm_x"]) == live


def test_a_walk_keeps_one_name_of_a_hard_linked_file_not_every_name(
    tmp_path: Path,
) -> None:
    """A file of 10,000 names: the walk keeps the smallest met yet, and is done with each
    other name as it meets it (its row goes at once). (Every name kept until the walk
    ended: ~200 bytes each, 50 MiB for a hostile mount's 250,000.) The peak is traced in a
    Python of its own: this one's threads (conftest's /proc watch) allocate meanwhile."""
    root, links = str(tmp_path), 10_000
    first = os.path.join(root, "zz_first")
    make_files(root, ["zz_first"])
    dev, listing = os.stat(root).st_dev, Listing()
    walk(root, dev, listing, 100)
    for i in range(links):  # then linked (a polled mount: no patch)
        os.link(first, os.path.join(root, f"psm_{i:05d}"))
    events = walk(root, dev, listing, 100)
    assert list(listing.rows) == ["psm_00000"]
    assert events == {("other", "deleted"): 1, ("python_shm", "created"): 1}
    printed = in_own_python(WALK_PEAK, root)
    peak = int(printed)
    assert peak < links * 8, f"{peak} bytes traced: a name kept past its entry"


@pytest.mark.parametrize("present_names_max", [0, 4096])
def test_rows_gone_are_the_same_by_the_names_present_or_by_lookup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, present_names_max: int
) -> None:
    """Rows the walk did not meet again: gone when their file is, when their name is now a
    directory, or when their directory is now a symlink (never followed); kept otherwise.
    By the set of names present (a few) or, past PRESENT_NAMES_MAX, name by name."""
    from exporter.inventory import walk as walk_module

    monkeypatch.setattr(walk_module, "PRESENT_NAMES_MAX", present_names_max)
    root = str(tmp_path)
    for directory in ("d", "e"):
        os.mkdir(os.path.join(root, directory))
    make_files(root, ["psm_a", "psm_b", "d/psm_c", "e/psm_f"])
    dev, listing = os.stat(root).st_dev, Listing()
    walk(root, dev, listing, 100)
    assert sorted(listing.rows) == ["d/psm_c", "e/psm_f", "psm_a", "psm_b"]
    os.unlink(os.path.join(root, "psm_a"))
    os.unlink(os.path.join(root, "psm_b"))
    os.mkdir(os.path.join(root, "psm_b"))
    os.rename(os.path.join(root, "d"), os.path.join(root, "d2"))
    os.symlink("d2", os.path.join(root, "d"))
    events = walk(root, dev, listing, 100)
    assert sorted(listing.rows) == ["d2/psm_c", "e/psm_f"]
    assert events == {("python_shm", "deleted"): 3, ("python_shm", "created"): 1}


def test_a_walk_that_finds_rows_gone_makes_no_string_per_file_present(tmp_path: Path) -> None:
    """Past PRESENT_NAMES_MAX names present, rows the walk did not meet again are looked up
    by name, each in its directory: a set of every name present was, in a deletion storm
    under way, the 100,000 names still there (~12 MiB beside the rows). Traced in a Python
    of its own."""
    root, files = str(tmp_path), 30_000
    make_files(root, [f"psm_{i:05d}" for i in range(files)])
    os.mkdir(os.path.join(root, "d"))
    make_files(os.path.join(root, "d"), ["psm_below"])
    printed = in_own_python(GONE_PEAK, root)
    rows, peak = printed.split()
    assert int(rows) == files - 1  # d/psm_below gone with d, and one file deleted
    # The set given up past PRESENT_NAMES_MAX names (~0.5 MiB); every name: ~3.8 MiB.
    assert int(peak) < 1 << 20, f"{peak} bytes traced: a string per name present"


GONE_PEAK = """
import os, shutil, sys, tracemalloc
from exporter.inventory import walk as w
root = sys.argv[1]
dev, listing = os.stat(root).st_dev, w.Listing()
w.walk(root, dev, listing, 100_000)
met = w._RowPass._file
def vanish(self, path, st):  # as the walk begins: d and one file deleted
    if os.path.exists(os.path.join(root, "d")):
        shutil.rmtree(os.path.join(root, "d"))
        os.unlink(os.path.join(root, "psm_00007"))
    return met(self, path, st)
w._RowPass._file = vanish
tracemalloc.start()
w.walk(root, dev, listing, 100_000)
print(len(listing.rows), tracemalloc.get_traced_memory()[1])
"""


def test_rows_looked_up_under_a_low_fd_limit_are_never_taken_for_gone(tmp_path: Path) -> None:
    """300 directories of a file each, one file deleted, the lookup forced (PRESENT_NAMES_MAX
    0) under RLIMIT_NOFILE 8 above the fds open: one directory open at a time. (An fd held
    per directory ran out at the limit, and every row past it was counted deleted.) In a
    Python of its own."""
    root = str(tmp_path)
    for i in range(300):
        os.mkdir(os.path.join(root, f"d{i:03d}"))
        make_files(os.path.join(root, f"d{i:03d}"), ["psm_x"])
    printed = in_own_python(FEW_FDS, root)
    assert printed.split() == ["299", "1"]


FEW_FDS = """
import os, resource, sys
from exporter.inventory import walk as w
root = sys.argv[1]
w.PRESENT_NAMES_MAX = 0
dev, listing = os.stat(root).st_dev, w.Listing()
w.walk(root, dev, listing, 100_000)
os.unlink(os.path.join(root, "d007", "psm_x"))
highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 9, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
events = w.walk(root, dev, listing, 100_000)
print(len(listing.rows), events.get(("python_shm", "deleted"), 0))
"""


def test_a_lookup_that_cannot_be_made_keeps_the_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory that cannot be opened for want of fds (EMFILE) or memory keeps its rows as
    listed; one not there (ENOENT), not a directory, or a symlink now (ELOOP) is gone with
    them."""
    from exporter.inventory import walk as walk_module

    root = str(tmp_path)
    for directory in ("full", "gone"):
        os.mkdir(os.path.join(root, directory))
        make_files(os.path.join(root, directory), ["psm_x"])
    dev, listing = os.stat(root).st_dev, Listing()
    walk(root, dev, listing, 100)
    real = walk_module._open_fd_or_raise

    def opened(at: str, names: Tuple[str, ...], on: int) -> int:
        if names == ("full",):
            raise OSError(errno.EMFILE, "Too many open files")
        return real(at, names, on)

    monkeypatch.setattr(walk_module, "_open_fd_or_raise", opened)
    os.rename(os.path.join(root, "gone"), os.path.join(root, "elsewhere"))
    assert walk_module._gone_by_lookup(root, dev, listing.rows) == ["gone/psm_x"]
    os.symlink("elsewhere", os.path.join(root, "gone"))
    assert walk_module._gone_by_lookup(root, dev, listing.rows) == ["gone/psm_x"]
    real_stat = os.stat

    def stat(name: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if name == "psm_x" and kwargs.get("dir_fd") is not None:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        return real_stat(name, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)  # a name that cannot be looked up: kept
    os.unlink(os.path.join(root, "gone"))
    os.rename(os.path.join(root, "elsewhere"), os.path.join(root, "gone"))
    assert walk_module._gone_by_lookup(root, dev, listing.rows) == []


@needs_root
def test_a_row_whose_name_another_mount_covers_now_is_gone_by_lookup(tmp_path: Path) -> None:
    """A file bind-mounted over a listed name is not this mount's file (the walk does not
    list it either): the lookup calls its row gone. (The names present go by readdir's type,
    the covered file's: a walk that met the name has dropped its row already.)"""
    from exporter.inventory import walk as walk_module

    with mounted_tmpfs("1m") as root:
        make_files(root, ["psm_a", "psm_b"])
        outside = tmp_path / "outside"
        outside.write_bytes(b"x")
        dev, listing = os.stat(root).st_dev, Listing()
        walk(root, dev, listing, 100)
        subprocess.run(["mount", "--bind", str(outside), os.path.join(root, "psm_b")], check=True)
        try:
            assert walk_module._gone_by_lookup(root, dev, listing.rows) == ["psm_b"]
        finally:
            subprocess.run(["umount", os.path.join(root, "psm_b")], check=True)


def in_own_python(script: str, *args: str) -> str:
    """What `script` prints, run in a Python of its own with this checkout's `exporter`: a
    traced peak or an fd limit there measures the walk alone (this one's threads, conftest's
    /proc watch, allocate and hold fds meanwhile)."""
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
        capture_output=True,
        text=True,
        check=True,
    ).stdout


WALK_PEAK = """
import os, sys, tracemalloc
from exporter.inventory.walk import Listing, walk
root = sys.argv[1]
dev, listing = os.stat(root).st_dev, Listing()
tracemalloc.start()
walk(root, dev, listing, 100)
print(tracemalloc.get_traced_memory()[1])
"""


def test_a_known_flag_from_another_device_is_not_known():
    """The mount's device changed since the last full scan (a pod deleted, its path mounted
    again: tmpfs numbers inodes from 1, so the same inode is another file): the row's known
    flag is not the full scan's word. A quick run takes the file as its creator's, a refresh
    leaves it unverified; on the same device it is an orphan."""
    for quick, other_device in ((True, "linked"), (False, "unverified")):
        assert unheld_state("a", KNOWN_ROW, KEY, DEV, (), set(), True, quick, False) == "orphan"
        assert unheld_state("a", KNOWN_ROW, KEY, DEV + 1, (), set(), True, quick, False) == other_device
        assert unheld_state("a", KNOWN_ROW, KEY, None, (), set(), True, quick, False) == other_device
    new_row = pack(0, 0, INO, 0, 8, 4096)
    assert unheld_state("a", new_row, KEY, DEV, (), set(), True, True, False) == "linked"
    # A full scan this run listed it before reading /proc: known whatever the flag says.
    assert unheld_state("a", new_row, KEY, DEV + 1, (), set(), True, False, True) == "orphan"
    assert unheld_state("a", new_row, KEY, DEV + 1, (), set(), False, False, True) == "unverified"


def test_a_row_keeps_its_class_and_known_flag_while_it_is_the_same_inode(tmp_path):
    """The same inode again: its class (as first classified) and known flag kept, no event.
    Another inode under the name: classified afresh, not known, and counted deleted and
    created."""
    path = tmp_path / "nccl-shm-1"
    path.write_bytes(b"y" * 100)
    st = os.lstat(path)
    listing = Listing()
    old = pack(CLASS_NAMES.index("torch"), KNOWN, st.st_ino, 0, 0, 0)
    listing.rows["nccl-shm-1"] = old
    events = Counter()
    _update(listing, "nccl-shm-1", st, events)
    row = listing.rows["nccl-shm-1"]
    assert events == {}
    assert row & KNOWN and CLASS_NAMES[row & 31] == "torch"
    assert unpack(row)[1:] == (st.st_ino, int(st.st_mtime), st.st_blocks * 512, 100)
    listing.rows["nccl-shm-1"] = pack(CLASS_NAMES.index("ucx"), 0, st.st_ino, 12345, 77, 999)
    _update(listing, "nccl-shm-1", st, events)  # not known stays not known; fields from lstat
    assert listing.rows["nccl-shm-1"] == pack(CLASS_NAMES.index("ucx"), 0, st.st_ino, st.st_mtime, st.st_blocks, 100)
    listing.rows["nccl-shm-1"] = pack(CLASS_NAMES.index("torch"), KNOWN, st.st_ino + 1, 0, 0, 0)
    _update(listing, "nccl-shm-1", st, events)
    row = listing.rows["nccl-shm-1"]
    assert events == {("torch", "deleted"): 1, ("nccl", "created"): 1}
    assert not row & KNOWN and CLASS_NAMES[row & 31] == "nccl"
    _update(listing, "vader_segment.host.0.1", st, events)  # mpi: class 0, no stray bit
    assert listing.rows["vader_segment.host.0.1"] == pack(CLASS_NAMES.index("mpi"), 0, st.st_ino, st.st_mtime, st.st_blocks, 100)
