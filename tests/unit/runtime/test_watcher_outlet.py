"""runtime/watcher.py: what the watcher tells the scheduler (its WatchOutlet): the names that
changed, events lost, and whether inotify watches every mount (node mode's inventory
stretches only then), with a fake inotify reader at the library boundary."""

import os
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from exporter.host.paths import Paths
from exporter.model.state import StateStore
from exporter.model.types import MountSet, Observation, Target
from exporter.runtime.watcher import IN_CREATE, IN_ISDIR, MountWatcher


class Reader:
    """One inotify instance: a watch per directory, none for a path in `refused`."""

    def __init__(self, refused: Sequence[str] = ()) -> None:
        self.refused, self.alive = set(refused), False
        self.wds: Dict[str, int] = {}

    def start(self) -> None:
        self.alive = True

    def stop(self) -> None:
        self.alive = False

    def join(self, timeout: Optional[float] = None) -> None:
        return None

    def is_alive(self) -> bool:
        return self.alive

    def add_callback(self, path: bytes, mask: int, callback: Any, id_: int) -> int:
        if os.fsdecode(path) in self.refused:
            raise OSError(28, "No space left on device")  # max_user_watches
        return self.wds.setdefault(os.fsdecode(path), len(self.wds) + 1)

    def remove_callbacks(self, callbacks: List[Tuple[int, int]]) -> None:
        return None


class Outlet:
    def __init__(self) -> None:
        self.said: List[Tuple[str, object]] = []

    def changed(self, mount: str, name: Optional[str]) -> None:
        self.said.append(("changed", (mount, name)))

    def lost(self, mounts: Sequence[str]) -> None:
        self.said.append(("lost", sorted(mounts)))

    def watching(self, every_mount: bool) -> None:
        self.said.append(("watching", every_mount))


class Event:
    def __init__(self, wd: int, mask: int, name: bytes) -> None:
        self.wd, self.mask, self.name = wd, mask, name


def mounts(tmp_path: Path, *names: str) -> List[str]:
    made = []
    for name in names:
        (tmp_path / name).mkdir(exist_ok=True)
        made.append(str(tmp_path / name))
    return made


def test_every_mount_watched_is_said_and_a_dropped_watch_unsays_it(
    tmp_path: Path,
) -> None:
    a, b = mounts(tmp_path, "a", "b")
    outlet, reader = Outlet(), Reader()
    watcher = MountWatcher(
        StateStore(), Paths(), outlet, inotify_factory=lambda: reader
    )
    watcher.refresh([a, b])
    assert outlet.said[-1] == ("watching", True)
    watcher.on_watch_deleted(watcher.watches[b].wd)  # b unmounted
    assert outlet.said[-1] == ("watching", False)
    watcher.refresh([a])  # the pod gone from discovery's set: every mount watched again
    assert outlet.said[-1] == ("watching", True)


def test_a_mount_inotify_cannot_watch_is_not_every_mount_watched(
    tmp_path: Path,
) -> None:
    a, b = mounts(tmp_path, "a", "b")
    outlet = Outlet()
    watcher = MountWatcher(
        StateStore(), Paths(), outlet, inotify_factory=lambda: Reader([b])
    )
    watcher.refresh([a, b])
    assert outlet.said[-1] == ("watching", False)
    polled = MountWatcher(StateStore(), Paths(), outlet, enabled=False)  # --no-inotify
    polled.refresh([a])
    assert outlet.said[-1] == ("watching", False)


def test_events_are_told_by_name_and_a_directory_as_anything_below_it(
    tmp_path: Path,
) -> None:
    (a,) = mounts(tmp_path, "a")
    outlet, reader = Outlet(), Reader()
    watcher = MountWatcher(
        StateStore(), Paths(), outlet, inotify_factory=lambda: reader
    )
    watcher.refresh([a])
    wd = watcher.watches[a].wd
    watcher.on_event(Event(wd, IN_CREATE, b"psm_x"))
    watcher.on_event(Event(wd, IN_CREATE | IN_ISDIR, b"sub"))
    watcher.on_queue_overflow()
    assert outlet.said[1:] == [
        ("changed", (a, "psm_x")),
        ("changed", (a, None)),
        ("lost", [a]),
    ]


def test_discovery_sets_are_watched_from_start_on(tmp_path: Path) -> None:
    """A scheduler subscriber: discovery's published sets are watched once started (`check`
    never starts it); a failed discovery run changes nothing."""
    a, b = mounts(tmp_path, "a", "b")
    outlet, reader = Outlet(), Reader()
    watcher = MountWatcher(
        StateStore(), Paths(), outlet, inotify_factory=lambda: reader
    )
    found = Observation("discovery", MountSet([Target(a), Target(b)]), None, 0.0)
    watcher.on_observation(found)
    assert not watcher.watches and not reader.alive
    watcher.start()
    watcher.on_observation(found)
    assert sorted(watcher.watches) == [a, b] and reader.alive
    watcher.on_observation(Observation("discovery", None, "mountinfo unreadable", 0.0))
    assert sorted(watcher.watches) == [a, b]
    watcher.on_observation(Observation("discovery", MountSet([Target(a)]), None, 0.0))
    assert sorted(watcher.watches) == [a]


class SlowOutlet(Outlet):
    """An outlet whose first `watching(True)` is held up (the refresh's thread descheduled
    before the word lands) until `release`."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def watching(self, every_mount: bool) -> None:
        if every_mount and not self.entered.is_set():
            self.entered.set()
            self.release.wait(10)
        super().watching(every_mount)


def test_a_watch_dropped_while_a_refresh_says_every_mount_watched_has_the_last_word(
    tmp_path: Path,
) -> None:
    """A refresh finds every mount watched; before its word lands, the kernel drops a watch
    and the inotify thread says so. The drop's False is the last word: the runs are told a
    mount is polled (node mode's inventory does not stretch past its changes). (Told
    outside the watcher's lock, the refresh's stale True landed last.)"""
    a, b = mounts(tmp_path, "a", "b")
    outlet, reader = SlowOutlet(), Reader()
    watcher = MountWatcher(
        StateStore(), Paths(), outlet, inotify_factory=lambda: reader
    )
    refresh = threading.Thread(target=watcher.refresh, args=([a, b],), daemon=True)
    refresh.start()
    try:
        assert outlet.entered.wait(10)
        wd = watcher.watches[b].wd
        dropped = threading.Thread(target=watcher.on_watch_deleted, args=(wd,))
        dropped.start()
        dropped.join(0.5)  # it waits for the refresh's word, or lands first
    finally:
        outlet.release.set()
    refresh.join(10)
    dropped.join(10)
    assert outlet.said[-1] == ("watching", False), outlet.said
