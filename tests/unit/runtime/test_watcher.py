# mypy: allow-untyped-calls
"""The watcher's event handling with a fake inotify reader at the library boundary (watchdog's
InotifyFD: add_callback, remove_callbacks, a reading thread): which mounts are watched and
which polled (shmwatch_inotify_active), what each event counts and asks to be listed again,
an overflow answered with a full run, a dropped watch or a dead reader watched anew, bind
mounts sharing one watch, and polled mounts' events counted from the inventory, once. Real
directories; part of the mutation selection."""

import logging
import os
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import pytest

from exporter.host.paths import Paths
from exporter.inventory.changes import ChangeLog
from exporter.model.state import StateStore
from exporter.model.types import (
    Inventory,
    MountInventory,
    MountSet,
    Observation,
    Target,
)
from exporter.runtime.watcher import (
    CALLBACK_ID,
    IN_ATTRIB,
    IN_CREATE,
    IN_DELETE,
    IN_ISDIR,
    IN_MODIFY,
    IN_MOVED_FROM,
    IN_MOVED_TO,
    WATCH_MASK,
    MountWatcher,
)


class FakeInotify:
    """One inotify instance: a watch per inode (two paths to one directory: one watch)."""

    def __init__(
        self, refuse: Optional[Dict[str, Union[Exception, int]]] = None
    ) -> None:
        # path -> an exception to raise, or -1 (InotifyFD's EACCES)
        self.refuse: Dict[str, Union[Exception, int]] = refuse or {}
        self.alive = self.stopped = False
        self.wds: Dict[int, int] = {}  # inode -> wd
        self.added: List[Tuple[str, int, int]] = []
        self.removed: List[Tuple[int, int]] = []

    def start(self) -> None:
        self.alive = True

    def is_alive(self) -> bool:
        return self.alive

    def add_callback(
        self, path: bytes, mask: int, handler: object, callback_id: int
    ) -> int:
        refused = self.refuse.get(os.fsdecode(path))
        if isinstance(refused, Exception):
            raise refused
        wd = (
            refused
            if refused is not None
            else self.wds.setdefault(os.stat(path).st_ino, len(self.wds) + 1)
        )
        self.added.append((os.fsdecode(path), mask, callback_id))
        return wd

    def remove_callbacks(self, pairs: List[Tuple[int, int]]) -> None:
        self.removed.extend(pairs)

    def stop(self) -> None:
        self.alive, self.stopped = False, True

    def join(self, timeout: Optional[float] = None) -> None:
        pass


class Wakes(List[bool]):
    def __call__(self, full: bool = False) -> None:
        self.append(full)


class Outlet:
    """The scheduler as the watcher sees it (runtime/scheduler.py's Sampler): each name
    changed goes to the event-driven sources' change log and wakes them; lost events mark
    the mounts to list again and ask for a full run."""

    def __init__(self, changes: ChangeLog, wake: Callable[[bool], None]) -> None:
        self.changes, self.wake = changes, wake
        self.every_mount_watched: List[bool] = []

    def changed(self, mount: str, name: Optional[str]) -> None:
        if name is None:
            self.changes.unknown(mount)
        else:
            self.changes.add(mount, name)
        self.wake(False)

    def lost(self, mounts: Sequence[str]) -> None:
        for mount in mounts:
            self.changes.unknown(mount)
        self.wake(True)

    def watching(self, every_mount: bool) -> None:
        self.every_mount_watched.append(every_mount)


class Rig:
    def __init__(
        self,
        tmp_path: Path,
        names: Sequence[str] = ("a", "b"),
        readers: Optional[List[Union[FakeInotify, Exception]]] = None,
        changes: Optional[ChangeLog] = None,
        **options: Any,
    ) -> None:
        self.mounts = []
        for name in names:
            (tmp_path / name).mkdir(exist_ok=True)
            self.mounts.append(str(tmp_path / name))
        self.state, self.changes, self.wakes = (
            StateStore(),
            changes or ChangeLog(),
            Wakes(),
        )
        self.readers = readers if readers is not None else [FakeInotify()]
        self.made = 0
        self.listed = list(self.mounts)
        self.outlet = Outlet(self.changes, self.wakes)
        self.watcher = MountWatcher(
            self.state,
            Paths(),
            self.outlet,
            inotify_factory=self.factory,
            **options,
        )

    def start(self) -> None:
        """As App starts it: watched from now on, then discovery's first set published."""
        self.watcher.start()
        self.watcher.on_mounts(MountSet([Target(m) for m in self.listed]))

    def factory(self) -> FakeInotify:
        reader = self.readers[min(self.made, len(self.readers) - 1)]
        self.made += 1
        if isinstance(reader, Exception):
            raise reader
        return reader

    def reader(self, index: int) -> FakeInotify:
        made = self.readers[index]
        assert isinstance(made, FakeInotify)
        return made

    def inotify(self) -> Dict[str, bool]:
        return self.state.snapshot().inotify

    def event(self, name: bytes, mask: int, wd: int = 1) -> None:
        self.watcher.on_event(SimpleNamespace(name=name, mask=mask, wd=wd))


