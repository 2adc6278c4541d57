"""Loaded by the benchmarks only (their exporters' PYTHONPATH): each Python thread started
after it writes its name into /proc/<pid>/task/<tid>/comm as it starts, so a benchmark can
read CPU per thread by name (bench/node_scale.py --tree). The kernel keeps 15 bytes of a
name; the main thread keeps the command's.

threading.setprofile's function runs first in every thread started after it is set, inside
that thread: it names the thread and takes itself away, so nothing else is profiled. Only
before Python 3.12: from 3.12 sys.setprofile switches instrumentation for the whole
interpreter each time, which would change what is measured (threads then keep no name)."""

import ctypes
import sys
import threading

PR_SET_NAME = 15
_libc = ctypes.CDLL(None, use_errno=True)


def name_this_thread(*_: object) -> None:
    sys.setprofile(None)
    name = threading.current_thread().name.removeprefix("shmwatch-")  # 15 bytes are few
    _libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


if sys.version_info < (3, 12):
    threading.setprofile(name_this_thread)
