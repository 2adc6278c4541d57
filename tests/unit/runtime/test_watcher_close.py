"""runtime/watcher.close_inotify: the one function that reads watchdog's internals, and the
watchdog behaviour it relies on, pinned (watchdog 7.1). If a watchdog release closes the fd
of a reader stopped before it first read, `test_watchdog_still_keeps_the_fd...` fails: drop
the workaround (and its entries in tests/project/test_lint.py's PINNED_INTERNALS)."""

import os
import threading
from typing import List

from watchdog.observers.inotify_c import InotifyFD
from watchdog.version import VERSION_MAJOR, VERSION_MINOR

from exporter.runtime.watcher import close_inotify


def inotify_fds() -> List[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:inotify":
                found.append(fd)
        except OSError:
            pass  # the listing's own fd, closed
    return found


def test_the_pinned_watchdog_is_7_1() -> None:
    assert (VERSION_MAJOR, VERSION_MINOR) == (7, 1), "pin the behaviour below anew for this version"


def test_watchdog_still_keeps_the_fd_of_a_reader_stopped_before_it_read() -> None:
    """The library's bug the workaround is for: `_is_reading` starts True, and only the read
    loop closes the fd: a reader stopped before its thread read is closed, "reading", and
    keeps its inotify fd. (What close_inotify reads: `_closed`, `_is_reading`; and calls:
    `_close_resources`.)"""
    before = len(inotify_fds())
    reader = InotifyFD()
    try:
        assert len(inotify_fds()) == before + 1
        reader.stop()  # never started: its thread never read
        assert reader._closed and reader._is_reading and not reader.is_alive()
        assert len(inotify_fds()) == before + 1, "watchdog now closes it: drop close_inotify's workaround"
    finally:
        reader._close_resources()
    assert len(inotify_fds()) == before


def test_a_reader_stopped_before_it_read_has_its_fd_closed() -> None:
    before = len(inotify_fds())
    close_inotify(InotifyFD())  # never started
    assert len(inotify_fds()) == before


def test_a_running_reader_is_stopped_and_its_fd_closed_once() -> None:
    before = len(inotify_fds())
    reader = InotifyFD()
    reader.start()
    close_inotify(reader)
    assert not reader.is_alive()
    assert len(inotify_fds()) == before
    assert not [t for t in threading.enumerate() if t is reader]