def test_every_mount_is_watched_with_one_reader(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="exporter.runtime.watcher")
    rig = Rig(tmp_path)
    rig.start()
    reader = rig.reader(0)
    assert rig.inotify() == {rig.mounts[0]: True, rig.mounts[1]: True} and reader.alive
    assert reader.added == [(m, WATCH_MASK, CALLBACK_ID) for m in sorted(rig.mounts)]
    rig.watcher.refresh(rig.listed)  # nothing moved: no watch added again
    assert len(reader.added) == 2 and rig.made == 1
    assert [r.getMessage() for r in caplog.records] == [
        f"mount {m}: inotify on" for m in sorted(rig.mounts)
    ]


def test_without_inotify_every_mount_is_polled_and_it_is_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="exporter.runtime.watcher")
    rig = Rig(tmp_path, readers=[OSError(24, "Too many open files")])
    rig.start()
    assert rig.inotify() == {m: False for m in rig.mounts}
    said = sorted(r.getMessage() for r in caplog.records)
    assert said == [
        f"mount {m}: inotify unavailable ([Errno 24] Too many open files): polling every inventory interval"
        for m in rig.mounts
    ]
    rig.readers.append(FakeInotify())
    rig.watcher.refresh(
        rig.listed
    )  # tried again each refresh: a limit may have been raised
    assert rig.inotify() == {m: True for m in rig.mounts}


def test_no_inotify_asked_is_polled_and_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="exporter.runtime.watcher")
    rig = Rig(tmp_path, names=("a",), enabled=False)
    rig.start()
    assert rig.inotify() == {rig.mounts[0]: False} and rig.made == 0
    assert [r.getMessage() for r in caplog.records] == [
        f"mount {rig.mounts[0]}: inotify disabled (--no-inotify): polling"
    ]


def test_a_mount_that_cannot_be_watched_is_polled_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="exporter.runtime.watcher")
    a, b, c = (str(tmp_path / n) for n in "abc")
    reader = FakeInotify({a: OSError(28, "No space left on device"), c: -1})
    rig = Rig(tmp_path, names=("a", "b", "c"), readers=[reader])
    rig.start()
    assert rig.inotify() == {a: False, b: True, c: False}
    assert reader.removed == [(-1, CALLBACK_ID)]
    assert [r.getMessage() for r in caplog.records] == [
        f"mount {a}: cannot watch with inotify ([Errno 28] No space left on device): polling",
        f"mount {c}: cannot watch with inotify ([Errno 13] Permission denied): polling",
    ]


def test_an_event_lists_the_name_counts_it_and_wakes_the_inventory(
    tmp_path: Path,
) -> None:
    rig = Rig(tmp_path, names=("a",))
    rig.start()
    [mount] = rig.mounts
    rig.event(b"nccl-1", IN_CREATE)
    rig.event(b"psm_2", IN_MOVED_TO)
    rig.event(b"psm_2", IN_DELETE)
    rig.event(b"torch_3", IN_MOVED_FROM)
    rig.event(b"torch_3", IN_MODIFY)
    rig.event(b"other", IN_ATTRIB)
    assert rig.changes.drain() == {mount: {"nccl-1", "psm_2", "torch_3", "other"}}
    assert rig.state.snapshot().event_rows == {
        mount: (
            ("nccl", "created", 1),
            ("python_shm", "created", 1),
            ("python_shm", "deleted", 1),
            ("torch", "deleted", 1),
        )
    }
    assert rig.wakes == [False] * 6
    assert (
        mount in rig.state.snapshot().peaks
    )  # measured at once: a spike between polls stays


def test_a_directory_event_lists_the_mount_again(tmp_path: Path) -> None:
    rig = Rig(tmp_path, names=("a",))
    rig.start()
    rig.event(b"sub", IN_CREATE | IN_ISDIR)
    assert rig.changes.drain() == {rig.mounts[0]: None}
    assert rig.state.snapshot().event_rows == {} and rig.wakes == [False]


def test_an_event_on_the_directory_itself_or_an_unknown_watch_is_nothing(
    tmp_path: Path,
) -> None:
    rig = Rig(tmp_path, names=("a",))
    rig.start()
    rig.event(b"", IN_ATTRIB)
    rig.event(b"x", IN_CREATE, wd=99)
    assert rig.changes.drain() == {} and rig.wakes == []


def test_one_directory_at_two_paths_is_one_watch_serving_both(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    os.symlink(
        tmp_path / "a", tmp_path / "b"
    )  # a bind mount of it, as far as inotify knows
    rig = Rig(tmp_path, names=("a",))
    rig.listed = [str(tmp_path / "a"), str(tmp_path / "b")]
    rig.start()
    rig.event(b"nccl-x", IN_CREATE)
    assert rig.changes.drain() == {
        str(tmp_path / "a"): {"nccl-x"},
        str(tmp_path / "b"): {"nccl-x"},
    }
    assert rig.wakes == [False, False]
    rig.listed = [str(tmp_path / "b")]  # one path gone: the watch stays the other's
    rig.watcher.refresh(rig.listed)
    assert rig.reader(0).removed == []
    rig.event(b"nccl-y", IN_CREATE)
    assert rig.changes.drain() == {str(tmp_path / "b"): {"nccl-y"}}
    rig.listed = []
    rig.watcher.refresh(rig.listed)
    assert rig.reader(0).removed == [(1, CALLBACK_ID)]
    assert rig.state.snapshot().inotify == {}  # forgotten with its mounts


class Failing(ChangeLog):
    def add(self, mount: str, name: str) -> None:
        if mount.endswith("/a"):
            raise RuntimeError("bad")
        super().add(mount, name)


def test_an_event_that_fails_for_one_mount_is_logged_and_the_others_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "a").mkdir()
    os.symlink(tmp_path / "a", tmp_path / "b")
    rig = Rig(tmp_path, names=("a",), changes=Failing())
    rig.listed = [str(tmp_path / "a"), str(tmp_path / "b")]
    rig.start()
    rig.event(b"nccl-x", IN_CREATE)
    assert rig.changes.drain() == {str(tmp_path / "b"): {"nccl-x"}}
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [
        f"mount {tmp_path / 'a'}: handling an inotify event failed"
    ]


def test_an_overflow_relists_every_watched_mount_in_a_full_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rig = Rig(tmp_path, names=("a", "b", "c"))
    rig.reader(0).refuse = {rig.mounts[2]: OSError(28, "No space left on device")}
    rig.start()
    rig.watcher.on_queue_overflow()
    rig.watcher.on_events_lost()
    a, b, _ = rig.mounts
    assert rig.changes.drain() == {a: None, b: None}
    assert rig.state.snapshot().overflows == {a: 1, b: 1}
    assert rig.wakes == [
        True
    ]  # the planted bug: a quick run leaves leaks 'linked'
    assert (
        "inotify queue overflowed: events were lost on 2 mount(s); running a full inventory"
        in caplog.text
    )


def test_a_watch_the_kernel_dropped_is_polled_then_watched_again(
    tmp_path: Path,
) -> None:
    rig = Rig(tmp_path)
    rig.start()
    a, b = sorted(rig.mounts)
    wd_b = rig.watcher.watches[b].wd
    rig.watcher.on_watch_deleted(wd_b)
    assert rig.inotify() == {a: True, b: False}
    rig.event(b"x", IN_CREATE, wd=wd_b)
    assert rig.changes.drain() == {}
    rig.watcher.refresh(rig.listed)  # a is still watched; b, after it, is watched again
    assert rig.inotify() == {a: True, b: True}


def test_a_mount_mounted_anew_is_watched_anew(tmp_path: Path) -> None:
    (tmp_path / "disk").mkdir()
    os.symlink(tmp_path / "disk", tmp_path / "m")
    rig = Rig(tmp_path, names=())
    rig.listed = [str(tmp_path / "m")]
    rig.start()
    reader = rig.reader(0)
    assert len(reader.added) == 1
    os.unlink(tmp_path / "m")
    os.symlink("/proc", tmp_path / "m")  # another device at the path
    rig.watcher.refresh(rig.listed)
    assert reader.removed == [(1, CALLBACK_ID)] and len(reader.added) == 2
    assert rig.inotify() == {str(tmp_path / "m"): True}


def test_a_dead_reader_is_replaced_and_every_mount_watched_anew(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first, second = FakeInotify(), FakeInotify()
    rig = Rig(tmp_path, readers=[first, second])
    rig.start()
    first.alive = False  # its thread died
    rig.watcher.refresh(rig.listed)
    assert first.stopped and second.alive and len(second.added) == 2
    assert rig.inotify() == {m: True for m in rig.mounts}
    assert "the inotify reader stopped: watching every mount anew" in caplog.text


def test_after_stop_nothing_starts_again(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.start()
    reader = rig.reader(0)
    rig.watcher.stop()
    assert reader.stopped
    rig.watcher.on_watch_deleted(
        1
    )  # the reader closing drops its watches: not "polled"
    assert rig.inotify() == {m: True for m in rig.mounts}
    rig.readers.append(FakeInotify())
    rig.watcher.refresh(rig.listed)
    rig.watcher.on_mounts(MountSet([Target(m) for m in rig.mounts]))
    assert rig.made == 1


def test_a_mount_set_is_refreshed_once_unless_a_mount_is_not_watched(
    tmp_path: Path,
) -> None:
    rig = Rig(tmp_path, readers=[FakeInotify(), FakeInotify()])
    mounts = MountSet([Target(m) for m in rig.mounts])
    rig.watcher.start()  # discovery's sets are watched from here on
    rig.watcher.on_mounts(mounts)
    reader = rig.reader(0)
    assert len(reader.added) == 2
    os.rmdir(
        rig.mounts[0]
    )  # unmounted: noticed on the next refresh, not on the same set
    rig.watcher.on_mounts(mounts)
    assert rig.inotify()[rig.mounts[0]] is True and reader.removed == []
    rig.watcher.on_mounts(
        MountSet(list(mounts.targets))
    )  # a new set (the table changed)
    assert rig.inotify()[rig.mounts[0]] is False and reader.removed == [
        (1, CALLBACK_ID)
    ]
    os.mkdir(rig.mounts[0])  # back
    rig.watcher.on_mounts(
        MountSet(list(mounts.targets))
    )  # a set not wholly watched: again
    assert rig.inotify()[rig.mounts[0]] is True
    settled = MountSet(list(mounts.targets))
    rig.watcher.on_mounts(settled)
    reader.alive = False
    rig.watcher.on_mounts(settled)  # a dead reader unsettles it
    assert rig.made == 2 and len(rig.reader(1).added) == 2


def test_a_set_left_unwatched_is_refreshed_again(tmp_path: Path) -> None:
    rig = Rig(tmp_path, names=("a",), readers=[OSError(24, "EMFILE")])
    mounts = MountSet([Target(rig.mounts[0])])
    rig.watcher.start()
    rig.watcher.on_mounts(mounts)
    rig.watcher.on_mounts(mounts)
    assert rig.made == 2
    off = Rig(tmp_path, names=("a",), enabled=False)
    off.watcher.start()
    off.watcher.on_mounts(mounts)
    off.watcher.on_mounts(mounts)  # polling asked for: settled
    assert off.inotify() == {rig.mounts[0]: False}


def inventory(*mounts: MountInventory) -> Observation:
    return Observation("segments", Inventory(list(mounts), {}, 0, 0), None, 0.1)


def test_polled_mounts_count_the_inventorys_events_once(tmp_path: Path) -> None:
    rig = Rig(tmp_path, readers=[FakeInotify({str(tmp_path / "b"): -1})])
    rig.start()
    a, b = rig.mounts
    watched = MountInventory(a, events={("nccl", "created"): 2})
    polled = MountInventory(b, events={("nccl", "created"): 3, ("torch", "deleted"): 1})
    failed = MountInventory(b, error="gone", events={("nccl", "created"): 9})
    obs = inventory(watched, polled)
    rig.watcher.on_observation(obs)
    rig.watcher.on_observation(obs)  # a quick run hands the untouched inventory back
    rig.watcher.on_observation(Observation("segments", None, "boom", 0.1))
    rig.watcher.on_observation(Observation("sysv", obs.result, None, 0.1))
    rig.watcher.on_observation(inventory(failed))
    assert rig.state.snapshot().event_rows == {
        b: (("nccl", "created", 3), ("torch", "deleted", 1))
    }
    rig.watcher.on_observation(
        inventory(MountInventory(b, events={("nccl", "created"): 1}))
    )
    assert rig.state.snapshot().event_rows[b][0] == ("nccl", "created", 4)


def test_a_mount_gone_is_forgotten_and_its_last_inventory_with_it(
    tmp_path: Path,
) -> None:
    rig = Rig(tmp_path, names=("a",), enabled=False)
    rig.start()
    [a] = rig.mounts
    kept = MountInventory(a, events={("nccl", "created"): 1})
    rig.watcher.on_observation(inventory(kept))
    rig.listed = []
    rig.watcher.refresh(rig.listed)
    rig.listed = [a]
    rig.watcher.refresh(rig.listed)
    rig.watcher.on_observation(
        inventory(kept)
    )  # the same object, after the mount came back
    assert rig.state.snapshot().event_rows == {a: (("nccl", "created", 1),)}


@pytest.mark.parametrize("mask", [IN_CREATE, IN_DELETE])
def test_an_event_in_a_mount_that_cannot_be_measured_still_counts(
    tmp_path: Path, mask: int
) -> None:
    rig = Rig(tmp_path, names=("a",))
    rig.start()
    os.rmdir(rig.mounts[0])  # statvfs fails: the poll reports the mount's error
    rig.event(b"psm_1", mask)
    assert rig.state.snapshot().event_rows[rig.mounts[0]][0][0] == "python_shm"
    assert rig.wakes == [False] and rig.mounts[0] not in rig.state.snapshot().peaks


class Unremovable(FakeInotify):
    def remove_callbacks(self, pairs: List[Tuple[int, int]]) -> None:
        raise OSError(22, "Invalid argument")  # the watch went with its mount


def test_a_watch_that_cannot_be_removed_is_forgotten_all_the_same(
    tmp_path: Path,
) -> None:
    rig = Rig(tmp_path, readers=[Unremovable()])
    rig.start()
    rig.listed = [rig.mounts[0]]
    rig.watcher.refresh(rig.listed)
    assert rig.inotify() == {rig.mounts[0]: True} and list(rig.watcher.watches) == [
        rig.mounts[0]
    ]


def test_a_refresh_keeps_the_last_inventory_of_the_mounts_still_there(
    tmp_path: Path,
) -> None:
    rig = Rig(tmp_path, enabled=False)
    rig.start()
    a, b = rig.mounts
    kept = MountInventory(a, events={("nccl", "created"): 1})
    rig.watcher.on_observation(
        inventory(kept, MountInventory(b, events={("psm", "created"): 1}))
    )
    rig.listed = [a]
    rig.watcher.refresh(rig.listed)
    rig.watcher.on_observation(inventory(kept))  # handed back unchanged by a quick run
    assert rig.state.snapshot().event_rows == {a: (("nccl", "created", 1),)}


def test_a_mount_refused_once_is_watched_when_the_same_set_comes_again(
    tmp_path: Path,
) -> None:
    reader = FakeInotify()
    rig = Rig(tmp_path, readers=[reader])
    a, b = sorted(rig.mounts)
    reader.refuse = {b: OSError(28, "No space left on device")}
    mounts = MountSet([Target(m) for m in rig.mounts])
    rig.watcher.start()
    rig.watcher.on_mounts(mounts)
    assert rig.inotify() == {a: True, b: False}
    reader.refuse = {}  # max_user_watches raised
    rig.watcher.on_mounts(mounts)
    assert rig.inotify() == {a: True, b: True}


def test_an_event_measures_the_mount_at_once(tmp_path: Path) -> None:
    """/dev's use does not move while read: the peak is statvfs's used blocks."""
    rig = Rig(tmp_path, names=())
    rig.listed = ["/dev"]
    rig.start()
    rig.event(b"psm_1", IN_CREATE)
    st = os.statvfs("/dev")
    assert rig.state.snapshot().peaks == {
        "/dev": (st.f_blocks - st.f_bfree) * st.f_frsize
    }


def inotify_instances() -> int:
    """This process's inotify fds (other tests' threads open and close other files)."""
    count = 0
    for fd in os.listdir(f"/proc/{os.getpid()}/fd"):
        try:
            count += os.readlink(f"/proc/{os.getpid()}/fd/{fd}") == "anon_inode:inotify"
        except OSError:
            continue  # closed meanwhile
    return count


def test_the_default_reader_is_a_real_inotify_that_leaves_nothing_open(
    tmp_path: Path,
) -> None:
    (tmp_path / "shm").mkdir()
    fds = inotify_instances()
    woken = threading.Event()
    state, changes = StateStore(), ChangeLog()
    watcher = MountWatcher(state, Paths(), Outlet(changes, lambda full: woken.set()))
    watcher.start()
    watcher.on_mounts(MountSet([Target(str(tmp_path / "shm"))]))
    assert [t.name for t in threading.enumerate() if t.name == "shmwatch-inotify"] == [
        "shmwatch-inotify"
    ]
    (tmp_path / "shm" / "nccl-1").write_bytes(b"x")
    assert woken.wait(5)
    assert changes.drain() == {str(tmp_path / "shm"): {"nccl-1"}}
    assert state.snapshot().event_rows == {
        str(tmp_path / "shm"): (("nccl", "created", 1),)
    }
    watcher.stop()
    assert inotify_instances() == fds
    assert not [t for t in threading.enumerate() if t.name == "shmwatch-inotify"]
